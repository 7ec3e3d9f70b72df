"""Abuse benchmark: each attack against one node while an honest client measures what it still gets.

Run: `.venv/bin/python benchmarks/abuse.py [--attacks conn-flood,ping-flood,key-flood,subkey-stuffing,sybils,moe-flood]
[--seconds 15] [--honest 8] [--sybils 200]`

Every attack gets a fresh victim in a process of its own (so its memory is its own), an attacker in
another process, and the honest side in this one, all on 127.0.0.1:

- DHT attacks: the victim is a `DHTNode` on a `Host`, with default options; `--honest - 1` more
  honest DHT nodes and the honest client (client mode, joined through the victim) run here. The
  client loops: store a new key, read the previous one, store its entry under a shared dictionary
  key (one whose nearest honest node is the victim), read that dictionary; each operation is timed
  on its own and succeeds when it returns what was stored. Between rounds it pings the victim (a
  DHT ping: the victim's own responsiveness).
- `moe-flood`: the victim is an expert `Server` with one `ffn` expert (`--hidden`, `--max-batch`);
  the honest client calls forward with `--honest-batch` rows, one call at a time.

Each attack runs in three steps in the same run: the honest loop alone for `--seconds` (the
baseline), then the attacker starts and, once it is in full swing, the honest loop again for
`--seconds` (under attack). The table gives the honest operations' p50/p99 latency and success
rate without and with the attack, the victim's ping latency, and the victim's resident memory at
the end of the baseline and at its peak under attack.

The attacks (whatever limits the code under test has, they meet them; nothing here is tuned to it):
- conn-flood: `--silent-connections` TCP connections that never say a word, plus `--stream-hosts`
  libp2p peers each opening `--streams-per-host` DHT streams that never send their request;
  whatever the victim closes is opened again.
- ping-flood: `--flood-peers` peers, each with 64 DHT pings in flight at all times.
- key-flood: 100,000 small keys stored on the victim, 1,024 per request, 8 requests in flight.
- subkey-stuffing: 100,000 sub-keys stored under the honest client's shared dictionary key.
- sybils: `--sybils` DHT nodes in the attacker's process join through the victim and look around
  until they fill the honest routing tables; then the process is frozen (SIGSTOP), as a machine that
  lost power or a Sybil operator that goes silent at once. The notes give the victim's routing table
  before the freeze and how it shrank.
- moe-flood: one peer keeps 200 maximum-size forward calls in flight (`--max-batch` rows each).

The machines here are small and shared: the attacker, the victim and the honest side share its
cores, so the attacker's own CPU is part of every attack. Compare ratios within a run.
"""

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil  # noqa: E402

from plexus.dht.messages import PingRequest, StoreItem, StoreRequest  # noqa: E402
from plexus.dht.node import DHTNode  # noqa: E402
from plexus.dht.p2p_transport import DHT_PROTOCOL, HostDHTTransport  # noqa: E402
from plexus.dht.routing import DHTID  # noqa: E402
from plexus.p2p import rpc  # noqa: E402
from plexus.p2p.host import Host  # noqa: E402
from plexus.p2p.multiaddr import Multiaddr, parse_host_port  # noqa: E402
from plexus.utils.serializer import MSGPackSerializer  # noqa: E402
from plexus.utils.timing import get_dht_time  # noqa: E402

LISTEN = ("/ip4/127.0.0.1/tcp/0",)
ATTACKS = ("conn-flood", "ping-flood", "key-flood", "subkey-stuffing", "sybils", "moe-flood")
EXPERT_UID = "ffn.0"
FLOOD_KEYS = 100_000
OP_TIMEOUT = 10.0  # an honest operation that takes longer counts as failed


def say(**fields) -> None:
    """One line of JSON on stdout: how a role process talks to the benchmark."""
    print(json.dumps(fields), flush=True)


# --- the victims (separate processes) ------------------------------------------------------------

