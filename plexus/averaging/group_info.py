"""What matchmaking hands to the all-reduce: the group, and the bucket keys peers meet under.

Peers meet under the DHT key `{prefix}.0b{group_bits}`. With the default empty bits every peer
shares one bucket; non-empty bits give a Moshpit-style grid: after each round, members of a group
pick distinct new bits, so the next round mixes peers that did not just average together.

`next_group_bits` is a pure function of the group, so every member computes the same assignment
without talking: a permutation of bucket indices is drawn from SHA-256 of the group id (not from
Python's `random`, whose algorithms may change between versions and would then split a group's
agreement across interpreters).
"""

import hashlib
import re
from dataclasses import dataclass

from ..p2p.identity import PeerID

GROUP_KEY_PATTERN = re.compile(r"^([^.]+)\.0b([01]*)$")
MAX_GROUP_BITS = 64


@dataclass(frozen=True)
class GroupInfo:
    """A group assembled by its leader; every member receives the same one."""

    group_id: bytes
    """Random bytes chosen by the leader; names this group's all-reduce."""
    peer_ids: tuple[PeerID, ...]
    """Members in the order the leader shuffled them (the all-reduce part order)."""
    gathered: tuple[bytes, ...]
    """Each member's `gather` bytes, in the order of `peer_ids`."""

    def __post_init__(self) -> None:
        if not self.group_id:
            raise ValueError("a group needs a non-empty group_id")
        if len(self.peer_ids) != len(self.gathered):
            raise ValueError(f"{len(self.peer_ids)} peers but {len(self.gathered)} gathered payloads")
        if len(set(self.peer_ids)) != len(self.peer_ids):
            raise ValueError("a peer appears twice in the group")

    @property
    def group_size(self) -> int:
        return len(self.peer_ids)

    def __repr__(self) -> str:
        members = ", ".join(peer.short() for peer in self.peer_ids)
        return f"GroupInfo({self.group_id[:4].hex()}…, [{members}])"


def make_group_key(prefix: str, group_bits: str) -> str:
    key = f"{prefix}.0b{group_bits}"
    check_group_key(key)
    return key


def check_group_key(key: str) -> tuple[str, str]:
    """Split a group key into (prefix, bits); ValueError if it is not `{prefix}.0b{bits}`."""
    match = GROUP_KEY_PATTERN.match(key) if isinstance(key, str) else None
    if match is None or len(match.group(2)) > MAX_GROUP_BITS:
        raise ValueError(
            f"{key!r} is not a group key of the form '<prefix without dots>.0b<up to {MAX_GROUP_BITS} bits>'"
        )
    return match.group(1), match.group(2)


def check_group_bits(bits: str) -> str:
    if not isinstance(bits, str) or len(bits) > MAX_GROUP_BITS or set(bits) - {"0", "1"}:
        raise ValueError(f"group bits must be a string of at most {MAX_GROUP_BITS} '0'/'1', got {bits!r}")
    return bits


def _bucket_permutation(seed: bytes, count: int) -> list[int]:
    """A permutation of range(count) drawn from SHA-256(seed) (Fisher-Yates); same everywhere."""
    order = list(range(count))
    for i in range(count - 1, 0, -1):
        digest = hashlib.sha256(b"plexus/group-bits/" + seed + i.to_bytes(4, "big")).digest()
        j = int.from_bytes(digest[:8], "big") % (i + 1)
        order[i], order[j] = order[j], order[i]
    return order


def next_group_bits(group_bits: str, group: GroupInfo, peer_id: PeerID, target_group_size: int | None) -> str:
    """The bits `peer_id` should use after `group`: same length, shifted left by its new bucket index.

    Members get distinct indices among `target_group_size` buckets (or the next power of two of
    the group size), so if all of them regroup next round they land in different buckets.
    """
    if not group_bits:
        return group_bits
    size = group.group_size
    buckets = target_group_size if target_group_size is not None else 1 << (size - 1).bit_length()
    buckets = max(buckets, size, 2)
    width = (buckets - 1).bit_length()
    index = _bucket_permutation(group.group_id, buckets)[group.peer_ids.index(peer_id)]
    return (group_bits + format(index, f"0{width}b"))[-len(group_bits) :]
