"""Kademlia routing table over the XOR metric (Maymounkov & Mazières 2002, sections 2.2-2.4, 4.1-4.2).

Theory of operation. Ids are 160-bit integers (`DHTID`). The table covers [0, 2^160) with
k-buckets, each an aligned power-of-two range holding up to k peers in least-recently-seen order,
plus a bounded replacement list of peers that did not fit. A newcomer to a full bucket splits it if
the bucket covers our own id, or if its depth is not a multiple of `depth_modulo` (the relaxed rule
of section 4.2, which keeps a few far buckets finely split so lookups converge in fewer hops).
Otherwise the newcomer waits in the replacement list and the caller is told to ping the bucket's
least-recently-seen peer; if that ping fails, `remove` evicts it and promotes the freshest
replacement. The table does no I/O and reads no clock: the node passes `now` and does the pings.

With `diversity` set, each peer also counts against the group of its IP address (diversity.py):
a peer whose group already holds its share of the peers at its distance (those with as long a
common prefix with our id: one k-bucket of a fully split table, entries and replacements
together) or of the whole table is refused, and a replacement is promoted only while its group
has room in the table. A peer's group is judged when it is admitted, from the address the caller
passes. Each entry and replacement also keeps when it last showed it was alive (`last_seen`,
`not_seen_since`), for the node's liveness checks.

The DHT id is separate from the libp2p PeerID; the table maps one to the other both ways.
"""

import collections
import hashlib
import heapq
import os
from collections.abc import Callable, Iterator
from typing import Any, Literal, SupportsIndex

