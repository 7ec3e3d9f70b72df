"""WAN benchmark: Plexus on the WAN lab's emulated internet links, next to plain TCP on the same links.

Run (as root): `.venv/bin/python benchmarks/wan.py [--rows lab forwarder setup dht bulk allreduce loss]
[--dht-nodes 32] [--allreduce-peers 8] [--allreduce-mib 100] [--quick]`

Each row builds its own lab (plexus/testing/wan), runs Plexus peers in the lab's namespaces (this
file with `--role`, one process per peer) and, in the same lab and run, plain TCP with the lab's
probe (plexus/testing/wan/probe.py) or gloo. Every figure is printed next to its lower bound from
the configured links and next to plain TCP, as a ratio where that helps.

  lab        the links themselves: plain TCP/UDP on each named profile (configured vs measured)
  forwarder  the lab's own ceiling: one TCP stream through the forwarder with no delay and no rate
             limit, with and without offloads, and the latency the lab adds at zero delay
  setup      a fresh connection to the first RPC answer, in RTTs, on 150 ms (plain TCP: connect + echo)
  dht        32 nodes on home links (30 ms): join, store, then get(latest=True) p50/p99 in RTTs,
             one operation at a time (first with cold connections, then again)
  bulk       one stream's steady throughput on 1 Gbit/s x 150 ms, Plexus and plain TCP
  allreduce  8 peers on 100 Mbit/s x 30 ms: DecentralizedAverager rounds and gloo's all_reduce
  loss       links of 100 Mbit/s x 30 ms that each lose 1% of their packets (about 2% a path):
             set-up, one stream (bound: CUBIC at that loss) and an 8-node DHT, all to completion

The machine's load average is printed with each row: figures measured on a busy machine are
marked "(load X)", as the lab's processes then wait for cores and every wait shows up as delay.
"""

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from plexus.testing.netns import PeerProcess, emit, missing_prerequisite
from plexus.testing.wan import PROFILES, LinkProfile, WanLab
from plexus.testing.wan.measure import HEADER, MeasureOptions, PathProber, format_row, steady_rate
from plexus.testing.wan.profiles import format_rate

ECHO, SINK = "/bench/echo/1.0.0", "/bench/sink/1.0.0"
PORT = 4001
BIN = 0.1
CHUNK = 1 << 20
TIMEOUT = 600.0
DHT_JOIN_BATCH = 4
DHT_WIDE_WORKERS = 16  # requests in flight per lookup in the last get round (the DHT's default is 4)
HOME_100 = LinkProfile(down=100e6, up=100e6, rtt=0.030)  # the all-reduce's symmetric 100 Mbit/s links
LOSSY = HOME_100.replace(loss=0.01)  # a path between two such peers loses 1 - 0.99**2, about 2%


def load() -> str:
    return f"(load {os.getloadavg()[0]:.1f})"


def table(title: str, header: str, rows: list[str]) -> None:
    print(f"\n{title} {load()}\n{header}\n|" + "---|" * (header.count("|") - 1))
    for row in rows:
        print(row, flush=True)


def bench_script(*args: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), *args]


def peer(lab: WanLab, name: str, *args: str, env: dict | None = None) -> PeerProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    return lab.peer(name, bench_script("--role", *args), env=env)


def rtts(samples: list[float], rtt: float) -> str:
    ordered = sorted(samples)
    p50, p99 = statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return f"{p50 / rtt:.2f} / {p99 / rtt:.2f}"


# --- the rows ---------------------------------------------------------------------------------------


