"""The simulator (plexus.testing.simulation): virtual time, the simulated internet, and small swarms
running the real DHT and matchmaking cores under churn."""

import statistics

import pytest

from plexus.testing.simulation.events import Simulator
from plexus.testing.simulation.internet import Internet, InternetOptions
from plexus.testing.simulation.matchmaker import MatchmakingOptions, MatchmakingSwarm
from plexus.testing.simulation.swarm import DHTSwarm, SwarmOptions


def test_events_run_in_time_order_and_can_be_cancelled():
    sim, seen = Simulator(), []
    sim.after(2.0, seen.append, "late")
    sim.after(1.0, seen.append, "early")
    sim.at(1.0, seen.append, "early, scheduled second")
    sim.after(1.5, seen.append, "cancelled").cancel()
    sim.run(until=1.9)
    assert seen == ["early", "early, scheduled second"] and sim.now == 1.9
    sim.run(until=5.0)
    assert seen[-1] == "late" and sim.pending == 0


def two_peers(**options):
    sim = Simulator(seed=1)
    internet = Internet(sim, InternetOptions(service_time=0.0, **options))
    a, b = internet.add_peer(up=8e6, down=8e6), internet.add_peer(up=8e6, down=8e6)
    return sim, internet, a, b


def test_a_message_takes_its_transmission_time_plus_the_path_delay():
    sim, internet, a, b = two_peers()
    arrivals = []
    b.handler = lambda sender, message, reply: arrivals.append((sim.now, message))
    internet.send(a, b, "hello", size=100_000)  # 0.1 s at 8 Mbit/s on the way out, 0.1 s on the way in
    internet.send(a, b, "second", size=100_000)  # waits for the first on the uplink
    sim.run(until=10.0)
    one_way = internet.one_way(a, b)
    assert arrivals[0] == (pytest.approx(0.2 + one_way), "hello")
    assert arrivals[1][0] == pytest.approx(0.3 + one_way)


def test_calls_pay_a_handshake_first_and_time_out_on_a_departed_peer():
    sim, internet, a, b = two_peers(handshake_rtts=4.0, idle_timeout=60.0)
    b.handler = lambda sender, message, reply: reply(message.upper(), 10)
    answers = []
    internet.call(a, b, "ping", 10, timeout=5.0, on_done=lambda r: answers.append((sim.now, r)))
    sim.run(until=1.0)
    internet.call(a, b, "again", 10, timeout=5.0, on_done=lambda r: answers.append((sim.now - 1.0, r)))
    sim.run(until=2.0)
    rtt = internet.rtt(a, b)
    assert answers[0] == (pytest.approx(5 * rtt, rel=0.01), "PING")  # 4 round trips of set-up, then 1
    assert answers[1] == (pytest.approx(rtt, rel=0.01), "AGAIN")  # the connection is there now
    b.alive = False
    internet.call(a, b, "anyone?", 10, timeout=5.0, on_done=lambda r: answers.append((sim.now - 2.0, r)))
    sim.run(until=10.0)
    assert answers[2] == (pytest.approx(5.0), None)
    assert internet.handshakes == 1


def test_a_call_waiting_for_its_handshake_does_not_hold_up_the_uplink():
    sim, internet, a, b = two_peers(handshake_rtts=4.0, idle_timeout=60.0)
    c = internet.add_peer()
    arrivals = []
    b.handler = lambda sender, message, reply: arrivals.append((sim.now, message))
    c.handler = lambda sender, message, reply: arrivals.append((sim.now, message))
    internet.call(a, c, "dial", 10, timeout=30.0, on_done=lambda r: None)  # a new connection: 4 RTT
    internet.send(a, b, "meanwhile", size=10)
    sim.run(until=30.0)
    assert [message for _, message in arrivals] == ["meanwhile", "dial"]
    assert arrivals[0][0] < internet.rtt(a, c)  # it did not wait for the set-up to c


def test_volunteer_sessions_are_heavy_tailed_around_the_median():
    internet = Internet(Simulator(seed=3), InternetOptions(median_session=3600.0))
    sessions = [internet.session_length() for _ in range(20000)]
    assert statistics.median(sessions) == pytest.approx(3600, rel=0.05)
    assert sum(s < 600 for s in sessions) / len(sessions) == pytest.approx(0.25, abs=0.02)
    assert max(sessions) > 24 * 3600  # a few stay for days
    residual = [internet.residual_session() for _ in range(4000)]
    assert statistics.median(residual) > statistics.median(sessions)  # peers seen online stay longer


def small_swarm(**changes) -> DHTSwarm:
    options = SwarmOptions(
        peers=150,
        duration=600.0,
        store_interval=120.0,
        get_interval=120.0,
        record_ttl=400.0,
        seed=7,
        internet=InternetOptions(median_session=600.0),
    )
    swarm = DHTSwarm(SwarmOptions(**{**vars(options), **changes}))
    swarm.run()
    return swarm


@pytest.mark.timeout(60)
def test_a_small_swarm_under_churn_stores_finds_and_replaces_its_peers():
    swarm = small_swarm()
    by_kind = {kind: [op for op in swarm.operations if op.kind == kind] for kind in ("join", "store", "get")}
    assert len(swarm.left_at) > 20 and len(swarm.online) == 150 + 3  # departures were replaced
    assert by_kind["join"] and all(op.ok for op in by_kind["join"])
    stores = by_kind["store"]
    assert len(stores) > 400 and sum(op.ok for op in stores) / len(stores) > 0.99
    gets = by_kind["get"]
    assert len(gets) > 400 and sum(op.ok for op in gets) / len(gets) > 0.97, "records outlive their owners"
    assert sum(op.fresh for op in gets) / len(gets) > 0.9
    assert all(op.stats.hops is None or op.stats.hops >= 0 for op in gets)
    assert statistics.median(op.stats.requests for op in gets) > 3  # latest=True searches the beam
    assert all(b.peer.messages_received > 0 for b in swarm.bootstrap)  # every newcomer came through them


@pytest.mark.timeout(60)
def test_the_same_seed_gives_the_same_run():
    first, second = small_swarm(peers=60, duration=200.0), small_swarm(peers=60, duration=200.0)
    summary = [
        [(op.kind, op.ok, round(op.stats.seconds, 9), op.stats.requests) for op in swarm.operations]
        for swarm in (first, second)
    ]
    assert summary[0] == summary[1] and summary[0]


@pytest.mark.timeout(60)
def test_peers_looking_at_once_form_groups_no_larger_than_the_target():
    swarm = DHTSwarm(SwarmOptions(peers=40, churn=False, workload=False, duration=60.0, seed=2))
    swarm.populate()
    matchmaking = MatchmakingSwarm(swarm, MatchmakingOptions(target_group_size=8), start_spread=2.0)
    matchmaking.start()
    swarm.sim.run(swarm.options.duration)
    rounds = matchmaking.rounds
    assert len(rounds) >= 80  # 40 peers, each round about 10 s of matchmaking and averaging
    grouped = [r for r in rounds if r.group_size]
    assert len(grouped) / len(rounds) > 0.9
    assert all(2 <= r.group_size <= 8 for r in grouped)
    assert any(r.group_size == 8 for r in grouped)
    groups = list(matchmaking.registry.values())
    intact = [g for g in groups if not g["broken"] and g["joined"] == g["size"]]
    assert len(intact) / len(groups) > 0.9
    leaders = sum(r.led for r in grouped)
    assert leaders == len(groups)  # one leader per group, and every group has one
