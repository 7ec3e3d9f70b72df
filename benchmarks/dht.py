"""DHT benchmark: a swarm of real libp2p hosts on 127.0.0.1 storing and finding keys.

Run: `.venv/bin/python benchmarks/dht.py [--sizes 2,8,32,256] [--keys 500] [--kill-fraction 0.1]`

Every node is a `Host` listening on 127.0.0.1 (TCP + Noise + yamux) with a `DHTNode` on top, all
in this process's event loop, so a figure here includes the cost of serving every other node.
Each configuration:

1. creates the swarm: the first node alone, then the others `--join-concurrency` at a time, each
   joining through `--bootstrap` random nodes already in (their addresses given to its host);
2. measures one DHT ping between random pairs (the floor under every latency below);
3. stores `--keys` keys one at a time, each from a random node, then gets each from a random other
   node, then gets each with `latest=True` (p50/p90 of one operation, in ms);
4. runs the same keys again `--concurrency` at a time (new values) for stores and gets per second;
5. reads memory: RSS growth of the process since before the swarm, divided by the node count.

One process holds both ends of every connection, so a 256-node swarm would need up to 2 x 256 x 255
file descriptors; hosts close connections idle for `--idle-timeout` seconds (10), as a connection
manager would, and the soft RLIMIT_NOFILE is raised to the hard one.

The "killed" variant stops `--kill-fraction` of the nodes between the stores and the gets, with
no warning to anyone, and then runs its gets `--kill-concurrency` at a time (each still timed on
its own): most of them wait out a timeout, and one at a time would take half an hour. `--kill-mode freeze` (default, the harsher one) makes them go silent like a
machine that lost power or a network cut: their sockets stay open, they read nothing, and new
dials to them hang, so callers only learn through their timeouts. `--kill-mode crash` is a
killed process: every socket is reset at once, so callers fail fast. Gets are then asked only
of survivors; a get succeeds when it returns the value last stored.

There is no same-run baseline for a DHT (hivemind cannot run here), so hivemind 1.1.12's figures
measured on this machine are printed as reference rows.
"""

import argparse
import asyncio
import gc
import os
import random
import resource
import statistics
import sys
import time
import tracemalloc
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil

from plexus.dht.node import DHTNode
from plexus.dht.p2p_transport import HostDHTTransport
from plexus.p2p.host import Host
from plexus.utils.timing import get_dht_time

LISTEN = ("/ip4/127.0.0.1/tcp/0",)
TTL = 600.0

# hivemind 1.1.12, 32 nodes, on this machine (published in the issue; not re-measured here)
HIVEMIND_32 = {
    "config": "hivemind 1.1.12 (reference)",
    "n": 32,
    "swarm_s": 14.0,
    "mb_per_node": 2.9e3 / 32,
    "store": (24.5, None),
    "get_latest": (21.0, None),
}


@dataclass
class Peer:
    host: Host
    node: DHTNode
    alive: bool = True


@dataclass
class Result:
    config: str
    n: int
    swarm_s: float = 0.0
    mb_per_node: float = 0.0
    traced_mb_per_node: float | None = None
    ping: list[float] = field(default_factory=list)
    store: list[float] = field(default_factory=list)
    get: list[float] = field(default_factory=list)
    get_latest: list[float] = field(default_factory=list)
    ok: dict[str, list[bool]] = field(default_factory=lambda: {"store": [], "get": [], "get_latest": []})
    store_ops: float = 0.0
    get_ops: float = 0.0
    killed: int = 0


# --- the swarm --------------------------------------------------------------------------------


async def start_peer(bootstrap: list[Peer], node_options: dict, idle_timeout: float) -> Peer:
    host = await Host(host_maddrs=LISTEN, idle_timeout=idle_timeout).start()
    try:
        for peer in bootstrap:
            host.add_addrs(peer.host.peer_id, peer.host.get_listen_maddrs())
        node = await DHTNode.create(
            initial_peers=[peer.host.peer_id for peer in bootstrap],
            rpc=HostDHTTransport(host),
            **node_options,
        )
    except BaseException:
        await host.shutdown()
        raise
    return Peer(host, node)


async def create_swarm(n: int, args) -> list[Peer]:
    """The first node alone, then the rest joining through random nodes already in the swarm."""
    options = {"wait_timeout": args.wait_timeout}
    peers = [await start_peer([], options, args.idle_timeout)]
    slots = asyncio.Semaphore(args.join_concurrency)

    async def join() -> None:
        async with slots:
            bootstrap = random.sample(peers, min(args.bootstrap, len(peers)))
            peers.append(await start_peer(bootstrap, options, args.idle_timeout))

    await asyncio.gather(*(join() for _ in range(n - 1)))
    return peers


