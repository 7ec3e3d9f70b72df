"""Traversal stragglers on virtual time: silent peers stop holding lookups up, late answers count,
the number of outstanding requests stays bounded. No event loop: time is a number we advance."""

import heapq
import itertools
import random

import pytest

from plexus.dht.latency import FACTOR, REQUEST_FACTOR, LatencyEstimator, Unanswered
from plexus.dht.routing import DHTID, RoutingTable
from plexus.dht.traverse import GIVE_UP_FACTOR, STRAGGLER_FACTOR, Traversal
from plexus.p2p.identity import PrivateKey

pytestmark = pytest.mark.timeout(30)

BUCKET = 5
WAIT_TIMEOUT = 10.0  # the driver's own request timeout: a silent peer fails only then
PEERS = [PrivateKey.from_seed(bytes([i]) * 32).peer_id for i in range(1, 81)]


def simulate(num_nodes=60, seed=0):
    rng = random.Random(seed)
    ids = [DHTID(rng.randrange(2**160)) for _ in range(num_nodes)]
    tables = {}
    for _index, node_id in enumerate(ids):
        table = RoutingTable(node_id, BUCKET)
        for other_index, other in enumerate(ids):
            table.add_or_update_node(other, PEERS[other_index], 0)
        tables[node_id] = table
    return ids, tables


def drive(traversal, tables, delays, silent=(), max_outstanding=None):
    """Run the traversal on virtual time. `delays[node_id]` is how long that peer takes to answer
    (default 0.01 s); silent peers fail after WAIT_TIMEOUT. Returns (end time, requests, trace)."""
    now, sequence, events, trace = 0.0, itertools.count(), [], []
    while not traversal.done:
        for request in traversal.next_queries(now):
            failed = request.node_id in silent
            delay = WAIT_TIMEOUT if failed else delays.get(request.node_id, 0.01)
            heapq.heappush(events, (now + delay, next(sequence), request, failed))
        outstanding = traversal.in_flight + traversal.stragglers
        assert outstanding == len(events)
        if max_outstanding is not None:
            assert outstanding <= max_outstanding
        if traversal.done:
            break
        deadline = traversal.next_deadline()
        if deadline is not None:
            assert deadline >= now
        if deadline is not None and (not events or deadline < events[0][0]):
            now = deadline  # nothing arrives before a request turns into a straggler
            continue
        if not events:
            break
        now, _, request, failed = heapq.heappop(events)
        trace.append((now, request.node_id, traversal.is_straggler(request)))
        if failed:
            traversal.on_failure(request)
        else:
            table = tables[request.node_id]
            answer = {
                q: [n for n in table.get_nearest_neighbors(q, BUCKET + len(silent)) if n[0] not in silent][
                    :BUCKET
                ]
                for q in request.queries
            }
            traversal.on_response(request, answer, now)
    return now, trace


def start(ids, tables, query, **options):
    return Traversal(
        [query],
        tables[ids[0]].get_nearest_neighbors(query, BUCKET),
        beam_size=BUCKET,
        num_workers=3,
        exclude=[ids[0]],
        **options,
    )


def test_a_silent_peer_among_the_nearest_costs_the_straggler_limit_not_the_timeout():
    ids, tables = simulate(seed=1)
    query = DHTID.generate("q")
    silent = {sorted(ids[1:], key=lambda n: n ^ query)[1]}  # the second nearest never answers

    without = start(ids, tables, query)
    ended, _ = drive(without, tables, {}, silent)
    assert ended >= WAIT_TIMEOUT and without.next_deadline() is None  # the old behaviour: wait it out

    with_limit = start(ids, tables, query, straggler_timeout=0.5)
    ended, _trace = drive(with_limit, tables, {}, silent)
    assert ended < 2.0
    alive = [n for n in ids[1:] if n not in silent]
    expected = sorted(alive, key=lambda n: n ^ query)[:BUCKET]
    assert [node_id for node_id, _ in with_limit.nearest(query)] == expected
    assert with_limit.stragglers == 1  # the silent one is still out there (farther ones may be too)


def test_late_answer_after_straggling_joins_the_beam():
    """Hand-driven, so the order of events is exact: a straggler that answers before the lookup
    is done still joins the beam, and its place among the workers was refilled meanwhile."""
    ids, tables = simulate(seed=3)
    query = DHTID.generate("q")
    traversal = start(ids, tables, query, straggler_timeout=1.0)
    first = traversal.next_queries(now=0.0)
    assert len(first) == 3 and traversal.next_deadline() == 1.0
    slow, others = first[0], first[1:]
    for request in others:
        traversal.on_response(request, {query: tables[request.node_id].get_nearest_neighbors(query, BUCKET)})
    more = traversal.next_queries(now=0.2)  # two free slots: two more requests
    assert len(more) == 2 and traversal.in_flight == 3
    assert traversal.next_deadline() == 1.0  # still the slow request's
    replacement = traversal.next_queries(now=1.0)  # it straggles: one more slot is free
    assert traversal.is_straggler(slow) and traversal.stragglers == 1 and len(replacement) == 1
    assert traversal.in_flight == 3 and traversal.next_deadline() == pytest.approx(1.2)
    traversal.on_response(slow, {query: tables[slow.node_id].get_nearest_neighbors(query, BUCKET)})
    assert traversal.stragglers == 0 and not traversal.is_straggler(slow)
    assert slow.node_id in [node_id for node_id, _ in traversal.nearest(query)]


