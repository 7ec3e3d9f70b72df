"""ProgressTracker over real DHT peers: counting, signed records, forgeries, dead peers, leaving."""

import pytest

from plexus.dht.crypto import Ed25519SignatureValidator
from plexus.dht.dht import DHT
from plexus.dht.routing import DHTID
from plexus.optim.progress_tracker import ProgressTracker
from plexus.p2p.identity import PrivateKey
from plexus.testing import wait_until
from plexus.utils.performance_ema import PerformanceEMA
from plexus.utils.serializer import MSGPackSerializer
from plexus.utils.timing import get_dht_time

pytestmark = pytest.mark.timeout(60)
LOCAL = ["/ip4/127.0.0.1/tcp/0"]
FAST = dict(min_refresh_period=0.05, max_refresh_period=0.5, default_refresh_period=0.2)
LASTING = dict(FAST, max_refresh_period=20.0)  # records published once stay fresh through a test


@pytest.fixture
def dhts():
    first = DHT(start=True, host_maddrs=LOCAL)
    peers = [first] + [
        DHT(initial_peers=first.get_visible_maddrs(), start=True, host_maddrs=LOCAL) for _ in range(2)
    ]
    yield peers
    for peer in peers:
        peer.shutdown()


def test_peers_count_each_other_and_reach_the_target(dhts):
    trackers = [ProgressTracker(dht, "run", target_batch_size=96, **FAST) for dht in dhts]
    try:
        for tracker in trackers:
            tracker.report_local_progress(0, 16)
        wait_until(
            lambda: all(t.global_progress.num_peers == 3 for t in trackers), 10, message="3 peers seen"
        )
        assert not trackers[0].ready_to_update_epoch or trackers[0].global_progress.samples_accumulated >= 48
        for tracker in trackers:
            tracker.report_local_progress(0, 32)
        wait_until(lambda: trackers[1].global_progress.samples_accumulated == 96, 10, message="96 samples")
        assert trackers[1].ready_to_update_epoch
        trackers[0].update_epoch(1)
        # one peer of three ahead is not believed unconfirmed (nor counted: its claim is not checked yet)
        wait_until(lambda: trackers[2].global_progress.num_peers == 2, 10, message="the lone claim set aside")
        assert trackers[2].global_progress.epoch == 0
        trackers[1].update_epoch(1)
        wait_until(lambda: trackers[2].global_progress.epoch == 1, 10, message="the majority's epoch seen")
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


class Forger:
    """A hostile peer's identities: each signs its own progress records, stored through the public API."""

    def __init__(self, dht: DHT, key: str):
        self.dht, self.key, self.count = dht, key, 0

    def publish(self, expiration: float | None = None, **fields) -> bytes:
        private_key = PrivateKey.generate()
        signer = Ed25519SignatureValidator(private_key)
        self.dht.add_validators([signer])
        record = dict(
            peer_id=private_key.peer_id.to_bytes(),
            epoch=0,
            samples_accumulated=5,
            samples_per_second=1.0,
            time=get_dht_time(),
            client_mode=False,
        )
        record.update(fields)
        self.count += 1
        self.dht.store(self.key, record, expiration or get_dht_time() + 30, subkey=signer.local_public_key)
        return signer.local_public_key


def test_signed_records_that_break_a_bound_or_the_schema_are_ignored(dhts):
    honest = ProgressTracker(dhts[0], "run", 1000, **LASTING)
    ProgressTracker(dhts[2], "run", 1000, start=False)  # another honest storing node with the validators
    forger, forged_subkeys = Forger(dhts[1], honest.training_progress_key), []
    try:
        honest.performance_ema.samples_per_second = 1.0
        honest.report_local_progress(0, 10, update_global_samples=False)
        now = get_dht_time()
        for forgery in [
            dict(samples_per_second=1e300),
            dict(samples_accumulated=10**12),
            dict(time=now + 1e6),
            dict(peer_id=dhts[2].peer_id.to_bytes()),
            dict(expiration=now + 1000),
            dict(extra_field=1),
            dict(samples_accumulated=-5),
            dict(epoch=-1),
            dict(samples_per_second=-1.0),
            dict(samples_per_second=float("nan")),
            dict(time=float("inf")),
            dict(epoch="0"),
            dict(epoch=0.0),
            dict(client_mode=0),
            dict(peer_id="text"),
        ]:
            forged_subkeys.append(forger.publish(**forgery))
        forger.publish()  # in bounds, stored last: once it is counted, every forgery before it was seen
        wait_until(lambda: honest.fetch_global_progress_now(timeout=10).num_peers == 2, 10, message="control")
        for storing_node in (dhts[0], dhts[2]):  # nodes with the validators refused what they can check
            key_id = DHTID.generate(source=honest.training_progress_key)
            held = storing_node.node.storage.get(key_id, get_dht_time())
            refused = [MSGPackSerializer.dumps(subkey) for subkey in forged_subkeys[3:5]]  # id, expiration
            assert held is not None and not any(subkey in held.value for subkey in refused)
        for _ in range(3):
            progress = honest.fetch_global_progress_now(timeout=10)
            assert (progress.num_peers, progress.samples_accumulated, progress.epoch) == (2, 15, 0)
            assert progress.eta_next_epoch - get_dht_time() > 1.0, "no forged speed moved the ETA"
    finally:
        honest.shutdown()