async def kill(peer: Peer, mode: str) -> None:
    """Take a peer out with no goodbye (see the module docstring for the two modes)."""
    peer.alive = False
    loop = asyncio.get_running_loop()
    connections = [c for cs in peer.host._connections.values() for c in cs]
    if mode == "crash":  # the OS resets every socket of a killed process
        for server in peer.host._servers:
            server.close()
        for connection in connections:
            connection.abort("benchmark: crashed")
        await peer.node.shutdown()
        return
    # freeze: stop reading every socket and stop accepting; the kernel still completes new TCP
    # handshakes into the backlog, so dialers connect and then wait for a Noise answer that never comes
    peer.host._running = False
    for server in peer.host._servers:
        for sock in server.sockets:
            loop.remove_reader(sock.fileno())
    for connection in connections:
        if connection._transport is not None:
            connection._transport.pause_reading()
    # the node's own work stops; streams it is serving just hang (cancelling them would send resets),
    # and the host's idle sweep stops too, since it would close connections with a goodbye
    tasks = list(peer.node._tasks) + [
        task for task in peer.host._tasks if task.get_coro().__name__ == "_close_idle_connections"
    ]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def shutdown_swarm(peers: list[Peer]) -> None:
    for peer in peers:
        if peer.alive:
            await peer.node.shutdown()
        for connection in [c for cs in peer.host._connections.values() for c in cs]:
            connection.abort("benchmark over")
        peer.host._running = True
        await peer.host.shutdown()


# --- the workload -----------------------------------------------------------------------------


async def timed(coroutine) -> tuple[float, object]:
    started = time.perf_counter()
    try:
        result = await coroutine
    except Exception as error:  # a failed operation counts as a failure, not a crash of the run
        result = error
    return (time.perf_counter() - started) * 1e3, result


def other_than(peers: list[Peer], exclude: Peer | None) -> Peer:
    alive = [peer for peer in peers if peer.alive and peer is not exclude]
    return random.choice(alive or [exclude])


def value_ok(found, expected) -> bool:
    return found is not None and not isinstance(found, Exception) and found.value == expected


async def run_config(config: str, n: int, kill_fraction: float, args) -> Result:
    result = Result(config, n)
    process = psutil.Process()
    gc.collect()
    rss_before = process.memory_info().rss
    if args.tracemalloc:
        tracemalloc.start()
    started = time.perf_counter()
    peers = await create_swarm(n, args)
    result.swarm_s = time.perf_counter() - started
    try:
        # a DHT ping between random pairs: one RPC over an existing or new connection
        for _ in range(args.pings if n > 1 else 0):
            a, b = random.sample(peers, 2)
            ms, _ = await timed(a.node.call_ping(b.host.peer_id))
            result.ping.append(ms)

        keys = [f"bench-key-{i}" for i in range(args.keys)]
        stored_by: dict[str, Peer] = {}
        latest: dict[str, str] = {}
        for i, key in enumerate(keys):
            peer = random.choice(peers)
            value = f"value-{i}-0"
            ms, ok = await timed(peer.node.store(key, value, get_dht_time() + TTL))
            result.store.append(ms)
            result.ok["store"].append(ok is True)
            stored_by[key], latest[key] = peer, value

        if kill_fraction > 0:
            victims = random.sample(peers, max(1, round(kill_fraction * n)))
            for victim in victims:
                await kill(victim, args.kill_mode)
            result.killed = len(victims)

        # with frozen peers most lookups wait out a timeout, so they run a few at a time to end in minutes
        in_flight = asyncio.Semaphore(args.kill_concurrency if kill_fraction > 0 else 1)
        for latest_flag, name in ((False, "get"), (True, "get_latest")):

            async def get_timed(key: str, latest_flag=latest_flag, name=name) -> None:
                async with in_flight:
                    peer = other_than(peers, stored_by[key])
                    ms, found = await timed(peer.node.get(key, latest=latest_flag))
                getattr(result, name).append(ms)
                result.ok[name].append(value_ok(found, latest[key]))

            await asyncio.gather(*(get_timed(key) for key in keys))

        # throughput: the same keys with newer values, `concurrency` operations in flight
        slots = asyncio.Semaphore(args.concurrency)

        async def store_one(i: int, key: str):
            async with slots:
                value = f"value-{i}-1"
                ok = await peers_alive_choice(peers).node.store(key, value, get_dht_time() + TTL)
                if ok:
                    latest[key] = value
                return ok

        async def get_one(key: str):
            async with slots:
                return await peers_alive_choice(peers).node.get(key)

        started = time.perf_counter()
        stored = await asyncio.gather(
            *(store_one(i, key) for i, key in enumerate(keys)), return_exceptions=True
        )
        result.store_ops = len(keys) / (time.perf_counter() - started)
        started = time.perf_counter()
        await asyncio.gather(*(get_one(key) for key in keys), return_exceptions=True)
        result.get_ops = len(keys) / (time.perf_counter() - started)
        result.ok["store"].extend(ok is True for ok in stored)

        gc.collect()
        result.mb_per_node = (process.memory_info().rss - rss_before) / n / 2**20
        if args.tracemalloc:
            result.traced_mb_per_node = tracemalloc.get_traced_memory()[0] / n / 2**20
    finally:
        if args.tracemalloc:
            tracemalloc.stop()
        await shutdown_swarm(peers)
    return result


