"""Circuit relay v2: message codecs, reservation vouchers and the relay's resource bookkeeping.

Theory of operation
-------------------
Spec: libp2p specs relay/circuit-v2.md (r0, 2021-05-05), signed envelopes RFC 0002.

Two protocols, each one varint-length-prefixed protobuf per message (at most MAX_MESSAGE_SIZE):

- hop (`/libp2p/circuit/relay/0.2.0/hop`), client -> relay. A private peer sends RESERVE and gets
  STATUS{OK, reservation{expire, addrs, voucher}, limit}; it keeps its connection to the relay open
  and renews before `expire`. A dialer sends CONNECT{peer{id}} and gets STATUS; after OK the same
  stream carries the relayed bytes.
- stop (`/libp2p/circuit/relay/0.2.0/stop`), relay -> reserved peer: CONNECT{peer{id of the
  dialer}, limit} answered by STATUS. After OK the stream carries the relayed bytes.

Observed addresses. Our relay names, in the stop CONNECT, the address it saw the dialer's connection
come from (`Peer.addrs`, which the spec leaves free), and in the hop STATUS answering a CONNECT, the
address it saw the target's connection come from. Hole punching dials only addresses on such
observed IPs (plexus/p2p/dial_rule.py); relays that say nothing there (go-libp2p's) give it none.

The relayed bytes are a whole new secure session (Noise): the relay names the dialer in the stop
CONNECT, but the target believes only the Noise handshake inside the circuit, so a relay (or a
dialer) cannot make one peer pass for another.

`RelayResources` is the relay's bookkeeping, time passed in: who holds a reservation until when, how
many reservations each source IP holds, how many circuits are open per peer and in total. Every
bound is in `RelayLimits`. Decisions come back as `Status` codes, which the driver sends as they are.

Vouchers are signed envelopes (domain "libp2p-relay-rsvp", payload type bytes 03 02) whose
payload is Voucher{relay, peer, expiration}; the spec says they are advisory, and we only check
them when asked.

Left out: active relaying (dialing a target we have no connection to) is deprecated by the spec and
refused with NO_RESERVATION; ACLs beyond the limits.
"""

import enum
from dataclasses import dataclass, field

from ..identity import IdentityError, PeerID, PrivateKey, PublicKey
from . import pb
from .errors import RemoteProtocolError
from .varint import encode_uvarint

HOP_PROTOCOL = "/libp2p/circuit/relay/0.2.0/hop"
STOP_PROTOCOL = "/libp2p/circuit/relay/0.2.0/stop"
MAX_MESSAGE_SIZE = 4096  # go-libp2p's bound; real messages are a few hundred bytes
MAX_ADDRS = 32
MAX_ADDR_SIZE = 1024
VOUCHER_DOMAIN = "libp2p-relay-rsvp"
VOUCHER_PAYLOAD_TYPE = b"\x03\x02"  # the code 0x0302 as two big-endian bytes, as go-libp2p writes it


class HopType(enum.IntEnum):
    RESERVE = 0
    CONNECT = 1
    STATUS = 2


class StopType(enum.IntEnum):
    CONNECT = 0
    STATUS = 1


class Status(enum.IntEnum):
    OK = 100
    RESERVATION_REFUSED = 200
    RESOURCE_LIMIT_EXCEEDED = 201
    PERMISSION_DENIED = 202
    CONNECTION_FAILED = 203
    NO_RESERVATION = 204
    MALFORMED_MESSAGE = 400
    UNEXPECTED_MESSAGE = 401


_HOP = {
    "type": (1, "uint"),
    "peer": (2, "bytes"),
    "reservation": (3, "bytes"),
    "limit": (4, "bytes"),
    "status": (5, "uint"),
}
_STOP = {"type": (1, "uint"), "peer": (2, "bytes"), "limit": (3, "bytes"), "status": (4, "uint")}
_PEER = {"id": (1, "bytes"), "addrs": (2, "bytes*")}
_RESERVATION = {"expire": (1, "uint"), "addrs": (2, "bytes*"), "voucher": (3, "bytes")}
_LIMIT = {"duration": (1, "uint"), "data": (2, "uint")}
_VOUCHER = {"relay": (1, "bytes"), "peer": (2, "bytes"), "expiration": (3, "uint")}
_ENVELOPE = {
    "public_key": (1, "bytes"),
    "payload_type": (2, "bytes"),
    "payload": (3, "bytes"),
    "signature": (5, "bytes"),
}