def test_one_outlier_in_bounds_cannot_move_the_count_or_the_eta(dhts):
    honest = ProgressTracker(dhts[0], "run", 1000, **LASTING)
    forger = Forger(dhts[1], honest.training_progress_key)
    try:
        honest.performance_ema.samples_per_second = 10.0
        honest.report_local_progress(0, 10, update_global_samples=False)
        forger.publish(samples_accumulated=3000, samples_per_second=900_000.0)  # within the bounds
        wait_until(
            lambda: honest.fetch_global_progress_now(timeout=10).num_peers == 2, 10, message="outlier seen"
        )
        progress = honest.global_progress
        assert progress.samples_accumulated <= 10 + 4 * 10, "counts at most outlier_factor x the lower median"
        assert not honest.ready_to_update_epoch
        assert progress.eta_next_epoch - get_dht_time() > 5.0, "speed counts at most 4 x the lower median"
    finally:
        honest.shutdown()


def test_epoch_ahead_of_the_majority_is_believed_only_once_its_state_server_confirms(dhts, monkeypatch):
    confirmed_peers = {}

    async def stated_priority(host, prefix, peer_id, *, timeout):
        assert prefix == "run_state"
        return confirmed_peers.get(peer_id, 7)  # the forger serves a state, but not of the epoch it claims

    monkeypatch.setattr("plexus.optim.progress_tracker.stated_priority", stated_priority)
    options = dict(LASTING, state_prefix="run_state", epoch_claim_grace=0.2)
    first, second = (ProgressTracker(dht, "run", 1000, **options) for dht in dhts[:2])
    forger = Forger(dhts[2], first.training_progress_key)
    try:
        first.report_local_progress(0, 10)
        expires = get_dht_time() + 5.0
        forger.publish(epoch=10**9, expiration=expires)
        wait_until(lambda: first._last_probe and not first._probes, 10, message="the forged epoch checked")
        for _ in range(3):
            assert first.fetch_global_progress_now(timeout=10).epoch == 0
            assert first.global_progress.num_peers == 2, "an unconfirmed claim counts for nothing"
        # with the forgery gone, a peer alone ahead has no majority: only its state server can vouch
        wait_until(lambda: get_dht_time() > expires, 10, message="the forgery expired")
        confirmed_peers[dhts[1].peer_id] = 3  # a peer that stepped alone and serves that state
        second.update_epoch(3)
        second.report_local_progress(3, 5)
        wait_until(lambda: first.global_progress.epoch == 3, 10, message="the confirmed epoch believed")
        assert first.ready_to_update_epoch
    finally:
        first.shutdown()
        second.shutdown()


def test_a_plain_value_cannot_erase_the_signed_progress(dhts):
    trackers = [ProgressTracker(dht, "run", 1000, **FAST) for dht in dhts[:2]]
    try:
        for tracker in trackers:
            tracker.report_local_progress(0, 10)
        wait_until(lambda: all(t.global_progress.num_peers == 2 for t in trackers), 10, message="peers seen")
        dhts[2].store(trackers[0].training_progress_key, {}, get_dht_time() + 3600)  # unsigned, far ahead
        for tracker in trackers:
            tracker.report_local_progress(0, 20)
        wait_until(
            lambda: all(t.global_progress.samples_accumulated == 40 for t in trackers),
            10,
            message="both peers still publish and read each other",
        )
        assert isinstance(dhts[0].get(trackers[0].training_progress_key, latest=True).value, dict)
    finally:
        for tracker in trackers:
            tracker.shutdown()


def test_a_passed_eta_alone_does_not_make_a_peer_ready(dhts):
    tracker = ProgressTracker(dhts[0], "run", 1000, **FAST)
    try:
        tracker.performance_ema.samples_per_second = 10_000.0  # predicts the target within 0.1 s
        tracker.report_local_progress(0, 10, update_global_samples=False)
        progress = tracker.fetch_global_progress_now(timeout=10)
        wait_until(lambda: get_dht_time() > progress.eta_next_epoch, 5, message="the ETA passed")
        assert not tracker.ready_to_update_epoch, "10 of 1000 samples: not ready, whatever the prediction"
        tracker.report_local_progress(0, 1000, update_global_samples=False)
        wait_until(
            lambda: tracker.fetch_global_progress_now(timeout=10).samples_accumulated == 1000,
            5,
            message="the target reported",
        )
        assert tracker.ready_to_update_epoch
    finally:
        tracker.shutdown()
