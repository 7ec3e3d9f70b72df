"""Kademlia routing table over the XOR metric (Maymounkov & Mazières 2002, sections 2.2-2.4, 4.1-4.2).

Theory of operation. Ids are 160-bit integers (`DHTID`). The table covers [0, 2^160) with
k-buckets, each an aligned power-of-two range holding up to k peers in least-recently-seen order,
plus a bounded replacement list of peers that did not fit. A newcomer to a full bucket splits it if
the bucket covers our own id, or if its depth is not a multiple of `depth_modulo` (the relaxed rule
of section 4.2, which keeps a few far buckets finely split so lookups converge in fewer hops).
Otherwise the newcomer waits in the replacement list and the caller is told to ping the bucket's
least-recently-seen peer; if that ping fails, `remove` evicts it and promotes the freshest
replacement. The table does no I/O and reads no clock: the node passes `now` and does the pings.

The DHT id is separate from the libp2p PeerID; the table maps one to the other both ways.
"""

import hashlib
import heapq
import os
from typing import Any, Iterator

from ..p2p.identity import PeerID
from ..utils.serializer import MSGPackSerializer

ID_BITS = 160
ID_BYTES = ID_BITS // 8
MAX_REPLACEMENTS_FACTOR = 1  # replacement list holds at most this many buckets' worth of peers


class DHTID(int):
    """A 160-bit Kademlia id; distance between ids is their XOR."""

    MIN, MAX = 0, 2**ID_BITS

    def __new__(cls, value: int):
        if not 0 <= value < cls.MAX:
            raise ValueError(f"DHTID must be in [0, 2^{ID_BITS}), got {value}")
        return super().__new__(cls, value)

    @classmethod
    def generate(cls, source: Any = None) -> "DHTID":
        """SHA-1 of `source` (of msgpack(source) unless it is bytes); of random bits when None."""
        if source is None:
            source = os.urandom(ID_BYTES)
        if not isinstance(source, bytes):
            source = MSGPackSerializer.dumps(source)
        return cls(int.from_bytes(hashlib.sha1(source).digest(), "big"))

    def xor_distance(self, other: int) -> int:
        return int(self) ^ int(other)

    def to_bytes(self, length: int = ID_BYTES, byteorder: str = "big", *, signed: bool = False) -> bytes:
        return super().to_bytes(length, byteorder, signed=signed)

    @classmethod
    def from_bytes(cls, raw: bytes, byteorder: str = "big", *, signed: bool = False) -> "DHTID":
        if len(raw) != ID_BYTES:
            raise ValueError(f"a DHTID is {ID_BYTES} bytes, got {len(raw)}")
        return cls(int.from_bytes(raw, byteorder, signed=signed))

    def __repr__(self) -> str:
        return f"DHTID({self.to_bytes().hex()[:12]}…)"


class KBucket:
    """Peers with ids in [lower, upper), least recently seen first, plus a replacement list."""

    def __init__(self, lower: int, upper: int, size: int, depth: int = 0):
        assert upper - lower == 2 ** (ID_BITS - depth) and lower % (upper - lower) == 0, "buckets are aligned"
        self.lower, self.upper, self.size, self.depth = lower, upper, size, depth
        self.nodes: dict[DHTID, PeerID] = {}  # insertion order = least recently seen first
        self.replacements: dict[DHTID, PeerID] = {}
        self.last_updated = float("-inf")

    def has_in_range(self, node_id: int) -> bool:
        return self.lower <= node_id < self.upper

    def add_or_update_node(self, node_id: DHTID, peer_id: PeerID, now: float) -> bool:
        """Move the peer to the most-recently-seen end; False when the bucket is full (kept as replacement)."""
        self.last_updated = now
        if node_id in self.nodes or len(self.nodes) < self.size:
            self.nodes.pop(node_id, None)
            self.nodes[node_id] = peer_id
            self.replacements.pop(node_id, None)
            return True
        self.replacements.pop(node_id, None)
        self.replacements[node_id] = peer_id
        while len(self.replacements) > self.size * MAX_REPLACEMENTS_FACTOR:
            del self.replacements[next(iter(self.replacements))]
        return False

    def least_recently_seen(self) -> tuple[DHTID, PeerID]:
        node_id = next(iter(self.nodes))
        return node_id, self.nodes[node_id]

    def remove(self, node_id: DHTID) -> None:
        """Drop a peer; a live one is replaced by the most recently seen replacement."""
        self.replacements.pop(node_id, None)
        if self.nodes.pop(node_id, None) is not None and self.replacements:
            newest = next(reversed(self.replacements))
            self.nodes[newest] = self.replacements.pop(newest)

    def split(self) -> tuple["KBucket", "KBucket"]:
        middle = (self.lower + self.upper) // 2
        left = KBucket(self.lower, middle, self.size, self.depth + 1)
        right = KBucket(middle, self.upper, self.size, self.depth + 1)
        for source, attribute in ((self.nodes, "nodes"), (self.replacements, "replacements")):
            for node_id, peer_id in source.items():
                target = left if node_id < middle else right
                getattr(target, attribute)[node_id] = peer_id
        left.last_updated = right.last_updated = self.last_updated
        return left, right

    def min_distance_to(self, query: int) -> int:
        """Smallest XOR distance from `query` to any id this bucket can hold (exact for aligned ranges)."""
        span = self.upper - self.lower
        return (query ^ self.lower) & ~(span - 1)

    def __repr__(self) -> str:
        return f"KBucket(depth={self.depth}, {len(self.nodes)}/{self.size} nodes, {len(self.replacements)} spare)"