async def dht_victim(args) -> None:
    host = await Host(host_maddrs=LISTEN).start()
    node = await DHTNode.create(rpc=HostDHTTransport(host))
    say(maddr=str(host.get_listen_maddrs()[0].with_peer_id(host.peer_id)), node_id=int(node.node_id))
    while True:
        say(table=len(node.routing_table), keys=len(node.storage))
        await asyncio.sleep(0.25)  # a status report every quarter second


async def moe_victim(args) -> None:
    import torch

    from plexus.moe import ModuleBackend, Server
    from plexus.moe.server.layers import name_to_block, name_to_input

    torch.set_num_threads(args.threads)
    host = await Host(host_maddrs=LISTEN).start()
    module = name_to_block["ffn"](args.hidden)
    sample = name_to_input["ffn"](args.max_batch, args.hidden)
    from plexus.moe import BatchTensorDescriptor
    backend = ModuleBackend(EXPERT_UID, module, args_schema=(BatchTensorDescriptor.from_tensor(sample),),
                            max_batch_size=args.max_batch)
    server = Server(host, {EXPERT_UID: backend})
    await asyncio.to_thread(server.start)
    say(maddr=str(host.get_listen_maddrs()[0].with_peer_id(host.peer_id)))
    while True:
        await asyncio.sleep(3600)


# --- the attacks (a separate process) --------------------------------------------------------------

async def target_of(args) -> tuple[Multiaddr, object]:
    addr = Multiaddr(args.target)
    return addr, addr.peer_id


async def dialing_host(target: Multiaddr, listen=()) -> Host:
    host = await Host(host_maddrs=listen).start()
    host.add_addrs(target.peer_id, [target.without_peer_id()])
    return host


async def conn_flood(args) -> None:
    target, peer = await target_of(args)
    ip, port, _ = parse_host_port(target.without_peer_id())
    counts = {"sockets": 0, "streams": 0, "closed": 0}

    async def silent_socket() -> None:
        while True:
            try:
                reader, writer = await asyncio.open_connection(ip, port)
            except OSError:
                await asyncio.sleep(0.5)  # the victim refuses for now: try again soon
                continue
            counts["sockets"] += 1
            await reader.read()  # say nothing; wait until the victim closes it
            counts["sockets"] -= 1
            counts["closed"] += 1
            writer.close()

    async def silent_streams(host: Host) -> None:
        async def one() -> None:
            while True:
                try:
                    stream = await host.new_stream(peer, DHT_PROTOCOL, timeout=10)
                except Exception:
                    await asyncio.sleep(0.5)  # refused or reset: try again soon
                    continue
                counts["streams"] += 1
                await stream.read()  # never send the request; wait for the victim to give up on it
                counts["streams"] -= 1
                counts["closed"] += 1

        await asyncio.gather(*(one() for _ in range(args.streams_per_host)))

    hosts = [await dialing_host(target) for _ in range(args.stream_hosts)]
    tasks = [asyncio.ensure_future(silent_socket()) for _ in range(args.silent_connections)]
    tasks += [asyncio.ensure_future(silent_streams(host)) for host in hosts]
    await asyncio.sleep(3)  # let the flood build up before reporting it ready
    say(ready=True, **counts)
    while True:
        await asyncio.sleep(1)
        say(**counts)


async def ping_flood(args) -> None:
    target, peer = await target_of(args)
    sent = [0]

    async def pinger(host: Host) -> None:
        request = PingRequest(None).encode()
        while True:
            try:
                await rpc.call(host, peer, DHT_PROTOCOL, request, timeout=10)
            except Exception:
                await asyncio.sleep(0.01)  # refused: the attacker's pace, then again
            sent[0] += 1

    hosts = [await dialing_host(target) for _ in range(args.flood_peers)]
    tasks = [asyncio.ensure_future(pinger(host)) for host in hosts for _ in range(64)]
    await asyncio.sleep(1)
    say(ready=True, pings=sent[0])
    while True:
        await asyncio.sleep(1)
        say(pings=sent[0])