def row_lab(args) -> None:
    """Plain TCP/UDP on each named profile, and on mixed and NATed paths."""
    peers = {
        "dc1": "datacenter",
        "dc2": "datacenter",
        "cc1": "cross-continent",
        "cc2": "cross-continent",
        "home1": "home",
        "home2": "home",
        "laptop": "notebook",
    }
    pairs = [("dc1", "dc2"), ("cc1", "cc2"), ("home1", "home2"), ("laptop", "home1"), ("home1", "laptop")]
    rows = []
    with WanLab(peers, seed=1) as lab:
        prober = PathProber(
            lab,
            MeasureOptions(
                rtt_count=20, udp_count=4000, udp_interval=0.005, tcp_seconds=12 if not args.quick else 5
            ),
        )
        for a, b in pairs:
            rows.append(format_row(prober.measure(a, b)))
        counters = {key: value for key, value in lab.forwarder_stats().items() if key != "paths"}
        rows.append(f"| forwarder | {json.dumps(counters)} | | | | | |")
        prober.close()
    table("The lab's links, plain TCP/UDP (MTU 1500, offloads, CUBIC)", HEADER, rows)


def row_forwarder(args) -> None:
    """One TCP stream with no delay and no rate limit: what the forwarder itself can move."""
    unlimited = LinkProfile(down=100e9, up=100e9, rtt=0.0)
    rows = []
    for offload, mtu in ((True, 1500), (False, 1500), (False, 9000), (False, 65000)):
        with WanLab({"a": unlimited, "b": unlimited}, offload=offload, mtu=mtu) as lab:
            prober = PathProber(lab, MeasureOptions(rtt_count=200, udp_count=0, tcp_seconds=5, warmup=1.0))
            before = lab.forwarder_stats()
            m = prober.measure("a", "b")
            after = lab.forwarder_stats()
            prober.close()
        buffers = (after["received"] - before["received"]) / 5
        segments = sum(n for n, _ in after["paths"].values()) - sum(n for n, _ in before["paths"].values())
        rows.append(
            f"| {'TSO/GRO through the TUN' if offload else 'one packet per read'} | {mtu} | "
            f"{format_rate(m.throughput)} | {buffers:,.0f} | {segments / 5:,.0f} | "
            f"{m.rtt * 1e6:.0f} | {after['tun_dropped']} |"
        )
    table(
        "The forwarder's ceiling: one TCP stream, no delay, no rate limit",
        "| forwarder | MTU | TCP throughput | buffers/s (reads) | segments/s | RTT added µs (median) "
        "| dropped by the TUN |",
        rows,
    )


def row_setup(args, profile="cross-continent", links: str = "") -> None:
    """A fresh connection to the first RPC answer, against plain TCP connect + first echo."""
    count = 5 if args.quick else 10
    with WanLab({"a": profile, "b": profile}) as lab:
        rtt = lab.path("a", "b").rtt
        prober = PathProber(lab)
        host = prober.server("b")
        plain = lab.probe("a", "setup", host, "--count", str(count)).wait_for("setup", TIMEOUT)["samples"]
        measured_rtt = prober.measure("a", "b", MeasureOptions(udp_count=0, tcp_seconds=0)).rtt
        server = peer(lab, "b", "server", lab.address("b"))
        maddr = server.wait_for("ready", TIMEOUT)["maddr"]
        plexus = peer(lab, "a", "setup", maddr, str(count)).wait_for("setup", TIMEOUT)
        server.finish()
        prober.close()
    rows = [
        f"| plain TCP: connect | 1 | {rtts([c for c, _ in plain], rtt)} | |",
        f"| plain TCP: connect + first answer | 2 | {rtts([f for _, f in plain], rtt)} | |",
    ]
    for key, what, bound in (
        ("connect", "Plexus: TCP + Noise XX + yamux", 2),
        ("first", "Plexus: connect + first RPC answer", 3),
        ("again", "Plexus: a second RPC on that connection", 1),
    ):
        rows.append(
            f"| {what} | {bound} | {rtts(plexus[key], rtt)} | "
            f"{statistics.median(plexus[key]) / statistics.median([f for _, f in plain]):.2f} |"
        )
    table(
        f"Connection set-up on {links or '1 Gbit/s'} x {rtt * 1e3:.0f} ms (TCP echo RTT measured: "
        f"{measured_rtt * 1e3:.1f} ms), {count} fresh connections",
        "| what | lower bound (RTT) | p50 / p99 (RTT) | x plain TCP connect + answer |",
        rows,
    )


