"""Internet scale in simulation: Plexus's DHT and matchmaking cores with thousands of peers, in virtual time.

Run: `.venv/bin/python benchmarks/simulate.py [--peers 10000] [--minutes 60] [--interval 3600]
[--matchmaking-peers 1000] [--matchmaking-seconds 40] [--quick]`

The simulator (plexus/testing/simulation) runs the sans-I/O cores (routing table, beam search,
DHT protocol, storage, matchmaking state) of every peer in one process, over a simulated internet:
regional RTTs plus access delays, log-normal uplinks and downlinks, a CPU cost per message, a
connection handshake of 4 RTTs (as the WAN lab measures it) before the first request to a peer,
and volunteer churn (Weibull sessions, median 1 h, about a quarter under 10 minutes). Rows:

  DHT under churn  `--peers` online at any moment, for `--minutes`: every peer stores its record
                   and gets another's (latest=True) once per `--interval` at random phases; each
                   departure is replaced by a newcomer joining through the 3 bootstrap servers.
                   Success, freshness, latency (seconds and RTTs to the bootstrap servers),
                   requests and hops per operation; the same swarm once more with free
                   connections (no handshake), to show what connection set-up costs.
  load             messages per peer per minute, the bootstrap servers' load, connection set-ups
  matchmaking      `--matchmaking-peers` peers (no churn) looking for groups of 16, all under one
                   DHT key (the default) and spread over 64 keys (6 random group bits), and the
                   latter again with free connections: group sizes, rounds without a group,
                   groups broken by a member that had given up, time to a group, and the load on
                   the busiest DHT peer. One bucket of 1,000 costs the simulator most: every read
                   merges ~1,000 entries per answer, as the real peers would.

Every figure is virtual time except the last table (the simulator's own cost on this machine).
"""

import argparse
import collections
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from plexus.testing.simulation.internet import InternetOptions
from plexus.testing.simulation.matchmaker import MatchmakingOptions, MatchmakingSwarm
from plexus.testing.simulation.swarm import DHTSwarm, SwarmOptions


def quantiles(values, *points) -> list[float]:
    ordered = sorted(values)
    if not ordered:
        return [float("nan")] * len(points)
    return [ordered[min(len(ordered) - 1, int(point * len(ordered)))] for point in points]


def table(title: str, header: str, rows: list[str]) -> None:
    print(f"\n{title}\n{header}\n|" + "---|" * (header.count("|") - 1))
    for row in rows:
        print(row, flush=True)


costs: list[str] = []


def timed_run(name: str, swarm: DHTSwarm, duration: float) -> None:
    started = time.monotonic()
    swarm.run()
    wall = time.monotonic() - started
    costs.append(
        f"| {name} | {duration / 60:.0f} min | {wall:.0f} | {swarm.sim.events_run:,} | "
        f"{swarm.sim.events_run / wall:,.0f} | {os.getloadavg()[0]:.1f} |"
    )


def dht_rows(swarm: DHTSwarm, label: str) -> list[str]:
    rows = []
    for kind in ("join", "store", "get"):
        ops = [op for op in swarm.operations if op.kind == kind]
        if not ops:
            continue
        seconds = [op.stats.seconds for op in ops if op.ok]
        rtts = [op.stats.seconds / op.rtt for op in ops if op.ok]
        hops = [op.stats.hops for op in ops if op.stats.hops is not None]
        s50, s99 = quantiles(seconds, 0.5, 0.99)
        r50, r99 = quantiles(rtts, 0.5, 0.99)
        h50, h99 = quantiles(hops, 0.5, 0.99)
        fresh = f"{sum(op.fresh for op in ops) / len(ops):.1%}" if kind == "get" else ""
        succeeded = sum(op.ok for op in ops) / len(ops)
        rows.append(
            f"| {label} | {kind} | {len(ops):,} | {succeeded:.1%} | {fresh} | "
            f"{s50:.2f} / {s99:.2f} | {r50:.1f} / {r99:.1f} | "
            f"{statistics.median(op.stats.requests for op in ops):.0f} | {h50:.0f} / {h99:.0f} |"
        )
    return rows


def load_rows(swarm: DHTSwarm) -> list[str]:
    now = swarm.sim.now
    ordinary = []
    for node in swarm.nodes[len(swarm.bootstrap) :]:
        index = node.peer.index
        minutes = (swarm.left_at.get(index, now) - swarm.joined_at[index]) / 60
        if minutes >= 1:
            ordinary.append((node.peer.messages_sent + node.peer.messages_received) / minutes)
    m50, m99 = quantiles(ordinary, 0.5, 0.99)
    mean = statistics.fmean(ordinary)
    rows = [f"| ordinary peer (online >= 1 min) | {mean:.1f} | {m50:.1f} / {m99:.1f} | | |"]
    for i, node in enumerate(swarm.bootstrap):
        peer = node.peer
        per_minute = (peer.messages_sent + peer.messages_received) / (now / 60)
        rows.append(
            f"| bootstrap server {i} | {per_minute:,.0f} | | "
            f"{peer.busy_time / now:.2%} | {peer.bytes_sent / now * 8 / 1e6:.2f} |"
        )
    requests = sum(op.stats.requests for op in swarm.operations)
    handshakes = swarm.internet.handshakes
    rows.append(f"| connection set-ups | {handshakes:,} for {requests:,} lookup requests | | | |")
    return rows