from ..p2p.identity import PeerID
from ..utils.serializer import MSGPackSerializer
from .diversity import DiversityOptions

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

    def to_bytes(
        self,
        length: SupportsIndex = ID_BYTES,
        byteorder: Literal["little", "big"] = "big",
        *,
        signed: bool = False,
    ) -> bytes:
        return super().to_bytes(length, byteorder, signed=signed)

    @classmethod
    def from_bytes(  # type: ignore[override]  # only the ID_BYTES-long bytes of an id, unlike int's
        cls, raw: bytes, byteorder: Literal["little", "big"] = "big", *, signed: bool = False
    ) -> "DHTID":
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
        self.groups: dict[DHTID, str] = {}  # diversity group of the limited peers, entries and replacements
        self.seen: dict[DHTID, float] = {}  # when each entry or replacement last showed it was alive
        self.last_updated = float("-inf")

    def has_in_range(self, node_id: int) -> bool:
        return self.lower <= node_id < self.upper

    def add_or_update_node(
        self, node_id: DHTID, peer_id: PeerID, now: float, group: str | None = None
    ) -> bool:
        """Move the peer to the most-recently-seen end; False when the bucket is full (kept as replacement).
        `group` is the peer's diversity group, recorded when the peer is new to this bucket."""
        self.last_updated = now
        if group is not None and node_id not in self.nodes and node_id not in self.replacements:
            self.groups[node_id] = group
        self.seen[node_id] = now
        if node_id in self.nodes or len(self.nodes) < self.size:
            self.nodes.pop(node_id, None)
            self.nodes[node_id] = peer_id
            self.replacements.pop(node_id, None)
            return True
        self.replacements.pop(node_id, None)
        self.replacements[node_id] = peer_id
        while len(self.replacements) > self.size * MAX_REPLACEMENTS_FACTOR:
            oldest = next(iter(self.replacements))
            del self.replacements[oldest]
            self.groups.pop(oldest, None)
            self.seen.pop(oldest, None)
        return False

    def least_recently_seen(self) -> tuple[DHTID, PeerID]:
        node_id = next(iter(self.nodes))
        return node_id, self.nodes[node_id]

    def remove(self, node_id: DHTID, admits: Callable[[DHTID], bool] = lambda node_id: True) -> DHTID | None:
        """Drop a peer; an entry is replaced by the most recently seen replacement that `admits`
        allows. Returns the promoted replacement, if any."""
        self.replacements.pop(node_id, None)
        self.groups.pop(node_id, None)
        self.seen.pop(node_id, None)
        if self.nodes.pop(node_id, None) is None:
            return None
        for candidate in reversed(self.replacements):
            if admits(candidate):
                self.nodes[candidate] = self.replacements.pop(candidate)
                return candidate
        return None

    def split(self) -> tuple["KBucket", "KBucket"]:
        middle = (self.lower + self.upper) // 2
        left = KBucket(self.lower, middle, self.size, self.depth + 1)
        right = KBucket(middle, self.upper, self.size, self.depth + 1)
        for source, attribute in ((self.nodes, "nodes"), (self.replacements, "replacements")):
            for node_id, peer_id in source.items():
                target = left if node_id < middle else right
                getattr(target, attribute)[node_id] = peer_id
        for attribute in ("groups", "seen"):
            for node_id, value in getattr(self, attribute).items():
                getattr(left if node_id < middle else right, attribute)[node_id] = value
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

    def __init__(
        self,
        node_id: DHTID,
        bucket_size: int = 20,
        depth_modulo: int = 5,
        diversity: DiversityOptions | None = None,
    ):
        if bucket_size < 1 or depth_modulo < 1:
            raise ValueError("bucket_size and depth_modulo must be positive")
        self.node_id, self.bucket_size, self.depth_modulo = node_id, bucket_size, depth_modulo
        self.diversity = diversity
        self.buckets = [KBucket(DHTID.MIN, DHTID.MAX, bucket_size)]
        self.uid_to_peer_id: dict[DHTID, PeerID] = {}
        self.peer_id_to_uid: dict[PeerID, DHTID] = {}
        # entries (not replacements) per diversity group
        self.group_sizes: collections.Counter[str] = collections.Counter()

    def get_bucket_index(self, node_id: int) -> int:
        lo, hi = 0, len(self.buckets)  # buckets are sorted and contiguous: binary search
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if node_id < self.buckets[mid].lower:
                hi = mid
            else:
                lo = mid
        return lo

    def refusal(self, node_id: DHTID, ip: str | None) -> str | None:
        """Why a peer at `ip` may not enter the table under the diversity bounds (None: it may).
        A peer already in a bucket, as an entry or a replacement, is never refused."""
        group = self.diversity.group_of(ip) if self.diversity is not None else None
        return self._refusal(node_id, group)

    def _refusal(self, node_id: DHTID, group: str | None) -> str | None:
        diversity = self.diversity
        if group is None or diversity is None:  # a group is known only under diversity options
            return None
        bucket = self.buckets[self.get_bucket_index(node_id)]
        if node_id in bucket.nodes or node_id in bucket.replacements:
            return None
        limit = diversity.max_per_table
        if limit is not None and self.group_sizes[group] >= limit:
            return (
                f"{group} already has {self.group_sizes[group]} routing-table entries (max_per_table={limit})"
            )
        limit = diversity.max_per_bucket
        if limit is not None and (count := self.count_at_distance(group, node_id)) >= limit:
            return f"{group} already has {count} peers at that distance (max_per_bucket={limit})"
        return None

    def common_prefix_length(self, node_id: int) -> int:
        return ID_BITS - (node_id ^ self.node_id).bit_length()

    def count_at_distance(self, group: str, node_id: DHTID) -> int:
        """Entries and replacements in `group` with as long a common prefix with our id as
        `node_id` has: one k-bucket's worth once the table is fully split. They all sit in one
        bucket (a far one holds a single prefix length, ours every longer one)."""
        bucket = self.buckets[self.get_bucket_index(node_id)]
        length = self.common_prefix_length(node_id)
        return sum(
            1
            for member, member_group in bucket.groups.items()
            if member_group == group and self.common_prefix_length(member) == length
        )

    def add_or_update_node(
        self, node_id: DHTID, peer_id: PeerID, now: float, ip: str | None = None
    ) -> tuple[DHTID, PeerID] | None:
        """Record that the peer (at `ip`, if known) was seen alive. Returns a (node_id, peer_id) to ping
        when the bucket is full and may not split: if that ping fails, call `remove` so the newcomer
        takes its place. A peer that `refusal` turns away is not recorded at all."""
        group = self.diversity.group_of(ip) if self.diversity is not None else None
        if node_id == self.node_id or self._refusal(node_id, group) is not None:
            return None
        old_uid = self.peer_id_to_uid.get(peer_id)
        if old_uid is not None and old_uid != node_id:
            self.remove(old_uid)  # the peer restarted with a new DHT id
        return self._add(node_id, peer_id, now, group)

    def _add(
        self, node_id: DHTID, peer_id: PeerID, now: float, group: str | None
    ) -> tuple[DHTID, PeerID] | None:
        index = self.get_bucket_index(node_id)
        bucket = self.buckets[index]
        if bucket.add_or_update_node(node_id, peer_id, now, group):
            self._register(node_id, peer_id, bucket)
            return None
        if bucket.has_in_range(self.node_id) or bucket.depth % self.depth_modulo != 0:
            bucket.replacements.pop(node_id, None)
            bucket.groups.pop(node_id, None)
            bucket.seen.pop(node_id, None)
            self.buckets[index : index + 1] = bucket.split()
            return self._add(node_id, peer_id, now, group)
        return bucket.least_recently_seen()

    def _register(self, node_id: DHTID, peer_id: PeerID, bucket: KBucket) -> None:
        if node_id not in self.uid_to_peer_id and (group := bucket.groups.get(node_id)) is not None:
            self.group_sizes[group] += 1
        self.uid_to_peer_id[node_id] = peer_id
        self.peer_id_to_uid[peer_id] = node_id

    def _has_room(self, bucket: KBucket, node_id: DHTID) -> bool:
        group = bucket.groups.get(node_id)
        limit = self.diversity.max_per_table if self.diversity is not None else None
        return group is None or limit is None or self.group_sizes[group] < limit

    def remove(self, node_id: DHTID) -> None:
        """Evict a peer that failed to answer (promoting a replacement into its bucket)."""
        bucket = self.buckets[self.get_bucket_index(node_id)]
        group = bucket.groups.get(node_id)
        peer_id = self.uid_to_peer_id.pop(node_id, None)
        if peer_id is not None and group is not None:
            self.group_sizes[group] -= 1
            if self.group_sizes[group] <= 0:
                del self.group_sizes[group]
        if peer_id is not None and self.peer_id_to_uid.get(peer_id) == node_id:
            del self.peer_id_to_uid[peer_id]
        promoted = bucket.remove(node_id, lambda candidate: self._has_room(bucket, candidate))
        if promoted is not None:
            self._register(promoted, bucket.nodes[promoted], bucket)

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

    def last_seen(self, node_id: DHTID) -> float | None:
        """When the entry or replacement last showed it was alive (an answer or a request of its
        own); None if it is in neither list."""
        return self.buckets[self.get_bucket_index(node_id)].seen.get(node_id)

    def not_seen_since(self, moment: float) -> list[tuple[DHTID, PeerID]]:
        """The entries (not replacements) that have shown no sign of life since `moment`, oldest first."""
        quiet = [
            (bucket.seen.get(node_id, float("-inf")), node_id, peer_id)
            for bucket in self.buckets
            for node_id, peer_id in bucket.nodes.items()
            if bucket.seen.get(node_id, float("-inf")) < moment
        ]
        return [(node_id, peer_id) for _, node_id, peer_id in sorted(quiet, key=lambda item: item[0])]

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