@dataclass(frozen=True)
class Limit:
    """Per-circuit limits: seconds (0 = none) and bytes in each direction (0 = none)."""

    duration: int = 0
    data: int = 0


@dataclass(frozen=True)
class Reservation:
    expire: int  # UNIX seconds, UTC
    addrs: tuple[bytes, ...] = ()  # binary multiaddrs of the relay, each ending in /p2p/<relay>
    voucher: bytes | None = None


@dataclass(frozen=True)
class HopMessage:
    type: HopType
    peer: PeerID | None = None
    peer_addrs: tuple[bytes, ...] = ()
    reservation: Reservation | None = None
    limit: Limit | None = None
    status: Status | None = None


@dataclass(frozen=True)
class StopMessage:
    type: StopType
    peer: PeerID | None = None
    limit: Limit | None = None
    status: Status | None = None
    peer_addrs: tuple[bytes, ...] = ()  # where the relay saw `peer` connect from (see the module comment)


# --- codecs --------------------------------------------------------------------------------------


def _encode_peer(peer: PeerID | None, addrs=()) -> bytes | None:
    return None if peer is None else pb.encode(_PEER, {"id": peer.to_bytes(), "addrs": list(addrs)})


def _encode_limit(limit: Limit | None) -> bytes | None:
    return (
        None
        if limit is None
        else pb.encode(_LIMIT, {"duration": limit.duration or None, "data": limit.data or None})
    )


def encode_hop(message: HopMessage) -> bytes:
    reservation = None
    if (r := message.reservation) is not None:
        reservation = pb.encode(
            _RESERVATION, {"expire": r.expire, "addrs": list(r.addrs), "voucher": r.voucher}
        )
    return pb.encode(
        _HOP,
        {
            "type": int(message.type),
            "peer": _encode_peer(message.peer, message.peer_addrs),
            "reservation": reservation,
            "limit": _encode_limit(message.limit),
            "status": None if message.status is None else int(message.status),
        },
    )


def encode_stop(message: StopMessage) -> bytes:
    return pb.encode(
        _STOP,
        {
            "type": int(message.type),
            "peer": _encode_peer(message.peer, message.peer_addrs),
            "limit": _encode_limit(message.limit),
            "status": None if message.status is None else int(message.status),
        },
    )


def _decode(schema: dict, data, what: str) -> dict:
    if len(data) > MAX_MESSAGE_SIZE:
        raise RemoteProtocolError(f"{what} of {len(data)} bytes exceeds {MAX_MESSAGE_SIZE}")
    try:
        return pb.decode(schema, data)
    except pb.ProtobufError as error:
        raise RemoteProtocolError(f"malformed {what}: {error}") from None


def _decode_peer(raw: bytes | None, what: str) -> tuple[PeerID | None, tuple[bytes, ...]]:
    if raw is None:
        return None, ()
    fields = _decode(_PEER, raw, f"{what} peer")
    if "id" not in fields:
        raise RemoteProtocolError(f"{what} peer has no id")
    try:
        peer = PeerID(fields["id"])
    except (IdentityError, ValueError) as error:
        raise RemoteProtocolError(f"{what} peer id is invalid: {error}") from None
    return peer, _check_addrs(fields["addrs"], what)


def _check_addrs(addrs: list[bytes], what: str) -> tuple[bytes, ...]:
    if len(addrs) > MAX_ADDRS or any(len(addr) > MAX_ADDR_SIZE for addr in addrs):
        raise RemoteProtocolError(f"{what} lists too many or too long addresses")
    return tuple(addrs)


def _decode_limit(raw: bytes | None, what: str) -> Limit | None:
    if raw is None:
        return None
    fields = _decode(_LIMIT, raw, f"{what} limit")
    duration, data = fields.get("duration", 0), fields.get("data", 0)
    if duration >= 1 << 32 or data >= 1 << 64:
        raise RemoteProtocolError(f"{what} limit out of range (duration {duration}, data {data})")
    return Limit(duration, data)