async def store_flood(args, key_of) -> None:
    """Store FLOOD_KEYS small records on the victim, key_of(i) -> (key, subkey) each."""
    target, peer = await target_of(args)
    host = await dialing_host(target)
    expiration = get_dht_time() + 3600
    value = MSGPackSerializer.dumps(1)
    batches = [range(start, min(start + 1024, FLOOD_KEYS)) for start in range(0, FLOOD_KEYS, 1024)]
    stats = {"sent": 0, "accepted": 0, "failed_requests": 0}
    slots = asyncio.Semaphore(8)

    async def send(batch) -> None:
        async with slots:
            request = StoreRequest(None, tuple(StoreItem(*key_of(i), value, expiration) for i in batch))
            try:
                answer = await rpc.call(host, peer, DHT_PROTOCOL, request.encode(), timeout=30)
                from plexus.dht.messages import StoreResponse, decode_response
                stats["accepted"] += sum(decode_response(answer, StoreResponse).results)
            except Exception:
                stats["failed_requests"] += 1
            stats["sent"] += len(batch)

    flood = asyncio.ensure_future(asyncio.gather(*(send(batch) for batch in batches)))
    await asyncio.sleep(0.5)
    say(ready=True, **stats)
    while True:
        await asyncio.sleep(1)
        say(done=flood.done(), **stats)


async def sybils(args) -> None:
    target, peer = await target_of(args)
    nodes, slots = [], asyncio.Semaphore(16)

    async def join() -> None:
        async with slots:
            host = await dialing_host(target, LISTEN)
            nodes.append(await DHTNode.create(rpc=HostDHTTransport(host), initial_peers=[peer],
                                              cache_refresh_before_expiry=0))

    await asyncio.gather(*(join() for _ in range(args.sybils)), return_exceptions=True)
    for _ in range(2):  # look around, so that every honest node meets (and answers) them
        await asyncio.gather(*(node.find_nearest_nodes([DHTID.generate()]) for node in nodes),
                             return_exceptions=True)
    say(ready=True, joined=len(nodes))
    while True:
        await asyncio.sleep(3600)


async def moe_flood(args) -> None:
    import torch

    from plexus.moe import ExpertInfo
    from plexus.moe.client import expert_forward, get_expert_schema

    target, peer = await target_of(args)
    host = await dialing_host(target)
    expert = ExpertInfo(EXPERT_UID, peer)
    schema = await get_expert_schema(host, expert)
    stats = {"served": 0, "refused": 0}

    async def flood_one() -> None:
        inputs = [torch.randn(args.max_batch, args.hidden)]
        while True:
            try:
                await expert_forward(host, expert, schema, inputs, timeout=60)
                stats["served"] += 1
            except Exception:
                stats["refused"] += 1
                await asyncio.sleep(0.01)  # the attacker's pace after a refusal

    tasks = [asyncio.ensure_future(flood_one()) for _ in range(200)]
    await asyncio.sleep(2)
    say(ready=True, **stats)
    while True:
        await asyncio.sleep(1)
        say(**stats)


def attacker(args):
    if args.attack == "key-flood":
        return store_flood(args, lambda i: (DHTID.generate(f"flood-{i}"), None))
    if args.attack == "subkey-stuffing":
        key = DHTID.generate(args.shared_key)
        return store_flood(args, lambda i: (key, MSGPackSerializer.dumps(f"stuffing-{i}")))
    return {"conn-flood": conn_flood, "ping-flood": ping_flood, "sybils": sybils, "moe-flood": moe_flood}[args.attack](args)


# --- the honest side (this process) ----------------------------------------------------------------