def peers_alive_choice(peers: list[Peer]) -> Peer:
    return random.choice([peer for peer in peers if peer.alive])


# --- the report -------------------------------------------------------------------------------


def percentiles(samples: list[float]) -> tuple[float | None, float | None]:
    if not samples:
        return None, None
    if len(samples) == 1:
        return samples[0], samples[0]
    deciles = statistics.quantiles(samples, n=10, method="inclusive")
    return statistics.median(samples), deciles[8]


def fmt_pair(pair) -> str:
    p50, p90 = pair
    if p50 is None:
        return "—"
    return f"{p50:.1f} / {p90:.1f}" if p90 is not None else f"{p50:.1f} / —"


def fmt_ok(flags: list[bool]) -> str:
    return f"{100 * sum(flags) / len(flags):.1f}%" if flags else "—"


def print_table(results: list[Result], args) -> None:
    print(
        f"\n{args.keys} keys, one operation at a time for latencies, {args.concurrency} in flight for ops/s; "
        f"127.0.0.1, one event loop; times in ms as p50 / p90"
    )
    print(
        "| configuration | nodes | swarm s | MB/node | ping | store | get | get latest | store ops/s | get ops/s "
        "| store ok | get ok | latest ok |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        mb = f"{r.mb_per_node:.1f}" + (
            f" ({r.traced_mb_per_node:.1f} traced)" if r.traced_mb_per_node else ""
        )
        print(
            f"| {r.config} | {r.n} | {r.swarm_s:.2f} | {mb} | {fmt_pair(percentiles(r.ping))} "
            f"| {fmt_pair(percentiles(r.store))} | {fmt_pair(percentiles(r.get))} "
            f"| {fmt_pair(percentiles(r.get_latest))} | {r.store_ops:,.0f} | {r.get_ops:,.0f} "
            f"| {fmt_ok(r.ok['store'])} | {fmt_ok(r.ok['get'])} | {fmt_ok(r.ok['get_latest'])} |"
        )
    h = HIVEMIND_32
    print(
        f"| {h['config']} | {h['n']} | {h['swarm_s']:.0f} | {h['mb_per_node']:.0f} | — | {fmt_pair(h['store'])} "
        f"| — | {fmt_pair(h['get_latest'])} | — | — | — | — | — |"
    )
    ours = next((r for r in results if r.n == 32 and not r.killed), None)
    if ours is not None:
        store_p50, latest_p50 = percentiles(ours.store)[0], percentiles(ours.get_latest)[0]
        print(
            f"\nat 32 nodes, hivemind / plexus: store p50 x{h['store'][0] / store_p50:.1f}, "
            f"get(latest) p50 x{h['get_latest'][0] / latest_p50:.1f}, swarm creation x{h['swarm_s'] / ours.swarm_s:.1f}, "
            f"memory per node x{h['mb_per_node'] / max(ours.mb_per_node, 0.01):.1f}"
        )


async def run(args) -> None:
    results = []
    for n in args.sizes:
        results.append(await run_config(f"{n} nodes", n, 0.0, args))
        print(f"done: {n} nodes in {results[-1].swarm_s:.1f} s swarm", file=sys.stderr, flush=True)
    if args.kill_fraction > 0 and args.kill_size:
        config = (
            f"{args.kill_size} nodes, {args.kill_fraction:.0%} killed ({args.kill_mode}; "
            f"gets {args.kill_concurrency} in flight)"
        )
        results.append(await run_config(config, args.kill_size, args.kill_fraction, args))
    print_table(results, args)


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sizes = lambda text: [int(part) for part in text.split(",") if part]  # noqa: E731
    parser.add_argument("--sizes", type=sizes, default=[2, 8, 32, 256], help="swarm sizes, comma-separated")
    parser.add_argument("--keys", type=int, default=500, help="keys stored and read per configuration")
    parser.add_argument(
        "--kill-fraction", type=float, default=0.1, help="share of nodes killed; 0 skips the variant"
    )
    parser.add_argument(
        "--kill-size", type=int, default=256, help="swarm size of the variant with killed nodes"
    )
    parser.add_argument("--kill-mode", choices=("freeze", "crash"), default="freeze")
    parser.add_argument("--kill-concurrency", type=int, default=16, help="gets in flight after the kill")
    parser.add_argument("--bootstrap", type=int, default=3, help="initial peers of each joining node")
    parser.add_argument("--join-concurrency", type=int, default=16, help="nodes joining at once")
    parser.add_argument("--concurrency", type=int, default=32, help="operations in flight for ops/s")
    parser.add_argument("--pings", type=int, default=100, help="DHT pings between random pairs")
    parser.add_argument("--wait-timeout", type=float, default=3.0, help="DHTNode's per-request timeout, s")
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=10.0,
        help="hosts close connections idle this long, s (one process holds both ends of every "
        "connection: 256 nodes would otherwise run out of file descriptors)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tracemalloc", action="store_true", help="also report traced Python memory (slower)"
    )
    args = parser.parse_args()
    random.seed(args.seed)
    raise_fd_limit()
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