class RoutingTable:
    """The k-buckets of one node, and the DHTID <-> PeerID map of the peers in them."""

    def __init__(self, node_id: DHTID, bucket_size: int = 20, depth_modulo: int = 5):
        if bucket_size < 1 or depth_modulo < 1:
            raise ValueError("bucket_size and depth_modulo must be positive")
        self.node_id, self.bucket_size, self.depth_modulo = node_id, bucket_size, depth_modulo
        self.buckets = [KBucket(DHTID.MIN, DHTID.MAX, bucket_size)]
        self.uid_to_peer_id: dict[DHTID, PeerID] = {}
        self.peer_id_to_uid: dict[PeerID, DHTID] = {}

    def get_bucket_index(self, node_id: int) -> int:
        lo, hi = 0, len(self.buckets)  # buckets are sorted and contiguous: binary search
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if node_id < self.buckets[mid].lower:
                hi = mid
            else:
                lo = mid
        return lo

    def add_or_update_node(self, node_id: DHTID, peer_id: PeerID, now: float) -> tuple[DHTID, PeerID] | None:
        """Record that the peer was seen alive. Returns a (node_id, peer_id) to ping when the bucket is
        full and may not split: if that ping fails, call `remove` so the newcomer takes its place."""
        if node_id == self.node_id:
            return None
        old_uid = self.peer_id_to_uid.get(peer_id)
        if old_uid is not None and old_uid != node_id:
            self.remove(old_uid)  # the peer restarted with a new DHT id
        index = self.get_bucket_index(node_id)
        bucket = self.buckets[index]
        if bucket.add_or_update_node(node_id, peer_id, now):
            self._register(node_id, peer_id)
            return None
        if bucket.has_in_range(self.node_id) or bucket.depth % self.depth_modulo != 0:
            bucket.replacements.pop(node_id, None)
            self.buckets[index : index + 1] = bucket.split()
            return self.add_or_update_node(node_id, peer_id, now)
        return bucket.least_recently_seen()

    def _register(self, node_id: DHTID, peer_id: PeerID) -> None:
        self.uid_to_peer_id[node_id] = peer_id
        self.peer_id_to_uid[peer_id] = node_id

    def remove(self, node_id: DHTID) -> None:
        """Evict a peer that failed to answer (promoting a replacement into its bucket)."""
        bucket = self.buckets[self.get_bucket_index(node_id)]
        bucket.remove(node_id)
        peer_id = self.uid_to_peer_id.pop(node_id, None)
        if peer_id is not None and self.peer_id_to_uid.get(peer_id) == node_id:
            del self.peer_id_to_uid[peer_id]
        for promoted_id, promoted_peer in bucket.nodes.items():
            if promoted_id not in self.uid_to_peer_id:
                self._register(promoted_id, promoted_peer)

    def remove_peer(self, peer_id: PeerID) -> DHTID | None:
        node_id = self.peer_id_to_uid.get(peer_id)
        if node_id is not None:
            self.remove(node_id)
        return node_id

    def get_nearest_neighbors(
        self, query_id: int, k: int, exclude: DHTID | None = None
    ) -> list[tuple[DHTID, PeerID]]:
        """The k known peers nearest to `query_id`, nearest first. Buckets are visited in order of the
        closest id they could hold, stopping once no unvisited bucket can beat the current k-th."""
        order = sorted(self.buckets, key=lambda bucket: bucket.min_distance_to(query_id))
        best: list[tuple[int, DHTID]] = []  # max-heap by distance, as (-distance, id)
        for bucket in order:
            if len(best) >= k and bucket.min_distance_to(query_id) > -best[0][0]:
                break
            for node_id in bucket.nodes:
                if node_id == exclude:
                    continue
                distance = node_id ^ query_id
                if len(best) < k:
                    heapq.heappush(best, (-distance, node_id))
                elif distance < -best[0][0]:
                    heapq.heapreplace(best, (-distance, node_id))
        nearest = sorted(best, key=lambda item: -item[0])
        return [(node_id, self.uid_to_peer_id[node_id]) for _, node_id in nearest]

    def stale_buckets(self, now: float, refresh_timeout: float) -> list[KBucket]:
        return [bucket for bucket in self.buckets if bucket.last_updated < now - refresh_timeout]

    def __contains__(self, item: DHTID | PeerID) -> bool:
        return item in (self.peer_id_to_uid if isinstance(item, PeerID) else self.uid_to_peer_id)

    def __len__(self) -> int:
        return len(self.uid_to_peer_id)

    def __iter__(self) -> Iterator[tuple[DHTID, PeerID]]:
        return iter(list(self.uid_to_peer_id.items()))

    def __repr__(self) -> str:
        return f"RoutingTable({len(self)} peers in {len(self.buckets)} buckets, k={self.bucket_size})"