def test_a_straggler_that_fails_is_excluded_and_frees_its_place():
    ids, tables = simulate(seed=4)
    query = DHTID.generate("q")
    traversal = start(ids, tables, query, straggler_timeout=1.0)
    first = traversal.next_queries(now=0.0)
    traversal.handle_timer(5.0)
    assert traversal.stragglers == 3 and traversal.in_flight == 0 and traversal.next_deadline() is None
    traversal.on_failure(first[0])
    assert traversal.stragglers == 2
    later = traversal.next_queries(now=5.0)
    assert first[0].node_id not in [request.node_id for request in later]
    assert all(request.sent_at == 5.0 for request in later)


def test_outstanding_requests_stay_bounded_when_every_peer_is_silent():
    ids, tables = simulate(seed=5)
    query = DHTID.generate("q")
    silent = set(ids[1:])
    traversal = start(ids, tables, query, straggler_timeout=0.1, max_stragglers=4)
    ended, _trace = drive(traversal, tables, {}, silent, max_outstanding=3 + 4)
    assert traversal.done and traversal.nearest(query) == []
    assert ended >= WAIT_TIMEOUT  # with everyone silent, only failures end the lookup
    stragglers_at_cap = Traversal(
        [query],
        tables[ids[0]].get_nearest_neighbors(query, BUCKET),
        BUCKET,
        num_workers=1,
        straggler_timeout=0.1,
        max_stragglers=1,
    )
    stragglers_at_cap.next_queries(0.0)
    stragglers_at_cap.next_queries(0.1)  # the first straggles, a second is sent
    assert stragglers_at_cap.stragglers == 1 and stragglers_at_cap.in_flight == 1
    # at the cap, only abandoning the straggler is still due; abandoned, it still counts
    assert stragglers_at_cap.next_deadline() == pytest.approx(GIVE_UP_FACTOR * 0.1)
    stragglers_at_cap.handle_timer(100.0)
    assert stragglers_at_cap.stragglers == 1 and stragglers_at_cap.in_flight == 1
    assert stragglers_at_cap.next_deadline() is None  # time alone changes nothing now


@pytest.mark.parametrize("seed", range(4))
def test_random_delays_and_silent_peers_still_find_the_nearest_live_peers(seed):
    ids, tables = simulate(seed=seed)
    rng = random.Random(seed)
    query = DHTID.generate(f"q{seed}")
    silent = set(rng.sample(ids[1:], 6))
    delays = {node_id: rng.expovariate(1 / 0.05) for node_id in ids}
    traversal = start(ids, tables, query, straggler_timeout=0.2)
    ended, _ = drive(traversal, tables, delays, silent, max_outstanding=3 + traversal.max_stragglers)
    assert ended < WAIT_TIMEOUT
    alive = [n for n in ids[1:] if n not in silent]
    found = [node_id for node_id, _ in traversal.nearest(query)]
    expected = sorted(alive, key=lambda n: n ^ query)[:BUCKET]
    # a slow live peer may be left out when it answered after the lookup ended; the rest is exact
    assert len(set(found) & set(expected)) >= BUCKET - 1 and not set(found) & silent


def test_traversal_rejects_a_negative_straggler_timeout():
    with pytest.raises(ValueError):
        Traversal([DHTID(1)], [], beam_size=5, straggler_timeout=-1)


def test_latency_estimator_takes_a_multiple_of_the_recent_p90_clamped():
    estimator = LatencyEstimator(ceiling=3.0, floor=0.1)
    assert estimator.straggler_timeout() == 3.0  # nothing learnt yet: the ceiling
    estimator.observe(0.2)
    assert estimator.straggler_timeout() == pytest.approx(min(3.0, FACTOR * 0.2))
    for _ in range(29):
        estimator.observe(0.01)
    estimator.observe(1.0)  # two outliers in 32 answers are above the 90th percentile: ignored
    estimator.observe(0.9)
    assert estimator.straggler_timeout() == pytest.approx(0.1)  # FACTOR x 0.01, lifted to the floor
    for _ in range(32):
        estimator.observe(0.3)  # the window forgets: only these 32 count now
    assert estimator.straggler_timeout() == pytest.approx(min(3.0, FACTOR * 0.3))
    for _ in range(32):
        estimator.observe(10.0)
    assert estimator.straggler_timeout() == 3.0  # the ceiling
    estimator.observe(-1.0)  # ignored
    assert estimator.straggler_timeout() == 3.0
    with pytest.raises(ValueError):
        LatencyEstimator(ceiling=0.05, floor=0.1)


