"""Routing table properties: XOR order, bucket split rule, replacements, eviction, nearest peers."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plexus.dht.routing import DHTID, KBucket, RoutingTable
from plexus.p2p.identity import PrivateKey

pytestmark = pytest.mark.timeout(60)

PEERS = [PrivateKey.from_seed(bytes([i]) * 32).peer_id for i in range(1, 200)]


def test_dhtid_from_keys_and_bytes():
    assert DHTID.generate("key") == DHTID.generate("key") != DHTID.generate("key2")
    assert DHTID.generate(b"raw") != DHTID.generate("raw")  # bytes are hashed as they are
    assert DHTID.generate(("a", 1)) != DHTID.generate(["a", 1])
    node_id = DHTID.generate()
    assert 0 <= node_id < 2**160 and DHTID.from_bytes(node_id.to_bytes()) == node_id
    assert len(node_id.to_bytes()) == 20
    with pytest.raises(ValueError):
        DHTID(2**160)
    with pytest.raises(ValueError):
        DHTID.from_bytes(b"short")


def test_bucket_keeps_least_recently_seen_first_and_replacements():
    bucket = KBucket(0, 2**160, size=3)
    ids = [DHTID(i) for i in range(6)]
    for i in range(3):
        assert bucket.add_or_update_node(ids[i], PEERS[i], now=i)
    assert not bucket.add_or_update_node(ids[3], PEERS[3], now=3)  # full: goes to replacements
    assert bucket.add_or_update_node(ids[0], PEERS[0], now=4)  # seen again: moves to the fresh end
    assert bucket.least_recently_seen() == (ids[1], PEERS[1])
    bucket.remove(ids[1])  # evicted: the replacement moves in
    assert set(bucket.nodes) == {ids[0], ids[2], ids[3]} and not bucket.replacements


def test_min_distance_is_exact_for_aligned_buckets():
    rng = random.Random(1)
    for _ in range(200):
        depth = rng.randrange(0, 12)
        span = 2 ** (160 - depth)
        lower = rng.randrange(0, 2**depth) * span
        bucket = KBucket(lower, lower + span, 20, depth)
        query = rng.randrange(0, 2**160)
        best = lower + ((query - lower) % span if lower <= query < lower + span else query % span)
        assert bucket.min_distance_to(query) == best ^ query


def fill(table: RoutingTable, node_ids, now=0.0):
    pings = []
    for i, node_id in enumerate(node_ids):
        to_ping = table.add_or_update_node(node_id, PEERS[i % len(PEERS)], now)
        if to_ping is not None:
            pings.append(to_ping)
    return pings


@given(st.integers(0, 2**32), st.integers(1, 8), st.integers(1, 5))
@settings(max_examples=40, deadline=None)
def test_table_invariants(seed, bucket_size, depth_modulo):
    rng = random.Random(seed)
    me = DHTID(rng.randrange(2**160))
    table = RoutingTable(me, bucket_size, depth_modulo)
    node_ids = [DHTID(rng.randrange(2**160)) for _ in range(150)]
    fill(table, node_ids)
    # buckets tile [0, 2^160) in order, each aligned and within its capacity
    assert table.buckets[0].lower == 0 and table.buckets[-1].upper == 2**160
    for left, right in zip(table.buckets, table.buckets[1:]):
        assert left.upper == right.lower
    for bucket in table.buckets:
        assert len(bucket.nodes) <= bucket_size and all(bucket.has_in_range(n) for n in bucket.nodes)
        # split rule: a bucket that could not split is full only if it is far from us at a modulo depth
    for _index, bucket in enumerate(table.buckets):
        if bucket.replacements:
            assert not bucket.has_in_range(me) and bucket.depth % depth_modulo == 0
    # the id maps agree with the buckets
    in_buckets = {n: p for bucket in table.buckets for n, p in bucket.nodes.items()}
    assert in_buckets == table.uid_to_peer_id
    # nearest neighbours equal a brute-force XOR sort
    for _ in range(5):
        query = DHTID(rng.randrange(2**160))
        k = rng.randrange(1, 30)
        expected = sorted(in_buckets, key=lambda n: n ^ query)[:k]
        assert [n for n, _ in table.get_nearest_neighbors(query, k)] == expected
        excluded = expected[0] if expected else None
        assert excluded not in [n for n, _ in table.get_nearest_neighbors(query, k, exclude=excluded)]


def test_bucket_with_own_id_always_splits():
    me = DHTID(0)
    table = RoutingTable(me, bucket_size=2, depth_modulo=10**6)
    near = [DHTID(i) for i in range(1, 40)]  # all near us: the bucket holding us keeps splitting
    assert fill(table, near) == []
    assert len(table) >= 2 * 5 and len(table.buckets) > 5


def test_full_far_bucket_asks_to_ping_least_recently_seen_then_evicts():
    me = DHTID(0)
    table = RoutingTable(me, bucket_size=2, depth_modulo=1)  # depth % 1 == 0: far buckets never split
    far = [DHTID(2**159 + i) for i in range(3)]
    assert table.add_or_update_node(far[0], PEERS[0], 0) is None
    assert table.add_or_update_node(far[1], PEERS[1], 1) is None
    assert table.add_or_update_node(far[2], PEERS[2], 2) == (far[0], PEERS[0])
    assert far[2] not in table
    table.remove(far[0])  # the ping failed
    assert far[0] not in table and far[2] in table and table.uid_to_peer_id[far[2]] == PEERS[2]
    assert PEERS[0] not in table and PEERS[2] in table


def test_peer_with_new_dht_id_replaces_its_old_entry():
    table = RoutingTable(DHTID(0), bucket_size=20)
    table.add_or_update_node(DHTID(5), PEERS[0], 0)
    table.add_or_update_node(DHTID(7), PEERS[0], 1)
    assert DHTID(5) not in table and table.peer_id_to_uid[PEERS[0]] == DHTID(7)
    assert table.remove_peer(PEERS[0]) == DHTID(7) and len(table) == 0


def test_own_id_is_never_added_and_stale_buckets():
    me = DHTID.generate()
    table = RoutingTable(me)
    assert table.add_or_update_node(me, PEERS[0], 0) is None and len(table) == 0
    table.add_or_update_node(DHTID.generate(), PEERS[1], now=100)
    assert table.stale_buckets(now=150, refresh_timeout=60) == []
    assert table.stale_buckets(now=200, refresh_timeout=60) == table.buckets