class Role:
    """A role process (victim or attacker) and the JSON lines it says."""

    def __init__(self, process: asyncio.subprocess.Process):
        self.process, self.lines = process, []
        self.psutil = psutil.Process(process.pid)
        self.first = asyncio.get_running_loop().create_future()
        self.ready = asyncio.get_running_loop().create_future()
        self._reader = asyncio.ensure_future(self._read())

    @classmethod
    async def start(cls, role: str, args, **extra) -> "Role":
        flags = [f"--{name.replace('_', '-')}={value}" for name, value in extra.items()]
        process = await asyncio.create_subprocess_exec(
            sys.executable, os.path.abspath(__file__), f"--role={role}", f"--hidden={args.hidden}",
            f"--max-batch={args.max_batch}", f"--threads={args.threads}", f"--sybils={args.sybils}", *flags,
            stdout=asyncio.subprocess.PIPE)
        return cls(process)

    async def _read(self) -> None:
        while line := await self.process.stdout.readline():
            fields = json.loads(line)
            self.lines.append((time.monotonic(), fields))
            if not self.first.done():
                self.first.set_result(fields)
            if fields.get("ready") and not self.ready.done():
                self.ready.set_result(fields)

    def rss_mb(self) -> float:
        return self.psutil.memory_info().rss / 2**20

    async def stop(self) -> None:
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
            await self.process.wait()
        self._reader.cancel()


class Measured:
    def __init__(self):
        self.latencies, self.ok, self.pings, self.rss = [], [], [], []


async def timed(coroutine) -> tuple[float, object]:
    started = time.perf_counter()
    try:
        result = await asyncio.wait_for(coroutine, OP_TIMEOUT)
    except Exception as error:  # a failed operation counts as a failure, not a crash of the run
        result = error
    return (time.perf_counter() - started) * 1e3, result


async def honest_dht_loop(client: DHTNode, victim_peer, shared_key: str, seconds: float, victim: Role,
                          round_number: list) -> Measured:
    measured, deadline = Measured(), time.monotonic() + seconds
    me = f"honest-{client.peer_id.short()}"
    while time.monotonic() < deadline:
        i = round_number[0] = round_number[0] + 1
        expiration = get_dht_time() + 600
        operations = [
            (client.store(f"key-{i}", i, expiration), lambda found: found is True),
            (client.get(f"key-{i - 1}"), lambda found, i=i: getattr(found, "value", None) == i - 1),
            (client.store(shared_key, i, expiration, subkey=me), lambda found: found is True),
            (client.get(shared_key, latest=True),
             lambda found, i=i: isinstance(getattr(found, "value", None), dict)
             and getattr(found.value.get(me), "value", None) == i),
        ]
        for operation, check in operations:
            ms, found = await timed(operation)
            measured.latencies.append(ms)
            measured.ok.append(not isinstance(found, Exception) and check(found))
        ms, answer = await timed(client.call_ping(victim_peer))
        if not isinstance(answer, Exception):
            measured.pings.append(ms)
        measured.rss.append(victim.rss_mb())
    return measured


async def honest_moe_loop(host: Host, expert, schema, seconds: float, args, victim: Role) -> Measured:
    import torch

    from plexus.moe.client import expert_forward

    measured, deadline = Measured(), time.monotonic() + seconds
    inputs = [torch.randn(args.honest_batch, args.hidden)]
    while time.monotonic() < deadline:
        ms, outputs = await timed(expert_forward(host, expert, schema, inputs, timeout=OP_TIMEOUT))
        measured.latencies.append(ms)
        measured.ok.append(not isinstance(outputs, Exception) and tuple(outputs[0].shape) == tuple(inputs[0].shape))
        measured.rss.append(victim.rss_mb())
    return measured


def shared_key_near(victim_id: int, honest_ids: list[int]) -> str:
    """A dictionary key whose nearest honest node is the victim (so that it holds the entries)."""
    for n in range(100_000):
        key = int(DHTID.generate(f"abuse-shared-{n}"))
        if min(honest_ids, key=lambda node_id: node_id ^ key) == victim_id:
            return f"abuse-shared-{n}"
    raise RuntimeError("no key found whose nearest honest node is the victim")


