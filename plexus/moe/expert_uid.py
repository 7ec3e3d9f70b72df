"""Expert names: the `prefix.i.j.k` format, grid patterns, and the DHT prefix entries a uid implies.

An expert uid is a name followed by one or more integer grid coordinates (`ffn.3.7`); a prefix is
a uid cut after a delimiter (`ffn.3.`). Mixture-of-experts layers find experts by walking prefixes
in the DHT one coordinate at a time, so a server announces each uid under every prefix level but
the top one (`prefix_entries`). A one-dimensional uid (`ffn.3`) is announced under `ffn.3.` with
the pseudo-coordinate FLAT_EXPERT, so the walk can end on it like on any other level.

A pattern (`ffn.[0:4].[0:16]`) names a grid of uids: each block after the name is either a fixed
coordinate or a half-open range `[start:end]` (`[:end]` starts at 0). Everything here is pure: no
DHT, no clock, and randomness comes in as an argument.
"""

from __future__ import annotations

import math
import random
import re
from typing import NamedTuple

from ..p2p.identity import PeerID

ExpertUID = str
"""An expert's name: a name and one or more grid coordinates, `ffn.3.7`."""
ExpertPrefix = str
"""A uid cut after a delimiter, `ffn.3.`: the DHT key under which the next coordinates are found."""
Coordinate = int
Score = float

UID_DELIMITER = "."
"""What separates a uid's name and coordinates."""
FLAT_EXPERT = -1
"""The pseudo-coordinate under which a one-dimensional uid (`ffn.3`) is announced at `ffn.3.`."""
UID_PATTERN = re.compile(r"^[^.]+(\.(0|[1-9][0-9]*))+$")
PREFIX_PATTERN = re.compile(r"^[^.]+(\.(0|[1-9][0-9]*))*\.$")
MAX_UID_LENGTH = 256
MAX_EXPANDED_UIDS = 1 << 20  # expand_expert_pattern refuses grids larger than this


class ExpertInfo(NamedTuple):
    """Where an expert lives: its uid and the peer that serves it."""

    uid: ExpertUID
    peer_id: PeerID


def is_valid_uid(maybe_uid: object) -> bool:
    """Whether this is a well-formed uid (name and at least one coordinate, no leading zeros).

    The whole string must match: `re.match` with `$` would accept "ffn.1\\n" (`$` matches before a
    final newline), and such a uid would be stored as a key no well-formed lookup reaches."""
    return (
        isinstance(maybe_uid, str)
        and len(maybe_uid) <= MAX_UID_LENGTH
        and bool(UID_PATTERN.fullmatch(maybe_uid))
    )


def is_valid_prefix(maybe_prefix: object) -> bool:
    """Whether this is a well-formed prefix: a name, zero or more coordinates, a trailing delimiter."""
    return (
        isinstance(maybe_prefix, str)
        and len(maybe_prefix) <= MAX_UID_LENGTH
        and bool(PREFIX_PATTERN.fullmatch(maybe_prefix))
    )


def split_uid(uid_or_prefix: str) -> tuple[ExpertPrefix, Coordinate]:
    """Split off the last coordinate: `ffn.3.7` and `ffn.3.7.` both give (`ffn.3.`, 7)."""
    text = uid_or_prefix[:-1] if uid_or_prefix.endswith(UID_DELIMITER) else uid_or_prefix
    prefix, delimiter, last = text.rpartition(UID_DELIMITER)
    if not delimiter:
        raise ValueError(f"{uid_or_prefix!r} has no coordinate to split off")
    try:
        coordinate = int(last)
    except ValueError:
        raise ValueError(f"{uid_or_prefix!r} does not end in an integer coordinate") from None
    return prefix + UID_DELIMITER, coordinate


