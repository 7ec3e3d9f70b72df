"""Beam search without a network: the pure core against brute force, and the DHT entry parsing."""

import itertools
import random

import pytest

from plexus.moe.client.beam import BeamSearch
from plexus.moe.expert_registry import EMPTY_PREFIX_SUBKEY, declaration_entries, parse_successors
from plexus.p2p.identity import PrivateKey
from plexus.utils.timed_storage import ValueWithExpiration

pytestmark = pytest.mark.timeout(20)
PEER = PrivateKey.generate().peer_id


def announce(uids):
    """The DHT contents servers of `uids` would write: {prefix: {subkey: ValueWithExpiration}}."""
    table = {}
    keys, subkeys, values = declaration_entries(uids, PEER)
    for key, subkey, value in zip(keys, subkeys, values):
        if subkey is not None:
            table.setdefault(key, {})[subkey] = ValueWithExpiration(value, 1e12)
    return table


def run(search: BeamSearch, table, grid_size):
    """Drive the core the way MoEBeamSearcher does, over a dict instead of the DHT."""
    while not search.done:
        answers = {}
        for prefix in search.wanted():
            depth = prefix[len(search.prefix) :].count(".")
            grid = grid_size[depth] if depth < len(grid_size) else None
            answers[prefix] = parse_successors(prefix, table.get(prefix), grid)
        search.feed(answers)
    return search.result()


def brute_force(uids, scores, k):
    def score(uid):
        return sum(s[int(c)] for s, c in zip(scores, uid.split(".")[1:]))

    return sorted(uids, key=lambda uid: (-score(uid), uid))[:k]


def grid_uids(name, grid_size):
    return [".".join([name, *map(str, point)]) for point in itertools.product(*map(range, grid_size))]


@pytest.mark.parametrize("grid_size", [(7,), (4, 5), (3, 4, 2), (2, 2, 2, 3)])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_full_grid_matches_brute_force(grid_size, k):
    rng = random.Random(hash((grid_size, k)))
    uids = grid_uids("ffn", grid_size)
    table = announce(uids)
    for _ in range(20):
        scores = [[rng.gauss(0, 1) for _ in range(size)] for size in grid_size]
        search = BeamSearch("ffn.", scores, k)
        found = run(search, table, grid_size)
        assert [uid for uid, _ in found] == brute_force(uids, scores, k)
        assert all(peer == PEER for _, peer in found)
        assert search.rounds == max(1, len(grid_size) - 1), "a full grid needs one round per prefix level"


def test_sparse_grid_returns_real_experts_best_first_and_a_wide_beam_is_exact():
    rng = random.Random(1)
    grid_size = (5, 6)
    everything = grid_uids("ffn", grid_size)
    for _ in range(20):
        uids = rng.sample(everything, 7)
        table = announce(uids)
        scores = [[rng.gauss(0, 1) for _ in range(size)] for size in grid_size]
        narrow = [uid for uid, _ in run(BeamSearch("ffn.", scores, 2), table, grid_size)]
        assert set(narrow) <= set(uids) and len(narrow) == 2
        ranked = brute_force(uids, scores, len(uids))
        assert sorted(narrow, key=ranked.index) == narrow, "results come best first"
        wide = [uid for uid, _ in run(BeamSearch("ffn.", scores, 30), table, grid_size)]
        assert wide == ranked


def test_first_dimension_skips_empty_prefixes_in_score_order():
    table = announce(["ffn.0.0", "ffn.4.1"])
    scores = [[0.0, 5.0, 4.0, 3.0, 2.0], [0.0, 1.0]]
    search = BeamSearch("ffn.", scores, 1)
    assert search.wanted() == ["ffn.1."]
    search.feed({})
    assert search.wanted() == ["ffn.2."]
    assert [uid for uid, _ in run(search, table, (5, 2))] == ["ffn.4.1"]
    assert BeamSearch("ffn.", scores, 1).result() == []


def test_no_experts_at_all_ends_empty():
    search = BeamSearch("ffn.", [[1.0, 2.0], [3.0]], 2)
    assert run(search, {}, (2, 1)) == [] and search.done


def test_parse_successors_keeps_only_well_formed_entries():
    good = ("ffn.3.1", PEER.to_base58())
    value = {
        1: ValueWithExpiration(good, 1e12),
        2: ValueWithExpiration(("other.3.2", PEER.to_base58()), 1e12),  # filed under the wrong prefix
        4: ValueWithExpiration(("ffn.3.4", "not-a-peer-id"), 1e12),
        5: ValueWithExpiration(("ffn.3.5", PEER.to_base58()), 1e12),  # outside a grid of 5
        0: ValueWithExpiration(["ffn.3.0"], 1e12),
        EMPTY_PREFIX_SUBKEY: ValueWithExpiration(None, 1e12),
        "x": ValueWithExpiration(good, 1e12),
    }
    assert parse_successors("ffn.3.", value, 5) == {1: ("ffn.3.1", PEER)}
    assert parse_successors("ffn.3.", None) == {} and parse_successors("ffn.3.", [1, 2]) == {}
    deeper = {2: ValueWithExpiration(("ffn.3.2.7", PEER.to_base58()), 1e12)}
    assert parse_successors("ffn.3.", deeper) == {2: ("ffn.3.2.7", PEER)}


def test_flat_experts_and_the_negative_cache_marker_do_not_collide():
    table = announce(["flat.0", "flat.2"])
    table["flat.2."][EMPTY_PREFIX_SUBKEY] = ValueWithExpiration(None, 1e12)  # a stale "empty" from a cache
    table["flat.1."] = {EMPTY_PREFIX_SUBKEY: ValueWithExpiration(None, 1e12)}
    found = run(BeamSearch("flat.", [[0.0, 9.0, 1.0]], 2), table, (3,))
    assert [uid for uid, _ in found] == ["flat.2", "flat.0"]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="must end with"):
        BeamSearch("ffn", [[1.0]], 1)
    with pytest.raises(ValueError, match="beam_size >= 1"):
        BeamSearch("ffn.", [[1.0]], 0)
    search = BeamSearch("ffn.", [[1.0]], 1)
    search.feed({})
    with pytest.raises(RuntimeError, match="done"):
        search.feed({})