def _decode_status(value: int | None, what: str) -> Status | None:
    if value is None:
        return None
    try:
        return Status(value)
    except ValueError:
        raise RemoteProtocolError(f"{what} has unknown status code {value}") from None


def decode_hop(data) -> HopMessage:
    """Parse and validate a HopMessage; anything malformed raises RemoteProtocolError."""
    fields = _decode(_HOP, data, "hop message")
    try:
        kind = HopType(fields["type"])
    except (KeyError, ValueError):
        raise RemoteProtocolError(f"hop message has missing or unknown type {fields.get('type')}") from None
    peer, addrs = _decode_peer(fields.get("peer"), "hop message")
    reservation = None
    if (raw := fields.get("reservation")) is not None:
        r = _decode(_RESERVATION, raw, "hop reservation")
        if "expire" not in r:
            raise RemoteProtocolError("hop reservation has no expiration time")
        reservation = Reservation(r["expire"], _check_addrs(r["addrs"], "hop reservation"), r.get("voucher"))
    status = _decode_status(fields.get("status"), "hop message")
    if kind is HopType.CONNECT and peer is None:
        raise RemoteProtocolError("hop CONNECT names no target peer")
    if kind is HopType.STATUS and status is None:
        raise RemoteProtocolError("hop STATUS carries no status code")
    return HopMessage(
        kind, peer, addrs, reservation, _decode_limit(fields.get("limit"), "hop message"), status
    )


def decode_stop(data) -> StopMessage:
    """Parse and validate a StopMessage; anything malformed raises RemoteProtocolError."""
    fields = _decode(_STOP, data, "stop message")
    try:
        kind = StopType(fields["type"])
    except (KeyError, ValueError):
        raise RemoteProtocolError(f"stop message has missing or unknown type {fields.get('type')}") from None
    peer, addrs = _decode_peer(fields.get("peer"), "stop message")
    status = _decode_status(fields.get("status"), "stop message")
    if kind is StopType.CONNECT and peer is None:
        raise RemoteProtocolError("stop CONNECT names no initiating peer")
    if kind is StopType.STATUS and status is None:
        raise RemoteProtocolError("stop STATUS carries no status code")
    return StopMessage(kind, peer, _decode_limit(fields.get("limit"), "stop message"), status, addrs)


# --- vouchers (signed envelopes) -------------------------------------------------------------------


@dataclass(frozen=True)
class Voucher:
    relay: PeerID
    peer: PeerID
    expiration: int


def _signed_bytes(domain: str, payload_type: bytes, payload: bytes) -> bytes:
    domain_bytes = domain.encode()
    return b"".join(encode_uvarint(len(part)) + part for part in (domain_bytes, payload_type, payload))


def make_voucher(relay_key: PrivateKey, peer: PeerID, expiration: int) -> bytes:
    """A reservation voucher for `peer`, signed by the relay, as the envelope's bytes."""
    payload = pb.encode(
        _VOUCHER, {"relay": relay_key.peer_id.to_bytes(), "peer": peer.to_bytes(), "expiration": expiration}
    )
    signature = relay_key.sign(_signed_bytes(VOUCHER_DOMAIN, VOUCHER_PAYLOAD_TYPE, payload))
    return pb.encode(
        _ENVELOPE,
        {
            "public_key": relay_key.public_key.to_protobuf(),
            "payload_type": VOUCHER_PAYLOAD_TYPE,
            "payload": payload,
            "signature": signature,
        },
    )


def open_voucher(data: bytes) -> Voucher:
    """Check a voucher's signature and that its signer is the relay it names; return its fields."""
    envelope = _decode(_ENVELOPE, data, "voucher envelope")
    try:
        key = PublicKey.from_protobuf(envelope.get("public_key", b""))
    except (IdentityError, ValueError) as error:
        raise RemoteProtocolError(f"voucher carries an invalid public key: {error}") from None
    payload_type, payload = envelope.get("payload_type", b""), envelope.get("payload", b"")
    if payload_type != VOUCHER_PAYLOAD_TYPE:
        raise RemoteProtocolError(f"voucher has payload type {payload_type.hex()}, not a relay voucher")
    if not key.verify(envelope.get("signature", b""), _signed_bytes(VOUCHER_DOMAIN, payload_type, payload)):
        raise RemoteProtocolError("voucher signature is invalid")
    fields = _decode(_VOUCHER, payload, "voucher")
    try:
        voucher = Voucher(PeerID(fields["relay"]), PeerID(fields["peer"]), fields["expiration"])
    except (KeyError, IdentityError, ValueError) as error:
        raise RemoteProtocolError(f"voucher misses or garbles a field: {error!r}") from None
    if not voucher.relay.matches(key):
        raise RemoteProtocolError("voucher is signed by a key that is not the relay's")
    return voucher