async def run_dht_attack(name: str, args) -> dict:
    victim = await Role.start("dht-victim", args)
    hosts, nodes = [], []
    try:
        first = await asyncio.wait_for(victim.first, 30)
        target = Multiaddr(first["maddr"])
        for _ in range(args.honest - 1):
            host = await dialing_host(target, LISTEN)
            hosts.append(host)
            nodes.append(await DHTNode.create(rpc=HostDHTTransport(host), initial_peers=[target.peer_id]))
        client_host = await dialing_host(target)
        hosts.append(client_host)
        client = await DHTNode.create(rpc=HostDHTTransport(client_host), initial_peers=[target.peer_id],
                                      client_mode=True)
        nodes.append(client)
        shared = shared_key_near(first["node_id"], [first["node_id"]] + [int(n.node_id) for n in nodes[:-1]])
        round_number = [0]
        await honest_dht_loop(client, target.peer_id, shared, 2.0, victim, round_number)  # warm-up
        baseline = await honest_dht_loop(client, target.peer_id, shared, args.seconds, victim, round_number)
        attacker = await Role.start("attacker", args, attack=name, target=first["maddr"], shared_key=shared)
        try:
            ready = await asyncio.wait_for(attacker.ready, 900)
            notes = []
            if name == "sybils":
                for node in nodes[:-1]:  # honest lookups meet the Sybils while they still answer
                    await node.find_nearest_nodes([DHTID.generate() for _ in range(4)])
                table_before = victim.lines[-1][1]["table"]
                attacker.process.send_signal(signal.SIGSTOP)
                frozen_at = time.monotonic()
                notes.append(f"{ready['joined']} Sybils joined; victim table {table_before} entries "
                             f"({args.honest - 1} honest) at the freeze")
            attacked = await honest_dht_loop(client, target.peer_id, shared, args.seconds, victim, round_number)
            if name == "sybils":
                notes.append(table_shrink(victim, frozen_at, args.honest + 10))
                notes.append(f"client table {len(client.routing_table)} at the end")
            else:
                notes.append(", ".join(f"{key} {value:,}" if isinstance(value, int) else f"{key} {value}"
                                       for key, value in attacker.lines[-1][1].items() if key != "ready"))
            status = victim.lines[-1][1]
            notes.append(f"victim holds {status['keys']:,} keys, table {status['table']}")
        finally:
            await attacker.stop()
        return result_row(name, baseline, attacked, "; ".join(notes))
    finally:
        for node in nodes:
            await node.shutdown()
        for host in hosts:
            await host.shutdown()
        await victim.stop()


def table_shrink(victim: Role, since: float, small: int) -> str:
    after = [(at - since, fields["table"]) for at, fields in victim.lines if at >= since and "table" in fields]
    if not after:
        return "no table reports after the freeze"
    shrunk = next((at for at, size in after if size <= small), None)
    at_5 = next((size for at, size in after if at >= 5), after[-1][1])
    when = f"at most {small} after {shrunk:.1f} s" if shrunk is not None else f"still above {small}"
    return f"victim table {at_5} 5 s after the freeze, {when}, {after[-1][1]} at {after[-1][0]:.0f} s"


async def run_moe_attack(args) -> dict:
    from plexus.moe import ExpertInfo
    from plexus.moe.client import get_expert_schema

    victim = await Role.start("moe-victim", args)
    host = None
    try:
        target = Multiaddr((await asyncio.wait_for(victim.first, 60))["maddr"])
        host = await dialing_host(target)
        expert = ExpertInfo(EXPERT_UID, target.peer_id)
        schema = await get_expert_schema(host, expert)
        await honest_moe_loop(host, expert, schema, 2.0, args, victim)  # warm-up
        baseline = await honest_moe_loop(host, expert, schema, args.seconds, args, victim)
        attacker = await Role.start("attacker", args, attack="moe-flood", target=str(target))
        try:
            await asyncio.wait_for(attacker.ready, 120)
            attacked = await honest_moe_loop(host, expert, schema, args.seconds, args, victim)
            counts = attacker.lines[-1][1]
        finally:
            await attacker.stop()
        notes = (f"200 calls of {args.max_batch} x {args.hidden} in flight: {counts['served']:,} served, "
                 f"{counts['refused']:,} refused; honest calls of {args.honest_batch} rows")
        return result_row("moe-flood", baseline, attacked, notes)
    finally:
        if host is not None:
            await host.shutdown()
        await victim.stop()


