"""AutoNAT v1: am I reachable? Messages, the server's address filter, and the client's verdict.

Theory of operation
-------------------
Spec: libp2p specs autonat/autonat-v1.md (r1, 2023-02-16). Protocol `/libp2p/autonat/1.0.0`; one
varint-length-prefixed protobuf request, one response, at most MAX_MESSAGE_SIZE each:

    Message{type = DIAL (0),          dial = Dial{peer = PeerInfo{id, addrs}}}
    Message{type = DIAL_RESPONSE (1), dialResponse = {status, statusText, addr}}

The server dials the client back on the addresses it lists and answers OK (with the address that
worked), E_DIAL_ERROR (none worked), E_DIAL_REFUSED (it will not try: relayed request, no address it
may dial, too busy) or E_BAD_REQUEST. To keep AutoNAT from being an amplifier (RFC 3489 12.1.1), the
server only dials addresses on the IP it observed the request come from (plexus/p2p/dial_rule.py).

The client's verdict (`Reachability`) comes from the last few answers (`ReachabilityTracker`):
public once `confidence` dial-backs worked and outnumber the failures, private once `confidence`
failed and outnumber the successes, unknown otherwise. The spec suggests more than three servers;
small swarms may only have one, hence the knob.

Left out: AutoNAT v2 (per-address checks with nonces).
"""

import enum
from collections import deque
from dataclasses import dataclass

from ..identity import IdentityError, PeerID
from . import pb
from .errors import RemoteProtocolError

PROTOCOL = "/libp2p/autonat/1.0.0"
MAX_MESSAGE_SIZE = 4096
MAX_ADDRS = 16
DIAL, DIAL_RESPONSE = 0, 1


class ResponseStatus(enum.IntEnum):
    OK = 0
    E_DIAL_ERROR = 100
    E_DIAL_REFUSED = 101
    E_BAD_REQUEST = 200
    E_INTERNAL_ERROR = 300


_MESSAGE = {"type": (1, "uint"), "dial": (2, "bytes"), "dial_response": (3, "bytes")}
_DIAL = {"peer": (1, "bytes")}
_PEER_INFO = {"id": (1, "bytes"), "addrs": (2, "bytes*")}
_RESPONSE = {"status": (1, "uint"), "status_text": (2, "string"), "addr": (3, "bytes")}


@dataclass(frozen=True)
class DialRequest:
    peer: PeerID
    addrs: tuple[bytes, ...]


@dataclass(frozen=True)
class DialResponse:
    status: ResponseStatus
    text: str = ""
    addr: bytes | None = None


def encode_request(peer: PeerID, addrs) -> bytes:
    info = pb.encode(_PEER_INFO, {"id": peer.to_bytes(), "addrs": list(addrs)[:MAX_ADDRS]})
    return pb.encode(_MESSAGE, {"type": DIAL, "dial": pb.encode(_DIAL, {"peer": info})})


def encode_response(response: DialResponse) -> bytes:
    body = pb.encode(
        _RESPONSE,
        {"status": int(response.status), "status_text": response.text or None, "addr": response.addr},
    )
    return pb.encode(_MESSAGE, {"type": DIAL_RESPONSE, "dial_response": body})


def _decode(schema, data, what):
    if len(data) > MAX_MESSAGE_SIZE:
        raise RemoteProtocolError(f"AutoNAT {what} of {len(data)} bytes exceeds {MAX_MESSAGE_SIZE}")
    try:
        return pb.decode(schema, data)
    except pb.ProtobufError as error:
        raise RemoteProtocolError(f"malformed AutoNAT {what}: {error}") from None


def decode_request(data) -> DialRequest:
    message = _decode(_MESSAGE, data, "message")
    if message.get("type") != DIAL or message.get("dial") is None:
        raise RemoteProtocolError(f"expected an AutoNAT DIAL, got type {message.get('type')}")
    peer_info = _decode(_DIAL, message["dial"], "dial").get("peer")
    if peer_info is None:
        raise RemoteProtocolError("AutoNAT DIAL names no peer")
    info = _decode(_PEER_INFO, peer_info, "peer info")
    try:
        peer = PeerID(info.get("id", b""))
    except (IdentityError, ValueError) as error:
        raise RemoteProtocolError(f"AutoNAT DIAL has an invalid peer id: {error}") from None
    if len(info["addrs"]) > MAX_ADDRS:
        raise RemoteProtocolError(f"AutoNAT DIAL lists {len(info['addrs'])} addresses, more than {MAX_ADDRS}")
    return DialRequest(peer, tuple(info["addrs"]))


def decode_response(data) -> DialResponse:
    message = _decode(_MESSAGE, data, "message")
    if message.get("type") != DIAL_RESPONSE or message.get("dial_response") is None:
        raise RemoteProtocolError(f"expected an AutoNAT DIAL_RESPONSE, got type {message.get('type')}")
    fields = _decode(_RESPONSE, message["dial_response"], "dial response")
    try:
        status = ResponseStatus(fields.get("status", 0))
    except ValueError:
        raise RemoteProtocolError(f"AutoNAT response has unknown status {fields.get('status')}") from None
    return DialResponse(status, fields.get("status_text", ""), fields.get("addr"))


class Reachability(enum.Enum):
    PUBLIC = "public"
    PRIVATE = "private"
    UNKNOWN = "unknown"


class ReachabilityTracker:
    """The verdict from the last `window` dial-back results."""

    def __init__(self, confidence: int = 3, window: int | None = None):
        self.confidence = confidence
        self.results: deque[bool] = deque(maxlen=window or 2 * confidence + 1)

    def record(self, reachable: bool) -> Reachability:
        self.results.append(reachable)
        return self.status

    @property
    def status(self) -> Reachability:
        ok = sum(self.results)
        failed = len(self.results) - ok
        if ok >= self.confidence and ok > failed:
            return Reachability.PUBLIC
        if failed >= self.confidence and failed > ok:
            return Reachability.PRIVATE
        return Reachability.UNKNOWN


def choose_mode(reachability: Reachability, relays_available: bool) -> str:
    """What a peer should do about it: "direct" (listen and advertise), "relay" (reserve on relays and
    advertise circuit addresses) or "client" (only dial out)."""
    if reachability is Reachability.PRIVATE:
        return "relay" if relays_available else "client"
    return "direct"