def test_the_limit_follows_this_lookups_own_answers():
    """The driver's guess only holds until the first answers: a stale, high guess is lowered to
    STRAGGLER_FACTOR x the answers' p90 (not below the floor), and slow answers raise it above a
    low guess."""
    ids, tables = simulate(seed=6)
    query = DHTID.generate("q")
    traversal = start(ids, tables, query, straggler_timeout=5.0, min_straggler_timeout=0.05)
    first = traversal.next_queries(now=0.0)
    assert traversal.straggler_limit == 5.0 and traversal.next_deadline() == 5.0
    traversal.on_response(first[0], {query: []}, now=0.04)
    limit = STRAGGLER_FACTOR * 0.04
    assert traversal.straggler_limit == pytest.approx(limit)
    assert traversal.next_deadline() == pytest.approx(limit)  # first[1] and first[2], sent at 0
    traversal.on_response(first[1], {query: []}, now=0.01)
    assert traversal.straggler_limit == pytest.approx(limit)  # p90 of two answers is the slower one
    traversal.handle_timer(limit)
    assert traversal.is_straggler(first[2])
    floor = start(ids, tables, query, straggler_timeout=5.0, min_straggler_timeout=0.05)
    request = floor.next_queries(now=1.0)[0]
    floor.on_response(request, {query: []}, now=1.001)
    assert floor.straggler_limit == 0.05
    slow = start(ids, tables, query, straggler_timeout=0.1)
    request = slow.next_queries(now=0.0)[0]
    slow.on_response(request, {query: []}, now=0.5)
    assert slow.straggler_limit == pytest.approx(STRAGGLER_FACTOR * 0.5)
    assert start(ids, tables, query).straggler_limit is None  # no timeout: no stragglers at all


def test_a_short_beam_waits_for_its_stragglers_then_gives_up():
    """With fewer live peers than the beam holds, the stragglers may be all a query has left: it
    waits for them, so a slow live peer still makes the beam, but a silent one only for
    GIVE_UP_FACTOR straggler limits, not until its request fails."""
    ids, tables = simulate(num_nodes=6, seed=7)
    query = DHTID.generate("q")
    by_distance = sorted(ids[1:], key=lambda n: n ^ query)
    silent, slow = {by_distance[0]}, by_distance[1]
    traversal = start(ids, tables, query, straggler_timeout=0.1)
    ended, _ = drive(traversal, tables, {slow: 0.06}, silent)
    assert GIVE_UP_FACTOR * 0.1 <= ended < 1.0 < WAIT_TIMEOUT
    assert sorted(node_id for node_id, _ in traversal.nearest(query)) == sorted(set(ids[1:]) - silent)
    assert traversal.stragglers == 1  # the silent peer's request is still out, abandoned


def test_request_timeout_is_a_multiple_of_the_recent_p90_within_its_bounds():
    estimator = LatencyEstimator(ceiling=3.0, floor=0.1, min_request_timeout=1.0)
    assert estimator.request_timeout() == 3.0  # nothing learnt yet: the ceiling (wait_timeout)
    for _ in range(32):
        estimator.observe(0.005)
    assert estimator.request_timeout() == 1.0  # REQUEST_FACTOR x 5 ms, lifted to the minimum
    for _ in range(32):
        estimator.observe(0.2)
    assert estimator.request_timeout() == pytest.approx(REQUEST_FACTOR * 0.2)
    for _ in range(32):
        estimator.observe(2.0)
    assert estimator.request_timeout() == 3.0  # never above the ceiling
    assert LatencyEstimator(ceiling=0.5, min_request_timeout=1.0).min_request_timeout == 0.5


def test_unanswered_peers_are_silent_since_their_first_unanswered_request():
    peer, other = PEERS[0], PEERS[1]
    unanswered = Unanswered()
    assert unanswered.silent_for(peer, 5.0) == 0.0
    unanswered.sent(peer, 1.0)
    unanswered.sent(peer, 2.0)
    assert unanswered.silent_for(peer, 3.0) == 2.0 and unanswered.silent_for(other, 3.0) == 0.0
    unanswered.finished(peer, 3.5, answered=True)  # it answered one: silent since then at most
    assert unanswered.silent_for(peer, 4.0) == 0.5 and len(unanswered) == 1
    unanswered.finished(peer, 4.0, answered=False)  # nothing in flight: not silent
    assert unanswered.silent_for(peer, 10.0) == 0.0 and len(unanswered) == 0
    unanswered.finished(peer, 11.0, answered=False)  # a stray end changes nothing
    assert len(unanswered) == 0