# --- the relay's bookkeeping ------------------------------------------------------------------------


@dataclass(frozen=True)
class RelayLimits:
    """Bounds of a relay service. Times are seconds, sizes bytes."""

    reservation_ttl: int = 3600
    """A reservation lasts this long unless renewed (go-libp2p: 1 h)."""
    max_reservations: int = 128
    """Reservations held at once, all peers together."""
    max_reservations_per_ip: int = 8
    """Reservations from peers seen at one IP address (one machine cannot take every slot)."""
    max_circuits: int = 64
    """Relayed connections open at once, all peers together."""
    max_circuits_per_peer: int = 16
    """Relayed connections open at once to or from one peer."""
    circuit_duration: int = 120
    """A relayed connection is cut after this long (0 = unlimited)."""
    circuit_data: int = 1 << 27
    """A relayed connection is cut after this many bytes in either direction (0 = unlimited)."""

    @property
    def limit(self) -> Limit:
        return Limit(self.circuit_duration, self.circuit_data)


@dataclass
class _Slot:
    expire: float
    ip: str | None


@dataclass
class RelayResources:
    """Who may use the relay right now. Pure bookkeeping: the driver passes `now` (UNIX seconds)."""

    limits: RelayLimits = field(default_factory=RelayLimits)
    reservations: dict[PeerID, _Slot] = field(default_factory=dict)
    circuits: dict[PeerID, int] = field(default_factory=dict)
    open_circuits: int = 0

    def reserve(self, peer: PeerID, ip: str | None, now: float) -> tuple[Status, float]:
        """Grant or renew `peer`'s reservation. Returns (status, expiration time)."""
        self.expire(now)
        if peer not in self.reservations:
            if len(self.reservations) >= self.limits.max_reservations:
                return Status.RESERVATION_REFUSED, 0.0
            same_ip = sum(1 for slot in self.reservations.values() if ip is not None and slot.ip == ip)
            if same_ip >= self.limits.max_reservations_per_ip:
                return Status.RESERVATION_REFUSED, 0.0
        expire = now + self.limits.reservation_ttl
        self.reservations[peer] = _Slot(expire, ip)
        return Status.OK, expire

    def drop_reservation(self, peer: PeerID) -> None:
        """The peer disconnected: the spec ends its reservation with the connection."""
        self.reservations.pop(peer, None)

    def has_reservation(self, peer: PeerID, now: float) -> bool:
        slot = self.reservations.get(peer)
        return slot is not None and slot.expire > now

    def open_circuit(self, source: PeerID, target: PeerID, now: float) -> Status:
        """May `source` open a circuit to `target`? On OK the circuit is counted until closed."""
        if source == target:
            return Status.PERMISSION_DENIED
        if not self.has_reservation(target, now):
            return Status.NO_RESERVATION
        if self.open_circuits >= self.limits.max_circuits:
            return Status.RESOURCE_LIMIT_EXCEEDED
        per_peer = self.limits.max_circuits_per_peer
        if self.circuits.get(source, 0) >= per_peer or self.circuits.get(target, 0) >= per_peer:
            return Status.RESOURCE_LIMIT_EXCEEDED
        for peer in (source, target):
            self.circuits[peer] = self.circuits.get(peer, 0) + 1
        self.open_circuits += 1
        return Status.OK

    def close_circuit(self, source: PeerID, target: PeerID) -> None:
        for peer in (source, target):
            left = self.circuits.get(peer, 0) - 1
            if left > 0:
                self.circuits[peer] = left
            else:
                self.circuits.pop(peer, None)
        self.open_circuits = max(0, self.open_circuits - 1)

    def expire(self, now: float) -> None:
        for peer in [peer for peer, slot in self.reservations.items() if slot.expire <= now]:
            del self.reservations[peer]