def prefix_entries(uid: ExpertUID) -> list[tuple[ExpertPrefix, Coordinate]]:
    """The (prefix, next coordinate) pairs a server announces for `uid`, deepest first.

    `ffn.1.2.3` -> [(`ffn.1.2.`, 3), (`ffn.1.`, 2)]; `ffn.4` -> [(`ffn.4.`, FLAT_EXPERT)]. The bare
    name (`ffn.`) is never announced: the first grid dimension is found by trying `ffn.{i}.`.
    """
    if not is_valid_uid(uid):
        raise ValueError(f"{uid!r} is not a valid expert uid (expected name.i[.j...], e.g. 'ffn.0.3')")
    key = uid if uid.count(UID_DELIMITER) > 1 else f"{uid}{UID_DELIMITER}{FLAT_EXPERT}"
    entries = []
    for _ in range(key.count(UID_DELIMITER) - 1):
        key, coordinate = split_uid(key)
        entries.append((key, coordinate))
    return entries


def parse_expert_pattern(pattern: str) -> tuple[str, list[range]]:
    """`ffn.[0:4].3` -> ("ffn", [range(0, 4), range(3, 4)]); ValueError says what is wrong."""
    name, *blocks = pattern.split(UID_DELIMITER)
    if not name or not blocks:
        raise ValueError(
            f"expert pattern {pattern!r} needs a name and at least one coordinate, e.g. 'ffn.[0:4].[0:16]'"
        )
    ranges = []
    for block in blocks:
        match = re.fullmatch(r"\[(\d*):(\d+)\]|(\d+)", block)
        if match is None:
            raise ValueError(
                f"block {block!r} of expert pattern {pattern!r} is neither an integer nor a range "
                f"[start:end] with a finite end"
            )
        if match.group(3) is not None:
            ranges.append(range(int(match.group(3)), int(match.group(3)) + 1))
        else:
            start, end = int(match.group(1) or 0), int(match.group(2))
            if end <= start:
                raise ValueError(f"range {block!r} of expert pattern {pattern!r} is empty")
            ranges.append(range(start, end))
    return name, ranges


def _uid(name: str, coordinates) -> ExpertUID:
    return UID_DELIMITER.join([name, *map(str, coordinates)])


def expand_expert_pattern(pattern: str) -> list[ExpertUID]:
    """Every uid of the pattern's grid, in row-major order (refuses grids over MAX_EXPANDED_UIDS)."""
    name, ranges = parse_expert_pattern(pattern)
    total = math.prod(len(r) for r in ranges)
    if total > MAX_EXPANDED_UIDS:
        raise ValueError(
            f"pattern {pattern!r} names {total} experts, more than {MAX_EXPANDED_UIDS}; "
            f"use sample_expert_uids to pick some of them"
        )
    uids = [name]
    for r in ranges:
        uids = [f"{uid}{UID_DELIMITER}{i}" for uid in uids for i in r]
    return uids


def sample_expert_uids(
    pattern: str, num_experts: int, *, rng: random.Random, exclude: frozenset[str] | set[str] = frozenset()
) -> list[ExpertUID]:
    """Pick `num_experts` distinct uids of the pattern's grid uniformly, skipping those in `exclude`.

    Raises ValueError when the grid has fewer free uids than asked for.
    """
    name, ranges = parse_expert_pattern(pattern)
    total = math.prod(len(r) for r in ranges)
    taken = sum(1 for uid in exclude if _in_grid(uid, name, ranges))
    if num_experts > total - taken:
        raise ValueError(f"pattern {pattern!r} has {total - taken} free uids, cannot pick {num_experts}")
    if num_experts * 2 > total - taken:  # dense: shuffle the whole grid (it is small enough then)
        free = [uid for uid in expand_expert_pattern(pattern) if uid not in exclude]
        return rng.sample(free, num_experts)
    chosen: dict[str, None] = {}
    while len(chosen) < num_experts:  # sparse: rejection sampling, expected < 2 draws per uid
        uid = _uid(name, (rng.choice(r) for r in ranges))
        if uid not in exclude:
            chosen[uid] = None
    return list(chosen)


def _in_grid(uid: str, name: str, ranges: list[range]) -> bool:
    head, *coordinates = uid.split(UID_DELIMITER)
    if head != name or len(coordinates) != len(ranges):
        return False
    return all(c.isdigit() and int(c) in r for c, r in zip(coordinates, ranges))
