"""Silent routing-table entries leave without waiting for a lookup to trip over them: hand-out
checks (budgeted) and sweeps after a failure. The core on plain numbers, then in-memory swarms."""

import asyncio

import pytest

from plexus.dht.liveness import LivenessChecker, LivenessOptions
from plexus.dht.messages import FindRequest, FindResponse
from plexus.dht.node import DHTNode
from plexus.dht.routing import DHTID
from plexus.p2p.identity import PrivateKey
from plexus.testing import MemoryNetwork
from plexus.utils.timing import ManualClock, get_dht_time, use_clock

pytestmark = pytest.mark.timeout(60)

PEERS = [PrivateKey.from_seed(bytes([i]) * 32).peer_id for i in range(1, 40)]


def test_hand_out_checks_pick_stale_entries_once_per_period_within_the_budget():
    checker = LivenessChecker(LivenessOptions(stale_after=10.0, checks_per_second=1.0, check_burst=3))
    entries = [(DHTID(i), PEERS[i]) for i in range(6)]
    # when each entry was last heard from; entry 5 is not in the table
    seen = {DHTID(0): 96.0, DHTID(1): 50.0, DHTID(2): 40.0, DHTID(3): 30.0, DHTID(4): 20.0}
    due = checker.to_check(entries, seen.get, now=100.0)
    assert due == entries[1:4]  # fresh and unknown ones skipped; the burst of 3 spent
    assert checker.to_check(entries, seen.get, now=100.5) == []  # no budget left
    assert checker.to_check(entries, seen.get, now=102.0) == [entries[4]]  # refilled: the one not checked yet
    assert checker.to_check(entries, seen.get, now=105.0) == []  # each at most once per stale_after
    assert checker.to_check(entries, seen.get, now=111.0) == entries[:3]  # 0 stale by now; budget of 3
    assert LivenessChecker(LivenessOptions(stale_after=None)).to_check(entries, seen.get, now=1e9) == []


def test_sweeps_start_at_most_once_per_interval_sooner_after_a_quiet_entry_failed():
    checker = LivenessChecker(LivenessOptions(sweep_interval=30.0, stale_after=2.0))
    assert checker.sweep_after_failure(sent_at=99.0, now=100.0) == 99.0
    assert checker.sweep_after_failure(sent_at=110.0, now=111.0) is None
    assert checker.sweep_after_failure(sent_at=111.0, now=112.0, quiet_entry=True) == 111.0
    assert checker.sweep_after_failure(sent_at=112.5, now=113.0, quiet_entry=True) is None
    assert checker.sweep_after_failure(sent_at=141.0, now=142.0) == 141.0
    assert LivenessChecker(LivenessOptions(sweep_interval=None)).sweep_after_failure(1.0, 2.0) is None
    for bad in (
        dict(stale_after=0),
        dict(sweep_interval=-1),
        dict(checks_per_second=0),
        dict(check_burst=0),
        dict(sweep_concurrency=0),
    ):
        with pytest.raises(ValueError):
            LivenessOptions(**bad)


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, timeout=50))


async def wait_for(predicate, timeout: float) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.02)  # polling with a deadline for background checks
    return True


async def star(network, count: int, **options) -> list[DHTNode]:
    """A hub and `count` nodes that joined through it: they are all in the hub's table."""
    hub = await DHTNode.create(rpc=network.create_transport(), **options)
    others = [
        await DHTNode.create(rpc=network.create_transport(), initial_peers=[hub.peer_id], **options)
        for _ in range(count)
    ]
    return [hub, *others]


@pytest.mark.parametrize("checks", [True, False])
def test_a_silent_entry_named_in_an_answer_is_checked_and_evicted(checks):
    async def main():
        network = MemoryNetwork()
        liveness = LivenessOptions(stale_after=10.0 if checks else None, sweep_interval=None)
        hub, *others = await star(network, 5, liveness=liveness, wait_timeout=0.5)
        frozen = others[0]
        network.make_unresponsive(frozen.peer_id)
        assert frozen.peer_id in hub.routing_table
        clock.advance(11.0)  # nothing heard from any entry for longer than stale_after
        asker = network.create_transport()  # a client: asks the hub for the peers nearest the frozen one
        request = FindRequest(None, (frozen.node_id,)).encode()
        response = FindResponse.decode(await asker.call(hub.peer_id, request, 1))
        assert frozen.node_id in [node_id for node_id, _ in response.results[0].nearest]  # named anyway
        evicted = await wait_for(
            lambda: frozen.peer_id not in hub.routing_table, timeout=3 if checks else 1.5
        )
        assert evicted == checks
        assert all(node.peer_id in hub.routing_table for node in others[1:])
        await asyncio.gather(*(node.shutdown() for node in [hub, *others]))

    clock = ManualClock()
    with use_clock(clock):
        run(main())


@pytest.mark.parametrize("sweeps", [True, False])
def test_a_failed_request_sweeps_the_entries_silent_since(sweeps):
    async def main():
        network = MemoryNetwork()
        liveness = LivenessOptions(stale_after=None, sweep_interval=0.0 if sweeps else None)
        hub, *others = await star(network, 12, liveness=liveness, wait_timeout=0.5)
        frozen = others[:8]
        for node in frozen:
            network.make_unresponsive(node.peer_id)
        # one request that fails is the evidence; nothing asks the other frozen peers
        assert await hub._call(frozen[0].peer_id, FindRequest(hub.node_id, (DHTID(1),)), FindResponse) is None
        gone = await wait_for(
            lambda: all(node.peer_id not in hub.routing_table for node in frozen),
            timeout=5 if sweeps else 1.5,
        )
        assert gone == sweeps
        assert all(node.peer_id in hub.routing_table for node in others[8:])  # the live ones answered
        assert hub.routing_table.last_seen(others[8].node_id) <= get_dht_time()
        await asyncio.gather(*(node.shutdown() for node in [hub, *others]))

    run(main())
