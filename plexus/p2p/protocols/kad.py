"""libp2p Kademlia (`/ipfs/kad/1.0.0`): the message codec, XOR distance, a small table of DHT
servers, and an iterative peer lookup as a state machine.

Theory of operation
-------------------
Spec: libp2p specs kad-dht/README.md (r1, 2021-10-30). Each RPC is one varint-length-prefixed
protobuf `Message{type = 1, key = 2, closerPeers = 8, providerPeers = 9}`, with
`Peer{id = 1, addrs = 2 (binary multiaddrs), connection = 3}`; the answer has the request's type. A
stream may carry several requests in turn. The distance between two keys is the XOR of their
SHA-256 hashes; a peer's key is its binary peer id. We use this DHT for peer routing only:

    FIND_NODE(key = peer id)  -> closerPeers: that peer if the server knows it, else the k closest
    GET_PROVIDERS(key)        -> closerPeers (we store no provider records: providerPeers is empty)
    GET_VALUE(key)            -> closerPeers (we store no records)
    PING                      -> PING

`PeerLookup` finds a peer by id, the spec's "node lookup": it keeps the candidates sorted by
distance to the target, asks the closest not yet asked, at most `alpha` at a time, merges the
closer peers each answer names (with their addresses), and ends when an answer names the target
with at least one address (found), or when the `k` closest candidates have all answered or failed
(not found), or after `max_queries` requests. Time never enters: the driver bounds each request.

`KadTable` holds DHT servers we have talked to (bounded, oldest dropped first), not the spec's
k-buckets: we answer queries from it and start lookups from it, which a short-lived peer in a
big network does not need more than.

Left out: PUT_VALUE/GET_VALUE records, ADD_PROVIDER, k-bucket refresh, S/Kademlia disjoint paths.
"""

import enum
import hashlib
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..identity import IdentityError, PeerID
from . import pb
from .errors import LocalProtocolError, RemoteProtocolError

PROTOCOL = "/ipfs/kad/1.0.0"
MAX_MESSAGE_SIZE = 256 << 10  # an answer names ~20 peers with their addresses: a few KiB, at most tens
MAX_PEERS_PER_MESSAGE = 64
MAX_ADDRS_PER_PEER = 32
MAX_KEY_SIZE = 256
K = 20
ALPHA = 3


class MessageType(enum.IntEnum):
    PUT_VALUE = 0
    GET_VALUE = 1
    ADD_PROVIDER = 2
    GET_PROVIDERS = 3
    FIND_NODE = 4
    PING = 5


class Connectedness(enum.IntEnum):
    NOT_CONNECTED = 0
    CONNECTED = 1
    CAN_CONNECT = 2
    CANNOT_CONNECT = 3


_MESSAGE = {"type": (1, "uint"), "key": (2, "bytes"), "closer": (8, "bytes*"), "providers": (9, "bytes*")}
_PEER = {"id": (1, "bytes"), "addrs": (2, "bytes*"), "connection": (3, "uint")}


@dataclass(frozen=True)
class KadPeer:
    peer_id: PeerID
    addrs: tuple[bytes, ...] = ()
    connection: Connectedness = Connectedness.NOT_CONNECTED


@dataclass(frozen=True)
class KadMessage:
    type: MessageType
    key: bytes = b""
    closer_peers: tuple[KadPeer, ...] = ()
    provider_peers: tuple[KadPeer, ...] = ()


def encode(message: KadMessage) -> bytes:
    if (
        len(message.closer_peers) > MAX_PEERS_PER_MESSAGE
        or len(message.provider_peers) > MAX_PEERS_PER_MESSAGE
    ):
        raise LocalProtocolError(f"a Kademlia message names at most {MAX_PEERS_PER_MESSAGE} peers")
    return pb.encode(
        _MESSAGE,
        {
            "type": int(message.type),
            "key": message.key or None,
            "closer": [_encode_peer(peer) for peer in message.closer_peers],
            "providers": [_encode_peer(peer) for peer in message.provider_peers],
        },
    )


