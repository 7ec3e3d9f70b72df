"""DCUtR (direct connection upgrade through relay): the message codec and the exchange's state machine.

Theory of operation
-------------------
Spec: libp2p specs relay/DCUtR.md (r0, 2021-08-17). Protocol `/libp2p/dcutr`, messages are
varint-length-prefixed protobuf HolePunch{type = CONNECT (100) | SYNC (300), ObsAddrs = 2 (repeated
binary multiaddrs)}, at most 4 KiB.

Two peers already share a relayed connection. The peer that *received* it (the inbound side, which
the spec calls B) starts:

    INITIATOR:  send CONNECT(our addrs), note the time          -> INITIATOR_EXPECT_CONNECT
                on CONNECT(their addrs): rtt = now - sent,
                send SYNC, dial them at now + rtt / 2           -> DIAL (a DialAt event)
    RESPONDER:  on CONNECT(their addrs): send CONNECT(ours)     -> RESPONDER_EXPECT_SYNC
                on SYNC: dial them now                          -> DIAL (a DialAt event)

The half-RTT wait lines the two dials up so that both SYNs leave at about the same moment and each
NAT sees its own peer's SYN go out before the other's arrives (a TCP simultaneous open). The same
stream may carry up to MAX_ATTEMPTS rounds; `retry()` moves a finished initiator back to the start.
Any other message in any state is a RemoteProtocolError and ends the exchange. Time is passed in.

Left out: QUIC (we dial TCP only); the unilateral upgrade (dialing the other side's public address
first) is left to the driver, which simply tries a direct dial before starting an exchange.
"""

import enum
from dataclasses import dataclass

from . import pb
from .errors import LocalProtocolError, RemoteProtocolError

PROTOCOL = "/libp2p/dcutr"
MAX_MESSAGE_SIZE = 4096
MAX_ADDRS = 16
MAX_ATTEMPTS = 3
CONNECT, SYNC = 100, 300

_SCHEMA = {"type": (1, "uint"), "addrs": (2, "bytes*")}


def encode(kind: int, addrs: list[bytes] | tuple[bytes, ...] = ()) -> bytes:
    return pb.encode(_SCHEMA, {"type": kind, "addrs": list(addrs)[:MAX_ADDRS]})


def decode(data) -> tuple[int, tuple[bytes, ...]]:
    """(type, addrs) of a HolePunch message; malformed, oversized or unknown types raise RemoteProtocolError."""
    if len(data) > MAX_MESSAGE_SIZE:
        raise RemoteProtocolError(f"DCUtR message of {len(data)} bytes exceeds {MAX_MESSAGE_SIZE}")
    try:
        fields = pb.decode(_SCHEMA, data)
    except pb.ProtobufError as error:
        raise RemoteProtocolError(f"malformed DCUtR message: {error}") from None
    kind = fields.get("type")
    if kind not in (CONNECT, SYNC):
        raise RemoteProtocolError(f"DCUtR message has missing or unknown type {kind}")
    addrs = fields["addrs"]
    if len(addrs) > MAX_ADDRS or any(len(addr) > 1024 for addr in addrs):
        raise RemoteProtocolError("DCUtR message lists too many or too long addresses")
    return kind, tuple(addrs)


class State(enum.Enum):
    INITIATOR_START = "initiator start"
    INITIATOR_EXPECT_CONNECT = "initiator expecting CONNECT"
    RESPONDER_EXPECT_CONNECT = "responder expecting CONNECT"
    RESPONDER_EXPECT_SYNC = "responder expecting SYNC"
    DIAL = "dial"
    ERROR = "error"


@dataclass(frozen=True)
class DialAt:
    """Dial `addrs` (binary multiaddrs) at time `when`."""

    when: float
    addrs: tuple[bytes, ...]


class HolePunch:
    """One DCUtR exchange, either side. Feed messages with `receive`; take bytes from `data_to_send`."""

    def __init__(self, initiator: bool, our_addrs: list[bytes]):
        self.initiator, self.our_addrs = initiator, tuple(our_addrs)[:MAX_ADDRS]
        self.state = State.INITIATOR_START if initiator else State.RESPONDER_EXPECT_CONNECT
        self.attempts = 0
        self.rtt: float | None = None
        self._sent_at = 0.0
        self._their_addrs: tuple[bytes, ...] = ()
        self._out: list[bytes] = []

    def start(self, now: float) -> None:
        """Initiator: send CONNECT (the first or a retried attempt)."""
        if self.state is not State.INITIATOR_START:
            raise LocalProtocolError(f"cannot start a DCUtR attempt in state {self.state.value}")
        self.attempts += 1
        self._out.append(encode(CONNECT, self.our_addrs))
        self._sent_at = now
        self.state = State.INITIATOR_EXPECT_CONNECT

    def retry(self) -> bool:
        """After a failed dial: go back to the start if attempts remain (initiator only)."""
        if not self.initiator or self.state is not State.DIAL or self.attempts >= MAX_ATTEMPTS:
            return False
        self.state = State.INITIATOR_START
        return True

    def receive(self, data, now: float) -> DialAt | None:
        """Handle one message (without its length prefix). Returns when and where to dial, if it is time."""
        try:
            kind, addrs = decode(data)
            if self.state is State.INITIATOR_EXPECT_CONNECT and kind == CONNECT:
                self.rtt = max(0.0, now - self._sent_at)
                self._out.append(encode(SYNC))
                self.state = State.DIAL
                return DialAt(now + self.rtt / 2, addrs)
            if self.state is State.RESPONDER_EXPECT_CONNECT and kind == CONNECT:
                self.attempts += 1
                self._their_addrs = addrs
                self._out.append(encode(CONNECT, self.our_addrs))
                self.state = State.RESPONDER_EXPECT_SYNC
                return None
            if self.state is State.RESPONDER_EXPECT_SYNC and kind == SYNC:
                self.state = State.DIAL
                return DialAt(now, self._their_addrs)
            if self.state is State.DIAL and not self.initiator and kind == CONNECT:  # the initiator retries
                if self.attempts >= MAX_ATTEMPTS:
                    raise RemoteProtocolError(f"peer started more than {MAX_ATTEMPTS} DCUtR attempts")
                self.state = State.RESPONDER_EXPECT_CONNECT
                return self.receive(data, now)
            raise RemoteProtocolError(f"unexpected DCUtR message type {kind} in state {self.state.value}")
        except RemoteProtocolError:
            self.state = State.ERROR
            raise

    def data_to_send(self) -> list[bytes]:
        """Messages to write, each to be sent with a varint length prefix."""
        out, self._out = self._out, []
        return out