def row_dht(args) -> None:
    """DHT store and get(latest=True) with `--dht-nodes` nodes on home links, one operation at a time."""
    dht_table(args.dht_nodes, "home", "home links")


def dht_table(n: int, profile, links: str) -> None:
    names = [f"n{i}" for i in range(n)]
    with WanLab({name: profile for name in names}, seed=2) as lab:
        rtt = lab.path(names[0], names[1]).rtt
        prober = PathProber(lab, MeasureOptions(rtt_count=20, udp_count=0, tcp_seconds=0))
        measured_rtt = prober.measure(names[1], names[2]).rtt
        prober.close()
        nodes = [peer(lab, name, "dht", lab.address(name), str(i), str(n)) for i, name in enumerate(names)]
        for node in nodes:  # every process imports torch first (seconds of CPU each): not part of joining
            node.wait_for("loaded", TIMEOUT)
        nodes[0].send("join")
        maddr = nodes[0].wait_for("ready", TIMEOUT)["maddr"]
        joins = []
        for start in range(1, n, DHT_JOIN_BATCH):
            batch = nodes[start : start + DHT_JOIN_BATCH]
            for node in batch:
                node.send(f"join {maddr}")
            joins += [node.wait_for("ready", TIMEOUT)["seconds"] for node in batch]
        stores = []
        for node in nodes:
            node.send("store")
            stores.append(node.wait_for("stored", TIMEOUT)["seconds"])
        results = {}
        wide = f"again, {DHT_WIDE_WORKERS} requests in flight"
        for round_name, workers in (("first", 4), ("again", 4), (wide, DHT_WIDE_WORKERS)):
            got = []
            for node in nodes:
                node.events.pop("got", None)
                node.send(f"get {workers}")
                got.append(node.wait_for("got", TIMEOUT))
            results[round_name] = (
                [s for g in got for s in g["seconds"]],
                sum(g["found"] for g in got),
                sum(len(g["seconds"]) for g in got),
            )
        for node in nodes:
            node.finish()
    rows = [
        f"| join (ping + lookup of itself), {DHT_JOIN_BATCH} at a time | 2 | {rtts(joins, rtt)} | |",
        f"| store (5 replicas) | 1 | {rtts(stores, rtt)} | |",
    ]
    for round_name, (seconds, found, total) in results.items():
        rows.append(f"| get(latest=True), {round_name} | 1 | {rtts(seconds, rtt)} | {found} / {total} |")
    table(
        f"DHT, {n} nodes on {links} (RTT {rtt * 1e3:.0f} ms configured, {measured_rtt * 1e3:.1f} ms "
        f"plain TCP); one operation at a time, 8 keys of other nodes per node and round; lookups keep "
        f"4 requests in flight (the default) unless said otherwise",
        "| operation | lower bound (RTT) | p50 / p99 (RTT) | found |",
        rows,
    )


