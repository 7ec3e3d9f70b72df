"""Connection-flood benchmark: an honest peer's DHT latency while another peer floods the node it uses.

Run: `.venv/bin/python benchmarks/flood.py [--phases 4] [--gets 150]`

A victim DHT node and an honest client node run in this process (real hosts). The client times
gets of keys stored on the victim (`latest=True`, so each asks the victim) in alternating phases:
quiet, then while an attacker in another process floods the victim (`plexus.testing.flood`), then
quiet again, and so on. The attacker dials again and again, 32 dials at once, completes each
handshake it is let through and holds one silent ping stream on every connection the victim keeps;
between flood phases it drops everything. Alternating phases, rather than one baseline first, keep
the load of a shared machine out of the ratio.

The attacker comes from ::1 while honest peers use 127.0.0.1 (two source IPs, as on the internet),
against a victim without the loopback exemption (`limit_exempt_networks=()`), so every bound
applies as it would to a stranger. By default the attacker runs at the lowest CPU priority
(SCHED_IDLE): it stands for another machine, and on a shared box it must not take the victim's CPU
itself; `--attacker-priority normal` lets it compete for the cores (the figures then include that).
Two attacks:

- "one peer id": every connection under the same peer id;
- "many ids": a fresh peer id per connection.

During each flood phase a newcomer joins through the victim (its join time is shown; it joins as a
client, so that the timed gets ask the same single node in every phase). The table
gives get latency p50/p90 over all quiet phases and all flood phases, their ratio, the connections
the victim held from the attacker, the attacker's dial rate, and the share of a core the victim's
process used.
"""

import argparse
import asyncio
import multiprocessing
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from plexus.dht.node import DHTNode
from plexus.dht.p2p_transport import HostDHTTransport
from plexus.p2p.host import Host
from plexus.testing.flood import ConnectionFlood
from plexus.utils.timing import get_dht_time

ROUND = 110  # connections the attacker makes between two looks at its orders


def attack(target: str, identities: int | None, priority: str, go, quit_, tried) -> None:
    """The attacker's process: flood `target` while `go` is set, drop everything when it is cleared."""
    if priority == "idle" and hasattr(os, "sched_setscheduler"):  # runs only when a CPU would idle otherwise
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))

    async def main():
        flood = ConnectionFlood(target, identities=identities)

        async def report() -> None:
            while True:
                tried.value = flood.opened + flood.refused
                await asyncio.sleep(0.1)  # a periodic report, not synchronisation

        reporter = asyncio.ensure_future(report())
        while not quit_.is_set():
            if go.is_set():
                await flood.run(ROUND)
            else:
                await flood.stop()
                await asyncio.sleep(0.05)  # waiting for orders, not synchronisation
        reporter.cancel()
        await flood.stop()

    asyncio.run(main())


async def node(host_maddrs, bootstrap=None, client_mode=False, **options) -> tuple[Host, DHTNode]:
    host = await Host(host_maddrs=host_maddrs, **options).start()
    if bootstrap is not None:
        host.add_addrs(bootstrap[0].peer_id, [bootstrap[1]])
    dht = await DHTNode.create(
        initial_peers=[bootstrap[0].peer_id] if bootstrap else [],
        rpc=HostDHTTransport(host),
        wait_timeout=5,
        client_mode=client_mode,
    )
    return host, dht


async def timed_gets(client: DHTNode, keys: list[str]) -> list[float]:
    times = []
    for key in keys:
        started = time.perf_counter()
        found = await client.get(key, latest=True)
        times.append(time.perf_counter() - started)
        assert found is not None and found.value == key, f"honest get of {key} failed"
    return times


