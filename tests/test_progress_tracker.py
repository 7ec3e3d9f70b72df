"""ProgressTracker over real DHT peers: counting, signed records, forgeries, dead peers, leaving."""

import pytest

from plexus.dht.dht import DHT
from plexus.optim.progress_tracker import ProgressTracker
from plexus.testing import wait_until
from plexus.utils.performance_ema import PerformanceEMA
from plexus.utils.timing import get_dht_time

pytestmark = pytest.mark.timeout(60)
LOCAL = ["/ip4/127.0.0.1/tcp/0"]
FAST = dict(min_refresh_period=0.05, max_refresh_period=0.5, default_refresh_period=0.2)


@pytest.fixture
def dhts():
    first = DHT(start=True, host_maddrs=LOCAL)
    peers = [first] + [DHT(initial_peers=first.get_visible_maddrs(), start=True, host_maddrs=LOCAL) for _ in range(2)]
    yield peers
    for peer in peers:
        peer.shutdown()


def test_peers_count_each_other_and_reach_the_target(dhts):
    trackers = [ProgressTracker(dht, "run", target_batch_size=96, **FAST) for dht in dhts]
    try:
        for tracker in trackers:
            tracker.report_local_progress(0, 16)
        wait_until(lambda: all(t.global_progress.num_peers == 3 for t in trackers), 10, message="3 peers seen")
        assert not trackers[0].ready_to_update_epoch or trackers[0].global_progress.samples_accumulated >= 48
        for tracker in trackers:
            tracker.report_local_progress(0, 32)
        wait_until(lambda: trackers[1].global_progress.samples_accumulated == 96, 10, message="96 samples")
        assert trackers[1].ready_to_update_epoch
        trackers[0].update_epoch(1)
        wait_until(lambda: trackers[2].global_progress.epoch == 1, 10, message="epoch 1 seen by others")
        assert trackers[2].ready_to_update_epoch, "a peer behind the global epoch must update"
    finally:
        for tracker in trackers:
            tracker.shutdown()


def test_forged_and_malformed_progress_is_ignored(dhts):
    honest, attacker = ProgressTracker(dhts[0], "run", 1000, **FAST), dhts[1]
    ProgressTracker(dhts[2], "run", 1000, start=False)  # an observer with the swarm's validators
    try:
        honest.report_local_progress(0, 10)
        key, victim_subkey = honest.training_progress_key, honest._subkey
        forged = dict(honest.local_progress.model_dump(), samples_accumulated=999, time=get_dht_time())
        # the attacker (no validators of its own, so it keeps its copy) writes the honest peer's entry
        # without its key, an unsigned entry under a made-up sub-key, and a malformed entry
        attacker.store(key, forged, get_dht_time() + 60, subkey=victim_subkey)
        attacker.store(key, forged, get_dht_time() + 60, subkey=b"not-an-owner")
        attacker.store(key, {"epoch": "zero"}, get_dht_time() + 60, subkey=b"[owner:AAAA]")
        for _ in range(3):  # several fresh fetches all see only the honest, signed record
            progress = honest.fetch_global_progress_now(timeout=10)
            assert (progress.num_peers, progress.samples_accumulated) == (1, 10)
        entries = dhts[2].get(key, latest=True).value
        assert list(entries) == [victim_subkey], "validating peers drop forged entries from results"
    finally:
        honest.shutdown()


def test_dead_peer_stops_counting_and_leaving_peer_removes_itself(dhts):
    trackers = [ProgressTracker(dht, "run", 10_000, **FAST) for dht in dhts]
    for tracker in trackers:
        tracker.report_local_progress(0, 5)
    wait_until(lambda: trackers[0].global_progress.num_peers == 3, 10, message="3 peers seen")
    trackers[1].shutdown()  # leaves politely: removed at once
    wait_until(lambda: trackers[0].global_progress.num_peers == 2, 5, message="leaver gone")
    trackers[2]._tasks.pop().cancel()  # dies: stops reporting, says nothing
    wait_until(lambda: trackers[0].global_progress.num_peers == 1, 5, message="dead peer dropped")
    trackers[0].shutdown()


def test_performance_ema_pauses():
    now = [0.0]
    ema = PerformanceEMA(alpha=0.5, clock=lambda: now[0])
    now[0] = 1.0
    assert ema.update(10) == pytest.approx(10.0)
    with ema.pause():
        now[0] = 100.0
    now[0] = 101.0
    assert ema.update(10) == pytest.approx(10.0)
    with pytest.raises(ValueError):
        ema.update(0)