def row_bulk(args, profile="cross-continent", links: str = "") -> None:
    """One stream's throughput on 1 Gbit/s x 150 ms: plain TCP, then Plexus, in one lab."""
    seconds = 6.0 if args.quick else 15.0
    warmup = 4.0
    with WanLab({"a": profile, "b": profile}) as lab:
        path = lab.path("a", "b")
        prober = PathProber(lab, MeasureOptions(rtt_count=5, udp_count=0, tcp_seconds=seconds, warmup=warmup))
        plain = prober.measure("a", "b").throughput
        prober.close()
        server = peer(lab, "b", "server", lab.address("b"))
        maddr = server.wait_for("ready", TIMEOUT)["maddr"]
        result = peer(lab, "a", "bulk", maddr, str(seconds)).wait_for("bulk", TIMEOUT)
        plexus = steady_rate(result["bins"], BIN, warmup)
        server.finish()
    bound = path.tcp_bound
    rows = [
        f"| plain TCP | {format_rate(plain)} | {plain / bound:.2f} | 1.00 |",
        f"| Plexus stream (Noise + yamux) | {format_rate(plexus)} | {plexus / bound:.2f} | "
        f"{plexus / plain:.2f} |",
    ]
    table(
        f"One stream on {format_rate(path.rate)} x {path.rtt * 1e3:.0f} ms{links} (BDP "
        f"{path.bdp / 2**20:.1f} MiB), steady rate after {warmup:.0f} s of {seconds:.0f} s; bound "
        f"{format_rate(bound)} (the link's goodput{', or CUBIC at this loss' if path.loss else ''})",
        "| sender | throughput | x link goodput | x plain TCP |",
        rows,
    )


def row_allreduce(args) -> None:
    """DecentralizedAverager and gloo all_reduce, 8 peers on 100 Mbit/s x 30 ms."""
    n, mib = args.allreduce_peers, args.allreduce_mib
    names = [f"p{i}" for i in range(n)]
    rounds = 1 if args.quick else 2
    with WanLab({name: HOME_100 for name in names}) as lab:
        master = lab.address(names[0])
        env = {"GLOO_SOCKET_IFNAME": "eth0"}
        args_of = [str(n), str(mib), master]
        first = peer(lab, names[0], "allreduce", lab.address(names[0]), "0", *args_of, env=env)
        maddr = first.wait_for("dht", TIMEOUT)["maddr"]  # then it waits for the others in gloo's rendezvous
        peers = [first] + [
            peer(lab, name, "allreduce", lab.address(name), str(i), *args_of, maddr, env=env)
            for i, name in enumerate(names[1:], start=1)
        ]
        for node in peers:
            node.wait_for("ready", TIMEOUT)
        times = {"plexus": [], "gloo": []}
        for round_index in range(rounds):
            for kind in ("plexus", "gloo"):
                event = f"{kind}{round_index}"
                for node in peers:
                    node.send(kind)
                reports = [node.wait_for(event, TIMEOUT) for node in peers]
                times[kind].append(max(report["seconds"] for report in reports))
                wrong = [node for node, report in zip(peers, reports) if not report["ok"]]
                if wrong:  # a round that averaged only part of the group: no figure, the log says why
                    times[kind][-1] = float("nan")
                    print(
                        f"{kind} round {round_index}: {len(wrong)} peers did not get the full average; "
                        f"{wrong[0].name}'s log:\n{wrong[0].log}",
                        file=sys.stderr,
                    )
        for node in peers:
            node.finish()
    size = mib * 2**20
    bound = 2 * size * (n - 1) / n * 8 / HOME_100.up
    plexus, gloo = (min((t for t in times[kind] if not math.isnan(t)), default=math.nan) for kind in times)
    rows = [
        f"| gloo all_reduce (ring, plain TCP) | {gloo:.1f} | {bound / gloo:.2f} | 1.00 |",
        f"| DecentralizedAverager (butterfly, Noise + yamux) | {plexus:.1f} | {bound / plexus:.2f} | "
        f"{gloo / plexus:.2f} |",
    ]
    table(
        f"All-reduce, {n} peers x {mib} MiB float32 on {format_rate(HOME_100.up)} x "
        f"{HOME_100.rtt * 1e3:.0f} ms; best of {rounds} round(s); bound {bound:.1f} s (each peer sends "
        f"and receives 2 (n-1)/n of the tensor)",
        "| all-reduce | s/round | x bound (speed) | x gloo (speed) |",
        rows,
    )


