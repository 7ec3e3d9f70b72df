"""plexus.testing's churn harness without processes: schedules, fault parsing, and the report's
figures on made-up peer reports (the swarm itself runs in test_optimizer_churn.py)."""

import argparse

import pytest

from plexus.testing import ChurnEvent, ChurnSchedule, Fault, ForgedProgress, NaNGradients, Silent, Slow
from plexus.testing.churn import build_parser, parse_fault
from plexus.testing.report import ChurnRecord, SwarmReport
from plexus.testing.swarm_peer import Finished, Heartbeat, Ready, Transition


def test_random_kills_take_one_peer_down_at_a_time_and_bring_it_back():
    schedule = ChurnSchedule.random_kills(
        300, 4, every=(15, 25), restart_after=(2, 5), start_after=10, seed=3
    )
    kills = [e for e in schedule.events if e.action == "kill"]
    assert 10 <= len(kills) <= 20 and all(e.at > 10 for e in kills)
    down = None
    for event in schedule.events:
        if event.action == "kill":
            assert down is None, "a second peer killed while one is down"
            down = event.peer
        else:
            assert event.action == "restart" and event.peer == down
            down = None
    assert ChurnSchedule.random_kills(300, 4, seed=3) == ChurnSchedule.random_kills(300, 4, seed=3)
    assert {e.peer for e in ChurnSchedule.random_kills(300, 4, victims=[2, 3]).events} <= {2, 3}


def test_staggered_joins_and_event_checks():
    joins = ChurnSchedule.staggered_joins(4, every=3.0)
    assert [(e.at, e.action, e.peer) for e in joins.events] == [
        (3.0, "start", 1),
        (6.0, "start", 2),
        (9.0, "start", 3),
    ]
    merged = joins + ChurnSchedule((ChurnEvent(1.0, "kill", 0),))
    assert [e.at for e in merged.events] == [1.0, 3.0, 6.0, 9.0], "events are kept in time order"
    with pytest.raises(ValueError, match="unknown churn action"):
        ChurnEvent(1.0, "explode", 0)
    with pytest.raises(ValueError):
        ChurnEvent(-1.0, "kill", 0)


def test_faults_from_the_command_line():
    assert parse_fault("2:nan") == (2, NaNGradients())
    assert parse_fault("3:silent:after=20") == (3, Silent(after=20.0))
    assert parse_fault("1:forged:epoch_ahead=5,after=1") == (1, ForgedProgress(after=1.0, epoch_ahead=5))
    assert isinstance(parse_fault("0:slow:delay=0.5")[1], Slow)
    for bad in ("x:nan", "2:meteor", "2:slow:speed=3"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_fault(bad)
    args = build_parser().parse_args(["--peers", "3", "--fault", "2:nan", "--no-churn"])
    assert args.peers == 3 and args.fault == [(2, NaNGradients())] and args.no_churn
    assert Fault().honest and Slow().honest and not NaNGradients().honest and not Silent().honest


def step(index, incarnation, time, epoch, digest, kind="step", loads=0):
    return Transition(index, incarnation, time, kind, epoch, digest, loads, 0, 0, 0.0)


def test_report_figures_from_peer_reports():
    messages = [
        Ready(0, 1, 100, ("/ip4/127.0.0.1/tcp/1",), 1.0),
        Ready(1, 1, 101, ("/ip4/127.0.0.1/tcp/2",), 2.0),
        step(0, 1, 2.0, 0, "init", kind="start"),
        step(1, 1, 2.5, 0, "init", kind="start"),
        step(0, 1, 10.0, 1, "a1"),
        step(1, 1, 10.1, 1, "a1"),
        step(0, 1, 20.0, 2, "a2"),
        step(1, 1, 20.2, 2, "forked"),  # peer 1 forked epoch 2...
        step(1, 1, 21.0, 2, "a2", kind="load", loads=1),  # ...and reloaded before stepping on
        step(0, 1, 30.0, 3, "a3"),
        step(1, 1, 30.1, 3, "b3"),  # a disagreement that stands
        Ready(1, 2, 102, ("/ip4/127.0.0.1/tcp/3",), 40.0),
        step(1, 2, 41.0, 0, "init", kind="start"),
        step(1, 2, 44.0, 3, "a3", kind="load", loads=1),
        step(0, 1, 100.0, 4, "a4"),
        step(1, 2, 100.5, 4, "a4"),
        Heartbeat(0, 1, 50.0, 3, 300 * 1024),
        Finished(0, 1, 101.0, 4, 0, 4, 0, 320 * 1024, (), {"W x": 2}),
    ]
    churn = [
        ChurnRecord(0.5, "spawn", 0, 1),
        ChurnRecord(1.0, "spawn", 1, 1),
        ChurnRecord(35.0, "kill", 1, 1),
        ChurnRecord(38.0, "spawn", 1, 2),
    ]
    report = SwarmReport(
        messages, churn, begin=5.0, end=110.0, num_peers=2, exit_codes={(1, 1): -9, (0, 1): 0}
    )

    assert report.swarm_epochs() == [(5.0, 0), (10.0, 1), (20.0, 2), (30.0, 3), (100.0, 4)]
    assert report.epochs == 4 and report.longest_stall == 70.0
    assert report.stall_after_kill() == [70.0], "the kill at 35 s fell in the stall from 30 s to 100 s"
    assert report.hangs == 1, "a 70 s stall is a hang (hang_after=60)"
    assert report.disagreements() == {3: {"a3": ["0.1", "1.2"], "b3": ["1.1"]}}, (
        "the reloaded fork does not count"
    )
    assert report.catch_up_loads() == {1: 1}, "a restart's first download is its join, not a catch-up"
    assert report.never_killed_catch_up_loads == 0
    assert report.rejoin_times() == [6.0], "spawned at 38 s, at the swarm's epoch at 44 s"
    assert report.ready_times() == [0.5, 1.0, 2.0]
    assert report.crashes == [] and report.max_rss_mib == 320 and report.warnings() == {"W x": 2}
    table = report.table()
    assert "same-epoch disagreements             1" in table and "W x" in table
    assert report.timeline(50) == "0s:0 50s:3 100s:4"

    crashed = SwarmReport(messages, churn[:2], begin=5.0, end=110.0, num_peers=2, exit_codes={(1, 1): 1})
    assert crashed.crashes == ["1.1: exit code 1"], "died on its own: a crash"