def run_dht(args) -> None:
    minutes, peers = args.minutes, args.peers
    options = SwarmOptions(
        peers=peers,
        duration=minutes * 60,
        store_interval=args.interval,
        get_interval=args.interval,
        record_ttl=2 * args.interval,
        seed=args.seed,
    )
    swarm = DHTSwarm(options)
    timed_run(f"DHT, {peers:,} peers", swarm, options.duration)
    rows = dht_rows(swarm, "as measured")
    free = DHTSwarm(
        dataclasses.replace(
            options, duration=args.free_minutes * 60, internet=InternetOptions(handshake_rtts=0.0)
        )
    )
    timed_run(f"DHT, {peers:,} peers, free connections", free, free.options.duration)
    rows += dht_rows(free, f"free connections ({args.free_minutes} min)")
    departed = len(swarm.left_at)
    table(
        f"DHT under churn: {peers:,} peers online, {minutes} simulated minutes, {departed:,} departures "
        f"(each replaced by a newcomer); a store and a get(latest=True) per peer every "
        f"{args.interval:.0f} s",
        "| run | operation | count | succeeded | fresh | p50 / p99 s | p50 / p99 RTT | requests p50 "
        "| hops p50 / p99 |",
        rows,
    )
    table(
        "Load (virtual time)",
        "| who | messages / min | p50 / p99 | busy (CPU + downlink) | Mbit/s sent |",
        load_rows(swarm),
    )


def run_matchmaking(args) -> None:
    rows = []
    for bits, handshake_rtts in ((0, 4.0), (6, 4.0), (6, 0.0)):
        label = "one key" if bits == 0 else f"{2**bits} keys"
        label += "" if handshake_rtts else ", free connections"
        swarm = DHTSwarm(
            SwarmOptions(
                peers=args.matchmaking_peers,
                churn=False,
                workload=False,
                duration=args.matchmaking_seconds,
                seed=args.seed,
                internet=InternetOptions(handshake_rtts=handshake_rtts),
            )
        )
        swarm.populate()
        matchmaking = MatchmakingSwarm(swarm, MatchmakingOptions(target_group_size=16), group_bits=bits)
        matchmaking.start()
        started = time.monotonic()
        swarm.sim.run(swarm.options.duration)
        wall = time.monotonic() - started
        costs.append(
            f"| matchmaking, {args.matchmaking_peers:,} peers, {label} | "
            f"{args.matchmaking_seconds:.0f} s "
            f"| {wall:.0f} | {swarm.sim.events_run:,} | {swarm.sim.events_run / wall:,.0f} | "
            f"{os.getloadavg()[0]:.1f} |"
        )
        rounds = matchmaking.rounds
        finished = {id(m) for m in matchmaking.matchmakers if m.round > 1 or m.over}
        grouped = [r for r in rounds if r.group_size]
        sizes = [r.group_size for r in grouped]
        p10, p50, p90 = quantiles(sizes, 0.1, 0.5, 0.9)
        t50, t99 = quantiles([r.seconds for r in grouped], 0.5, 0.99)
        groups = matchmaking.registry.values()
        broken = sum(g["broken"] or g["joined"] < g["size"] for g in groups)
        busiest = max(swarm.nodes, key=lambda node: node.peer.busy_time).peer
        duration = swarm.sim.now
        histogram = collections.Counter(sizes)
        rows.append(
            f"| {label} | {len(rounds):,} ({len(finished):,} peers done) | "
            f"{1 - len(grouped) / max(1, len(rounds)):.1%} | {p10:.0f} / {p50:.0f} / {p90:.0f} | "
            f"{histogram[2] / max(1, len(sizes)):.0%} / {histogram[16] / max(1, len(sizes)):.0%} | "
            f"{broken} of {len(groups)} | {t50:.1f} / {t99:.1f} | "
            f"{busiest.busy_time / duration:.0%}, "
            f"{busiest.bytes_sent * 8 / duration / 1e6:.1f} Mbit/s |"
        )
    table(
        f"Matchmaking: {args.matchmaking_peers:,} peers looking for groups of 16 (min 2) within 5 s of "
        f"each other, {args.matchmaking_seconds:.0f} simulated seconds (rounds that ended in them); "
        f"min_matchmaking_time 5 s, "
        f"request_timeout 3 s, deadline 30 s",
        "| buckets | rounds | without a group | group size p10 / p50 / p90 | pairs / full groups "
        "| broken groups | s to a group p50 / p99 | busiest DHT peer: busy, sent |",
        rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peers", type=int, default=10_000)
    parser.add_argument("--minutes", type=float, default=60)
    parser.add_argument(
        "--interval", type=float, default=3600, help="seconds between a peer's stores (and gets)"
    )
    parser.add_argument("--free-minutes", type=float, default=10, help="length of the free-connection run")
    parser.add_argument("--matchmaking-peers", type=int, default=1000)
    parser.add_argument("--matchmaking-seconds", type=float, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip", nargs="*", choices=("dht", "matchmaking"), default=[])
    parser.add_argument(
        "--quick", action="store_true", help="1,000 peers for 10 minutes; 200 matchmaking peers"
    )
    args = parser.parse_args()
    if args.quick:
        args.peers, args.minutes, args.free_minutes = 1000, 10, 5
        args.matchmaking_peers, args.matchmaking_seconds = 200, 40
    if "dht" not in args.skip:
        run_dht(args)
    if "matchmaking" not in args.skip:
        run_matchmaking(args)
    table(
        "The simulator's own cost on this machine",
        "| run | simulated | wall s | events | events/s | load |",
        costs,
    )


if __name__ == "__main__":
    main()