def _encode_peer(peer: KadPeer) -> bytes:
    return pb.encode(
        _PEER,
        {
            "id": peer.peer_id.to_bytes(),
            "addrs": list(peer.addrs[:MAX_ADDRS_PER_PEER]),
            "connection": int(peer.connection) or None,
        },
    )


def decode(data: bytes) -> KadMessage:
    """Parse one message; RemoteProtocolError when it is malformed or past our bounds. Peers with
    unusable ids are dropped and each peer's address list is cut at MAX_ADDRS_PER_PEER."""
    if len(data) > MAX_MESSAGE_SIZE:
        raise RemoteProtocolError(
            f"{len(data)}-byte Kademlia message exceeds the {MAX_MESSAGE_SIZE}-byte limit"
        )
    try:
        fields = pb.decode(_MESSAGE, data)
        message_type = MessageType(fields.get("type", 0))
        key = fields.get("key") or b""
        if len(key) > MAX_KEY_SIZE:
            raise RemoteProtocolError(f"{len(key)}-byte Kademlia key is longer than {MAX_KEY_SIZE}")
        if len(fields["closer"]) > MAX_PEERS_PER_MESSAGE or len(fields["providers"]) > MAX_PEERS_PER_MESSAGE:
            raise RemoteProtocolError(f"a Kademlia message names more than {MAX_PEERS_PER_MESSAGE} peers")
        closer = tuple(filter(None, map(_decode_peer, fields["closer"])))
        providers = tuple(filter(None, map(_decode_peer, fields["providers"])))
    except (pb.ProtobufError, ValueError) as error:
        if isinstance(error, RemoteProtocolError):
            raise
        raise RemoteProtocolError(f"malformed Kademlia message: {error}") from None
    return KadMessage(message_type, key, closer, providers)


def _decode_peer(data: bytes) -> KadPeer | None:
    fields = pb.decode(_PEER, data)
    try:
        peer_id = PeerID(fields.get("id") or b"")
    except (IdentityError, ValueError):
        return None
    connection = fields.get("connection", 0)
    connection = (
        Connectedness(connection) if connection in iter(Connectedness) else Connectedness.NOT_CONNECTED
    )
    return KadPeer(peer_id, tuple(fields["addrs"][:MAX_ADDRS_PER_PEER]), connection)


def kad_key(key: bytes) -> int:
    """Position in the 256-bit key space: SHA-256 of the key (a peer's key is its binary peer id)."""
    return int.from_bytes(hashlib.sha256(key).digest(), "big")


def distance(a: bytes, b: bytes) -> int:
    return kad_key(a) ^ kad_key(b)


class KadTable:
    """DHT servers we know of, with their addresses; bounded, the least recently seen dropped first."""

    def __init__(self, local: PeerID, max_size: int = 1024):
        self.local, self.max_size = local, max_size
        self._peers: OrderedDict[PeerID, tuple[bytes, ...]] = OrderedDict()

    def add(self, peer: PeerID, addrs: Iterable[bytes] = ()) -> None:
        if peer == self.local:
            return
        addrs = tuple(addrs)[:MAX_ADDRS_PER_PEER] or self._peers.get(peer, ())
        self._peers[peer] = addrs
        self._peers.move_to_end(peer)
        while len(self._peers) > self.max_size:
            self._peers.popitem(last=False)

    def remove(self, peer: PeerID) -> None:
        self._peers.pop(peer, None)

    def __contains__(self, peer: PeerID) -> bool:
        return peer in self._peers

    def __len__(self) -> int:
        return len(self._peers)

    def closest(self, key: bytes, count: int = K, exclude: Iterable[PeerID] = ()) -> list[PeerID]:
        target, excluded = kad_key(key), set(exclude)
        peers = [peer for peer in self._peers if peer not in excluded]
        return sorted(peers, key=lambda peer: kad_key(peer.to_bytes()) ^ target)[:count]