def row_loss(args) -> None:
    """Every access link loses LOSSY_LINK of its packets each way (the forwarder drops them at
    random): RPCs on fresh connections, one stream, and the DHT must all still finish."""
    rate = f"{format_rate(LOSSY.down)}, {LOSSY.loss:.0%} loss on each link"
    row_setup(args, LOSSY, rate)
    row_bulk(args, LOSSY, f", {LOSSY.loss:.0%} loss on each link")
    dht_table(8, LOSSY, f"100 Mbit/s links losing {LOSSY.loss:.0%} each way")


ROWS = {
    "lab": row_lab,
    "forwarder": row_forwarder,
    "setup": row_setup,
    "dht": row_dht,
    "bulk": row_bulk,
    "allreduce": row_allreduce,
    "loss": row_loss,
}


# --- what runs inside the namespaces -------------------------------------------------------------------


def stdin_lines():
    """The driver's commands, one per line, until it closes our stdin."""
    for line in sys.stdin:
        yield line.strip()


async def role_server(ip: str) -> None:
    from plexus.p2p import rpc
    from plexus.p2p.host import Host

    async def echo(request: bytes, context) -> bytes:
        return request

    async def sink(stream) -> None:
        bins, first = [], None
        while data := await stream.read():
            now = time.monotonic()
            first = now if first is None else first
            index = int((now - first) / BIN)
            bins.extend([0] * (index + 1 - len(bins)))
            bins[index] += len(data)
        await stream.write(json.dumps(bins).encode())
        await stream.close()

    async with Host(host_maddrs=(f"/ip4/{ip}/tcp/{PORT}",)) as host:
        rpc.add_handler(host, ECHO, echo)
        host.set_stream_handler(SINK, sink)
        emit("ready", maddr=str(host.get_visible_maddrs()[0]))
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


async def role_setup(maddr: str, count: int) -> None:
    from plexus.p2p import rpc
    from plexus.p2p.host import Host
    from plexus.p2p.identity import PeerID

    peer_id = PeerID.from_string(maddr.rsplit("/", 1)[1])
    loop = asyncio.get_running_loop()
    samples = {"connect": [], "first": [], "again": []}
    for _ in range(count):
        async with Host(host_maddrs=()) as host:
            started = loop.time()
            await host.connect(maddr)
            connected = loop.time()
            await rpc.call(host, peer_id, ECHO, b"x" * 32, timeout=TIMEOUT)
            answered = loop.time()
            await rpc.call(host, peer_id, ECHO, b"x" * 32, timeout=TIMEOUT)
            samples["connect"].append(connected - started)
            samples["first"].append(answered - started)
            samples["again"].append(loop.time() - answered)
    emit("setup", **samples)


async def role_bulk(maddr: str, seconds: float) -> None:
    from plexus.p2p.host import Host

    async with Host(host_maddrs=()) as host:
        stream = await host.new_stream(maddr, SINK)
        chunk = memoryview(os.urandom(CHUNK))
        started = time.monotonic()
        while time.monotonic() - started < seconds:
            await stream.write(chunk)
        await stream.close()
        reply = b""
        while data := await stream.read():
            reply += data
    emit("bulk", bins=json.loads(reply))


def role_dht(ip: str, index: int, n: int) -> None:
    import random

    from plexus.dht.dht import DHT
    from plexus.utils.timing import get_dht_time

    emit("loaded")
    dht = None
    for command in stdin_lines():
        if command.startswith("join"):
            started = time.monotonic()
            dht = DHT(initial_peers=command.split()[1:], host_maddrs=[f"/ip4/{ip}/tcp/{PORT}"], start=True)
            emit("ready", maddr=str(dht.get_visible_maddrs()[0]), seconds=time.monotonic() - started)
        elif command == "store":
            started = time.monotonic()
            ok = dht.store(f"wan-key-{index}", {"from": index}, get_dht_time() + 600)
            emit("stored", seconds=time.monotonic() - started, ok=bool(ok))
        elif command.startswith("get"):
            workers = int(command.split()[1])
            others = random.Random(index).sample([i for i in range(n) if i != index], min(8, n - 1))
            seconds, found = [], 0
            for other in others:
                started = time.monotonic()
                key = f"wan-key-{other}"
                value = dht.run_coroutine(lambda _, node: node.get(key, latest=True, num_workers=workers))
                seconds.append(time.monotonic() - started)
                found += value is not None and value.value == {"from": other}
            emit("got", seconds=seconds, found=found)
    if dht is not None:
        dht.shutdown()