async def scenario(name: str, args, identities: int) -> dict:
    victim = await node(("/ip4/127.0.0.1/tcp/0", "/ip6/::1/tcp/0"), limit_exempt_networks=())
    ip4 = [a for a in victim[0].get_listen_maddrs() if a.protocols()[0] == "ip4"][0]
    target = [a for a in victim[0].get_listen_maddrs() if a.protocols()[0] == "ip6"][0]
    client = await node(("/ip4/127.0.0.1/tcp/0",), (victim[0], ip4))
    keys = [f"key-{i}" for i in range(args.gets)]
    for key in keys:
        assert await victim[1].store(key, key, get_dht_time() + 3600)
    await timed_gets(client[1], keys[:20])  # warm up
    context = multiprocessing.get_context("spawn")
    go, quit_, tried = context.Event(), context.Event(), context.Value("q", 0)
    attacker = context.Process(
        target=attack,
        args=(
            str(target.with_peer_id(victim[0].peer_id)),
            identities,
            args.attacker_priority,
            go,
            quit_,
            tried,
        ),
    )
    attacker.start()
    result = {
        "quiet": [],
        "flood": [],
        "joins": [],
        "held": [],
        "rates": [],
        "cpu": {"quiet": [], "flood": []},
    }
    loop = asyncio.get_running_loop()
    try:
        for _ in range(args.phases):
            for phase in ("quiet", "flood"):
                if phase == "flood":
                    go.set()
                    await asyncio.sleep(args.warmup)  # the scenario: the flood has been going for a while
                    started = time.perf_counter()
                    newcomer = await node((), (victim[0], ip4), client_mode=True)  # not asked by the gets
                    result["joins"].append(time.perf_counter() - started)
                cpu, wall, tried_before = time.process_time(), time.perf_counter(), tried.value
                result[phase] += await timed_gets(client[1], keys)
                elapsed = time.perf_counter() - wall
                result["cpu"][phase].append((time.process_time() - cpu) / elapsed)
                if phase == "flood":
                    result["rates"].append((tried.value - tried_before) / elapsed)
                    result["held"].append(len(victim[0]._tickets) - 2)  # less the client's and the newcomer's
                    go.clear()
                    await newcomer[1].shutdown()
                    await newcomer[0].shutdown()
                    await loop.run_in_executor(None, time.sleep, 0.5)  # let the attacker drop its connections
    finally:
        quit_.set()
        await loop.run_in_executor(None, attacker.join, 30)
    for host, dht in (client, victim):
        await dht.shutdown()
        await host.shutdown()
    return result


def quantile(values, q):
    return statistics.quantiles(values, n=100)[q - 1]


async def main(args) -> None:
    results = {
        "one peer id": await scenario("one peer id", args, 1),
        "many ids": await scenario("many ids", args, None),
    }
    print(
        f"\n{'attack':<12} {'phase':<6} {'get p50 ms':>10} {'p90 ms':>7} {'p50 x':>6} {'p90 x':>6} "
        f"{'join s':>7} {'held':>5} {'dials/s':>8} {'victim CPU':>10}"
    )
    for name, result in results.items():
        base50, base90 = quantile(result["quiet"], 50), quantile(result["quiet"], 90)
        for phase in ("quiet", "flood"):
            p50, p90 = quantile(result[phase], 50), quantile(result[phase], 90)
            join, held, rate = ("", "", "")
            if phase == "flood":
                join, held = f"{max(result['joins']):.2f}", max(result["held"])
                rate = f"{statistics.mean(result['rates']):.0f}"
            print(
                f"{name:<12} {phase:<6} {p50 * 1e3:>10.2f} {p90 * 1e3:>7.2f} "
                f"{p50 / base50:>6.2f} {p90 / base90:>6.2f} "
                f"{join:>7} {held:>5} {rate:>8} {statistics.mean(result['cpu'][phase]):>10.0%}"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--phases", type=int, default=4, help="quiet/flood phase pairs per attack")
    parser.add_argument("--gets", type=int, default=150, help="timed gets per phase")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of flood before each flood phase")
    parser.add_argument(
        "--attacker-priority",
        choices=("idle", "normal"),
        default="idle",
        help="idle: the attacker gets only CPU time nobody else wants (like another "
        "machine); "
        "normal: it competes with the victim for this machine's cores",
    )
    asyncio.run(main(parser.parse_args()))