@dataclass
class _Candidate:
    peer: KadPeer
    state: str = "new"  # new -> asked -> answered | failed


@dataclass
class PeerLookup:
    """An iterative FIND_NODE for `target`; see the module docstring. Drive it with `next_queries()`,
    then `on_answer()` / `on_failure()` for each query, until `done`."""

    target: PeerID
    seeds: Iterable[KadPeer]
    local: PeerID
    k: int = K
    alpha: int = ALPHA
    max_queries: int = 64
    found: KadPeer | None = None
    queries: int = 0
    _candidates: dict[PeerID, _Candidate] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._target_key = kad_key(self.target.to_bytes())
        for peer in self.seeds:
            self._add(peer)

    def _add(self, peer: KadPeer) -> None:
        if peer.peer_id == self.local:
            return
        if peer.peer_id == self.target and peer.addrs:
            self.found = peer
        known = self._candidates.get(peer.peer_id)
        if known is None:
            if peer.peer_id != self.target:
                self._candidates[peer.peer_id] = _Candidate(peer)
        elif not known.peer.addrs and peer.addrs:
            known.peer = peer

    def _closest(self) -> list[_Candidate]:
        live = [c for c in self._candidates.values() if c.state != "failed"]
        return sorted(live, key=lambda c: kad_key(c.peer.peer_id.to_bytes()) ^ self._target_key)[: self.k]

    @property
    def in_flight(self) -> int:
        return sum(c.state == "asked" for c in self._candidates.values())

    @property
    def done(self) -> bool:
        if self.found is not None:
            return True
        if self.in_flight:
            return False
        return self.queries >= self.max_queries or all(c.state != "new" for c in self._closest())

    def next_queries(self) -> list[KadPeer]:
        """Peers to ask now (each once); empty when alpha queries are in flight or nothing is left."""
        if self.done:
            return []
        chosen = []
        for candidate in self._closest():
            if self.in_flight >= self.alpha or self.queries >= self.max_queries:
                break
            if candidate.state == "new":
                candidate.state = "asked"
                self.queries += 1
                chosen.append(candidate.peer)
        return chosen

    def on_answer(self, peer: PeerID, answer: KadMessage) -> None:
        self._finish(peer, "answered")
        for closer in answer.closer_peers:
            self._add(closer)

    def on_failure(self, peer: PeerID) -> None:
        self._finish(peer, "failed")

    def _finish(self, peer: PeerID, state: str) -> None:
        candidate = self._candidates.get(peer)
        if candidate is None or candidate.state != "asked":
            raise LocalProtocolError(f"no query to {peer} is in flight")
        candidate.state = state

    @property
    def answered(self) -> list[PeerID]:
        """Peers that answered, closest first: the DHT servers this lookup met."""
        return [c.peer.peer_id for c in self._closest() if c.state == "answered"]


def answer(
    request: KadMessage, table: KadTable, addrs_of, local: KadPeer, requester: PeerID
) -> KadMessage | None:
    """The server's reply to `request` (None: no reply, for types we do not serve). `addrs_of(peer)`
    gives the binary addresses we know of a peer; peers without any are not named."""
    if request.type is MessageType.PING:
        return KadMessage(MessageType.PING)
    if request.type not in (MessageType.FIND_NODE, MessageType.GET_PROVIDERS, MessageType.GET_VALUE):
        return None
    if request.type is MessageType.FIND_NODE:
        if request.key == local.peer_id.to_bytes():
            return KadMessage(request.type, request.key, (local,))
        try:
            wanted = PeerID(request.key)
        except (IdentityError, ValueError):
            wanted = None
        if wanted is not None and wanted != requester and (addrs := addrs_of(wanted)):
            return KadMessage(request.type, request.key, (KadPeer(wanted, tuple(addrs)),))
    closer = []
    for peer in table.closest(request.key, K, exclude=(requester,)):
        if addrs := addrs_of(peer):
            closer.append(KadPeer(peer, tuple(addrs)))
    return KadMessage(request.type, request.key, tuple(closer))