# --- the report ------------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def result_row(name: str, baseline: Measured, attacked: Measured, notes: str) -> dict:
    return {"attack": name, "baseline": baseline, "attacked": attacked, "notes": notes}


def fmt(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def print_table(rows: list[dict], args) -> None:
    print(f"\nhonest operations one at a time, {args.seconds:.0f} s without and {args.seconds:.0f} s with each "
          f"attack; ms; 127.0.0.1; {args.honest} honest DHT nodes")
    print("| attack | p50 without → with | p99 without → with | success without → with | victim ping p50 "
          "without → with | victim MB before → peak | ops | notes |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        b, a = row["baseline"], row["attacked"]
        ratio = (percentile(a.latencies, 50) or 0) / max(percentile(b.latencies, 50) or 1e-9, 1e-9)
        ping = f"{fmt(percentile(b.pings, 50))} → {fmt(percentile(a.pings, 50))}" if b.pings else "—"
        success = f"{100 * sum(b.ok) / max(len(b.ok), 1):.1f}% → {100 * sum(a.ok) / max(len(a.ok), 1):.1f}%"
        print(f"| {row['attack']} | {fmt(percentile(b.latencies, 50))} → {fmt(percentile(a.latencies, 50))} "
              f"(x{ratio:.1f}) | {fmt(percentile(b.latencies, 99))} → {fmt(percentile(a.latencies, 99))} "
              f"| {success} | {ping} | {fmt(b.rss[-1] if b.rss else None, 0)} → {fmt(max(a.rss, default=None), 0)} "
              f"| {len(b.ok)} / {len(a.ok)} | {row['notes']} |")


async def run(args) -> None:
    rows = []
    for name in args.attacks:
        started = time.monotonic()
        rows.append(await (run_moe_attack(args) if name == "moe-flood" else run_dht_attack(name, args)))
        print(f"done: {name} in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    print_table(rows, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attacks", type=lambda text: [a for a in text.split(",") if a], default=list(ATTACKS),
                        help=f"comma-separated, of {', '.join(ATTACKS)}")
    parser.add_argument("--seconds", type=float, default=15.0, help="length of each measured window")
    parser.add_argument("--honest", type=int, default=8, help="honest DHT nodes, the victim included")
    parser.add_argument("--sybils", type=int, default=200)
    parser.add_argument("--silent-connections", type=int, default=500)
    parser.add_argument("--stream-hosts", type=int, default=20)
    parser.add_argument("--streams-per-host", type=int, default=100)
    parser.add_argument("--flood-peers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256, help="ffn expert width")
    parser.add_argument("--max-batch", type=int, default=256, help="the expert's max_batch_size: the flood's rows")
    parser.add_argument("--honest-batch", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the expert server")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--role", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--attack", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--target", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--shared-key", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    random.seed(args.seed)
    soft, hard = __import__("resource").getrlimit(__import__("resource").RLIMIT_NOFILE)
    __import__("resource").setrlimit(__import__("resource").RLIMIT_NOFILE, (hard, hard))
    if args.role == "dht-victim":
        asyncio.run(dht_victim(args))
    elif args.role == "moe-victim":
        asyncio.run(moe_victim(args))
    elif args.role == "attacker":
        asyncio.run(attacker(args))
    else:
        unknown = [name for name in args.attacks if name not in ATTACKS]
        if unknown:
            parser.error(f"unknown attacks {unknown}; choose from {', '.join(ATTACKS)}")
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
