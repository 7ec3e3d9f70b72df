"""Expert uids, prefixes, the DHT entries a uid implies, and grid patterns (pure functions)."""

import random

import pytest

from plexus.moe.expert_uid import (
    FLAT_EXPERT,
    expand_expert_pattern,
    is_valid_prefix,
    is_valid_uid,
    parse_expert_pattern,
    prefix_entries,
    sample_expert_uids,
    split_uid,
)

pytestmark = pytest.mark.timeout(10)


def test_uid_and_prefix_formats():
    for uid in ("ffn.0", "ffn.3.17", "my-expert_1.0.0.5", "a/b.2"):
        assert is_valid_uid(uid), uid
    for bad in (
        "ffn",
        "ffn.",
        "ffn.01",
        "ffn.-1",
        "ffn.a",
        ".1",
        "ffn..1",
        "ffn.1.",
        7,
        None,
        "x." + "1" * 300,
    ):
        assert not is_valid_uid(bad), bad
    for prefix in ("ffn.", "ffn.3.", "ffn.3.0."):
        assert is_valid_prefix(prefix), prefix
    for bad in ("ffn", "ffn.3", "ffn.03.", "..", ""):
        assert not is_valid_prefix(bad), bad


def test_split_uid():
    assert split_uid("ffn.3.7") == ("ffn.3.", 7)
    assert split_uid("ffn.3.7.") == ("ffn.3.", 7)
    assert split_uid("ffn.3.-1") == ("ffn.3.", -1)
    with pytest.raises(ValueError, match="no coordinate"):
        split_uid("ffn")
    with pytest.raises(ValueError, match="integer"):
        split_uid("ffn.x")


def test_prefix_entries_follow_the_beam_search_layout():
    assert prefix_entries("ffn.4") == [("ffn.4.", FLAT_EXPERT)]
    assert prefix_entries("ffn.1.2") == [("ffn.1.", 2)]
    assert prefix_entries("ffn.1.2.3") == [("ffn.1.2.", 3), ("ffn.1.", 2)]
    with pytest.raises(ValueError, match="not a valid expert uid"):
        prefix_entries("ffn")


def test_patterns_parse_and_expand():
    assert parse_expert_pattern("ffn.[0:4].3") == ("ffn", [range(0, 4), range(3, 4)])
    assert parse_expert_pattern("ffn.[:2]") == ("ffn", [range(0, 2)])
    assert expand_expert_pattern("e.[0:2].[5:7]") == ["e.0.5", "e.0.6", "e.1.5", "e.1.6"]
    for bad in ("ffn", "ffn.[3:1]", "ffn.[2:]", "ffn.x", "ffn.[0:4", ".[0:4]"):
        with pytest.raises(ValueError):
            parse_expert_pattern(bad)
    with pytest.raises(ValueError, match="sample_expert_uids"):
        expand_expert_pattern("big.[0:2048].[0:2048]")


@pytest.mark.parametrize(
    "pattern, count", [("ffn.[0:4].[0:16]", 60), ("ffn.[0:4].[0:16]", 5), ("big.[0:100000].[0:100000]", 50)]
)
def test_sampling_is_distinct_in_grid_and_seeded(pattern, count):
    exclude = {"ffn.0.0", "ffn.1.1", "elsewhere.1"}
    uids = sample_expert_uids(pattern, count, rng=random.Random(1), exclude=exclude)
    assert len(uids) == len(set(uids)) == count
    assert not set(uids) & exclude
    name, ranges = parse_expert_pattern(pattern)
    for uid in uids:
        head, *coords = uid.split(".")
        assert head == name and all(int(c) in r for c, r in zip(coords, ranges))
    assert uids == sample_expert_uids(pattern, count, rng=random.Random(1), exclude=exclude)


def test_sampling_refuses_more_than_the_free_grid():
    with pytest.raises(ValueError, match="62 free uids"):
        sample_expert_uids("ffn.[0:4].[0:16]", 63, rng=random.Random(0), exclude={"ffn.0.0", "ffn.3.15"})