def role_allreduce(ip: str, index: int, n: int, mib: int, master: str, initial: list[str]) -> None:
    import torch
    import torch.distributed as dist

    from plexus.averaging.averager import DecentralizedAverager
    from plexus.dht.dht import DHT

    torch.set_num_threads(1)
    dht = DHT(initial_peers=initial, host_maddrs=[f"/ip4/{ip}/tcp/{PORT}"], start=True)
    emit("dht", maddr=str(dht.get_visible_maddrs()[0]))
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{PORT + 1}", rank=index, world_size=n)
    tensor = torch.full((mib * 2**18,), float(index))
    expected = (n - 1) / 2
    averager = DecentralizedAverager(
        [tensor],
        dht,
        prefix="wanbench",
        target_group_size=n,
        min_group_size=n,
        min_matchmaking_time=5.0,
        request_timeout=5.0,
        start=True,
    )
    emit("ready")
    rounds = {"plexus": 0, "gloo": 0}
    for command in stdin_lines():
        if command not in rounds:
            continue
        with torch.no_grad():
            tensor.fill_(float(index))
        started = time.monotonic()
        if command == "plexus":
            with averager.get_tensors() as (averaged,):
                averaged.fill_(float(index))
            averager.step(timeout=TIMEOUT)
            with averager.get_tensors() as (averaged,):
                ok = abs(float(averaged[:: max(1, averaged.numel() // 64)].mean()) - expected) < 1e-3
        else:
            dist.all_reduce(tensor)
            tensor /= n
            ok = abs(float(tensor[:: max(1, tensor.numel() // 64)].mean()) - expected) < 1e-3
        emit(f"{command}{rounds[command]}", seconds=time.monotonic() - started, ok=ok)
        rounds[command] += 1
    averager.shutdown()
    dist.destroy_process_group()
    dht.shutdown()
    os._exit(0)  # torch's teardown takes seconds and does nothing we need


def run_role(argv: list[str]) -> None:
    role, *rest = argv
    if role == "server":
        asyncio.run(role_server(rest[0]))
    elif role == "setup":
        asyncio.run(role_setup(rest[0], int(rest[1])))
    elif role == "bulk":
        asyncio.run(role_bulk(rest[0], float(rest[1])))
    elif role == "dht":
        role_dht(rest[0], int(rest[1]), int(rest[2]))
    elif role == "allreduce":
        role_allreduce(rest[0], int(rest[1]), int(rest[2]), int(rest[3]), rest[4], rest[5:])
    else:
        raise SystemExit(f"unknown role {role!r}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--role":
        run_role(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--dht-nodes", type=int, default=32)
    parser.add_argument("--allreduce-peers", type=int, default=8)
    parser.add_argument("--allreduce-mib", type=int, default=100, help="MiB of float32 per peer")
    parser.add_argument("--quick", action="store_true", help="shorter streams, fewer rounds")
    args = parser.parse_args()
    reason = missing_prerequisite(("ip", "tc", "nft"))
    if reason is not None:
        raise SystemExit(f"the WAN lab cannot run here: {reason}")
    profiles = [
        f"{name} {format_rate(p.down)}/{format_rate(p.up)} {p.rtt * 1e3:g} ms"
        + (f" {p.loss:.1%} loss" if p.loss else "")
        + (" NAT" if p.nat else "")
        for name, p in PROFILES.items()
    ]
    print(f"{os.cpu_count()} CPUs; profiles: " + ", ".join(profiles))
    for name in args.rows:
        ROWS[name](args)


if __name__ == "__main__":
    main()
