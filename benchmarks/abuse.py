"""Abuse benchmark: each attack against one node while an honest client measures what it still gets.

Run: `.venv/bin/python benchmarks/abuse.py [--attacks ATTACK,...] [--seconds 15] [--honest 8] [--sybils 200]
[--attacker-priority idle]`, with ATTACK among conn-flood, ping-flood, key-flood, subkey-stuffing,
sybils, sybils-one-address, moe-flood (default: all).

Every attack gets a fresh victim in a process of its own (so its memory is its own), an attacker in
another process, and the honest side in this one, all on this machine's loopback addresses:

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
- conn-flood: `--silent-connections` TCP connections that never say a word, plus connections that
  complete their handshake under fresh peer ids and each hold a DHT stream that never sends its
  request (`plexus.testing.flood.ConnectionFlood`, `--flood-connections` of them); whatever the
  victim closes is opened again.
- ping-flood: `--flood-peers` peers, each with 64 DHT pings in flight at all times.
- key-flood: 100,000 small keys stored on the victim, 1,024 per request, 8 requests in flight.
- subkey-stuffing: 100,000 sub-keys stored under the honest client's shared dictionary key.
- sybils: `--sybils` DHT nodes in the attacker's process join through the victim and look around
  until they fill the honest routing tables, then answer the honest side for SETTLE_SECONDS (5 s)
  while their process goes quiet; then the process is frozen (SIGSTOP), as a machine
  that lost power or a Sybil operator going silent at once. They share 127.0.0.1 with the honest
  nodes, which the routing tables do not limit (loopback is exempt), so this measures how lookups
  and tables cope with the frozen ids alone. The notes give the victim's routing table at the
  freeze and how it shrank, and the honest p50 in the first 5 s of the attack and after.
- sybils-one-address: the same from another address of this machine (127.0.0.66: every socket of
  the attacker binds it), against honest nodes that exempt only 127.0.0.1, so that the routing
  tables' per-network bounds apply to the Sybils as they would to one machine on the internet.
- moe-flood: one peer keeps 200 maximum-size forward calls in flight (`--max-batch` rows each).

By default the flooding attackers run at the lowest CPU priority (SCHED_IDLE): they stand for
other machines, and on a small shared box they must not take the victim's CPU themselves
(`--attacker-priority normal` lets them compete; the figures then include that). The Sybils join
at normal priority (joining is not the attack; they are frozen for the measurement).
"""

import argparse
import asyncio
import inspect
import json
import os
import random
import resource
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil
import torch

from plexus.dht.messages import PingRequest, StoreItem, StoreRequest, StoreResponse, decode_response
from plexus.dht.node import DHTNode
from plexus.dht.p2p_transport import DHT_PROTOCOL, HostDHTTransport
from plexus.dht.routing import DHTID
from plexus.moe import BatchTensorDescriptor, ExpertInfo, ModuleBackend, Server
from plexus.moe.client import expert_forward, get_expert_schema
from plexus.moe.server.layers import name_to_block, name_to_input
from plexus.p2p import rpc
from plexus.p2p.host import Host
from plexus.p2p.multiaddr import Multiaddr, parse_host_port
from plexus.testing.flood import ConnectionFlood
from plexus.utils.serializer import MSGPackSerializer
from plexus.utils.timing import get_dht_time

LISTEN = ("/ip4/127.0.0.1/tcp/0",)
SYBIL_IP = "127.0.0.66"  # another address of this machine: every 127/8 address is the loopback's
ATTACKS = (
    "conn-flood",
    "ping-flood",
    "key-flood",
    "subkey-stuffing",
    "sybils",
    "sybils-one-address",
    "moe-flood",
)
FLOODS = ("conn-flood", "ping-flood", "key-flood", "subkey-stuffing", "moe-flood")
EXPERT_UID = "ffn.0"
FLOOD_KEYS = 100_000
OP_TIMEOUT = 10.0  # an honest operation that takes longer counts as failed
FIRST_SECONDS = 5.0  # the Sybil notes split the attack window here
SETTLE_SECONDS = 5.0  # the Sybils answer honest work this long before they freeze


def node_options(attack: str) -> dict:
    """DHTNode options of the honest side: for sybils-one-address, exempt 127.0.0.1 alone from the
    routing tables' per-network bounds (when the code under test has them)."""
    if attack != "sybils-one-address" or "diversity" not in inspect.signature(DHTNode.create).parameters:
        return {}
    from plexus.dht.diversity import DiversityOptions

    return {"diversity": DiversityOptions(exempt_networks=("127.0.0.1/32",))}


def say(**fields) -> None:
    """One line of JSON on stdout: how a role process talks to the benchmark."""
    print(json.dumps(fields), flush=True)


# --- the victims (separate processes) ------------------------------------------------------------


async def dht_victim(args) -> None:
    host = await Host(host_maddrs=LISTEN).start()
    node = await DHTNode.create(rpc=HostDHTTransport(host), **node_options(args.attack))
    say(maddr=str(host.get_listen_maddrs()[0].with_peer_id(host.peer_id)), node_id=int(node.node_id))
    while True:
        say(table=len(node.routing_table), keys=len(node.storage))
        await asyncio.sleep(0.25)  # a status report every quarter second


async def moe_victim(args) -> None:
    torch.set_num_threads(args.threads)
    host = await Host(host_maddrs=LISTEN).start()
    module = name_to_block["ffn"](args.hidden)
    sample = name_to_input["ffn"](args.max_batch, args.hidden)
    backend = ModuleBackend(
        EXPERT_UID,
        module,
        args_schema=(BatchTensorDescriptor.from_tensor(sample),),
        max_batch_size=args.max_batch,
    )
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
    target, _ = await target_of(args)
    ip, port, _ = parse_host_port(target.without_peer_id())
    counts = {"silent_sockets": 0, "closed_by_victim": 0}

    async def silent_socket() -> None:
        while True:
            try:
                reader, writer = await asyncio.open_connection(ip, port)
            except OSError:
                await asyncio.sleep(0.5)  # the victim refuses for now: try again soon
                continue
            counts["silent_sockets"] += 1
            await reader.read()  # say nothing; wait until the victim closes it
            counts["silent_sockets"] -= 1
            counts["closed_by_victim"] += 1
            writer.close()

    flood = ConnectionFlood(target, identities=None, protocol=DHT_PROTOCOL)

    async def handshaken() -> None:
        while True:  # keep `flood_connections` held: make more as the victim closes some
            missing = args.flood_connections - flood.alive
            if missing > 0:
                await flood.run(missing)
            else:
                await asyncio.sleep(0.5)  # the attacker's pace, not synchronisation

    tasks = [asyncio.ensure_future(silent_socket()) for _ in range(args.silent_connections)]
    tasks.append(asyncio.ensure_future(handshaken()))
    await asyncio.sleep(3)  # let the flood build up before reporting it ready
    say(ready=True, **counts, held_streams=flood.alive, refused=flood.refused)
    while not any(task.done() for task in tasks):
        await asyncio.sleep(1)
        say(**counts, held_streams=flood.alive, refused=flood.refused)
    for task in tasks:
        if task.done():
            task.result()  # the error that stopped the flood


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
    flood = asyncio.ensure_future(asyncio.gather(*(pinger(host) for host in hosts for _ in range(64))))
    await asyncio.sleep(1)
    say(ready=True, pings=sent[0])
    while not flood.done():
        await asyncio.sleep(1)
        say(pings=sent[0])
    flood.result()


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


def bind_outgoing_sockets(ip: str) -> None:
    """Make every outgoing IPv4 TCP connection of this process come from `ip`, as if this process
    ran on a machine of its own (the attacker's; the honest side is untouched)."""
    original = asyncio.BaseEventLoop.create_connection

    async def create_connection(self, protocol_factory, host=None, port=None, **kwargs):
        if kwargs.get("sock") is None and kwargs.get("local_addr") is None and host and ":" not in host:
            kwargs["local_addr"] = (ip, 0)
        return await original(self, protocol_factory, host, port, **kwargs)

    asyncio.BaseEventLoop.create_connection = create_connection


async def sybils(args) -> None:
    target, peer = await target_of(args)
    listen = LISTEN
    if args.attack == "sybils-one-address":
        bind_outgoing_sockets(SYBIL_IP)
        listen = (f"/ip4/{SYBIL_IP}/tcp/0",)
    # The Sybils spend no CPU on upkeep (200 nodes share this process): no cache refreshes, no
    # liveness checks of their own, and patience with each other
    options = {"cache_refresh_before_expiry": 0, "wait_timeout": 10.0}
    if "liveness" in inspect.signature(DHTNode.create).parameters:
        from plexus.dht.liveness import LivenessOptions

        options["liveness"] = LivenessOptions(stale_after=None, sweep_interval=None)
    nodes, failures, slots = [], [], asyncio.Semaphore(16)

    async def join() -> None:
        async with slots:
            host = await dialing_host(target, listen)
            try:
                node = await DHTNode.create(rpc=HostDHTTransport(host), initial_peers=[peer], **options)
                nodes.append(node)
            except (OSError, TimeoutError) as error:  # DHTBootstrapError is a ConnectionError
                failures.append(repr(error))

    await asyncio.gather(*(join() for _ in range(args.sybils)))
    for _ in range(2):  # look around, so that every honest node meets (and answers) them
        await asyncio.gather(*(node.find_nearest_nodes([DHTID.generate()]) for node in nodes))
    say(ready=True, joined=len(nodes), failed=len(failures))
    while True:
        await asyncio.sleep(3600)  # frozen by the benchmark from here on


async def moe_flood(args) -> None:
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
            except (rpc.RPCError, TimeoutError, ConnectionError):
                stats["refused"] += 1
                await asyncio.sleep(0.01)  # the attacker's pace after a refusal

    flood = asyncio.ensure_future(asyncio.gather(*(flood_one() for _ in range(200))))
    await asyncio.sleep(2)
    say(ready=True, **stats)
    while not flood.done():
        await asyncio.sleep(1)
        say(**stats)
    flood.result()


def attacker(args):
    if args.attack in FLOODS and args.attacker_priority == "idle" and hasattr(os, "sched_setscheduler"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # runs only when a CPU would idle
    if args.attack == "key-flood":
        return store_flood(args, lambda i: (DHTID.generate(f"flood-{i}"), None))
    if args.attack == "subkey-stuffing":
        key = DHTID.generate(args.shared_key)
        return store_flood(args, lambda i: (key, MSGPackSerializer.dumps(f"stuffing-{i}")))
    if args.attack.startswith("sybils"):
        return sybils(args)
    return {"conn-flood": conn_flood, "ping-flood": ping_flood, "moe-flood": moe_flood}[args.attack](args)


# --- the honest side (this process) ----------------------------------------------------------------

ROLE_FLAGS = (
    "hidden",
    "max_batch",
    "threads",
    "sybils",
    "silent_connections",
    "flood_connections",
    "flood_peers",
    "attacker_priority",
    "attack",
)


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
        common = {name: getattr(args, name) for name in ROLE_FLAGS}
        flags += [
            f"--{name.replace('_', '-')}={value}"
            for name, value in common.items()
            if name not in extra and value is not None
        ]
        command = [sys.executable, os.path.abspath(__file__), f"--role={role}", *flags]
        process = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE)
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
    """What the honest client saw in one window: per operation its latency (ms), success and start
    time (s into the window); the victim's ping latencies and resident memory (MB) along the way."""

    def __init__(self):
        self.latencies, self.ok, self.started, self.pings, self.rss = [], [], [], [], []
        self.opened = time.monotonic()

    def add(self, ms: float, ok: bool, started: float) -> None:
        self.latencies.append(ms)
        self.ok.append(ok)
        self.started.append(started - self.opened)


async def timed(coroutine) -> tuple[float, object]:
    started = time.perf_counter()
    try:
        result = await asyncio.wait_for(coroutine, OP_TIMEOUT)
    except Exception as error:  # a failed operation counts as a failure, not a crash of the run
        result = error
    return (time.perf_counter() - started) * 1e3, result


async def honest_dht_loop(
    client: DHTNode, victim_peer, shared_key: str, seconds: float, victim: Role, round_number: list
) -> Measured:
    measured, deadline = Measured(), time.monotonic() + seconds
    me = f"honest-{client.peer_id.short()}"
    while time.monotonic() < deadline:
        i = round_number[0] = round_number[0] + 1
        expiration = get_dht_time() + 600
        operations = [
            (client.store(f"key-{i}", i, expiration), lambda found: found is True),
            (client.get(f"key-{i - 1}"), lambda found, i=i: getattr(found, "value", None) == i - 1),
            (client.store(shared_key, i, expiration, subkey=me), lambda found: found is True),
            (
                client.get(shared_key, latest=True),
                lambda found, i=i: (
                    isinstance(getattr(found, "value", None), dict)
                    and getattr(found.value.get(me), "value", None) == i
                ),
            ),
        ]
        for operation, check in operations:
            started = time.monotonic()
            ms, found = await timed(operation)
            measured.add(ms, not isinstance(found, Exception) and check(found), started)
        ms, answer = await timed(client.call_ping(victim_peer))
        if not isinstance(answer, Exception):
            measured.pings.append(ms)
        measured.rss.append(victim.rss_mb())
    return measured


async def honest_moe_loop(host: Host, expert, schema, seconds: float, args, victim: Role) -> Measured:
    measured, deadline = Measured(), time.monotonic() + seconds
    inputs = [torch.randn(args.honest_batch, args.hidden)]
    while time.monotonic() < deadline:
        started = time.monotonic()
        ms, outputs = await timed(expert_forward(host, expert, schema, inputs, timeout=OP_TIMEOUT))
        measured.add(ms, not isinstance(outputs, Exception) and outputs[0].shape == inputs[0].shape, started)
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
    victim = await Role.start("dht-victim", args, attack=name)
    options = node_options(name)
    hosts, nodes = [], []
    try:
        first = await asyncio.wait_for(victim.first, 30)
        target = Multiaddr(first["maddr"])
        for _ in range(args.honest - 1):
            host = await dialing_host(target, LISTEN)
            hosts.append(host)
            nodes.append(
                await DHTNode.create(rpc=HostDHTTransport(host), initial_peers=[target.peer_id], **options)
            )
        client_host = await dialing_host(target)
        hosts.append(client_host)
        client = await DHTNode.create(
            rpc=HostDHTTransport(client_host), initial_peers=[target.peer_id], client_mode=True, **options
        )
        nodes.append(client)
        shared = shared_key_near(first["node_id"], [first["node_id"]] + [int(n.node_id) for n in nodes[:-1]])
        round_number = [0]
        await honest_dht_loop(client, target.peer_id, shared, 2.0, victim, round_number)  # warm-up
        baseline = await honest_dht_loop(client, target.peer_id, shared, args.seconds, victim, round_number)
        attacker = await Role.start("attacker", args, attack=name, target=first["maddr"], shared_key=shared)
        try:
            ready = await asyncio.wait_for(attacker.ready, 900)
            notes = []
            if name.startswith("sybils"):
                for node in nodes[:-1]:  # honest lookups meet the Sybils while they still answer
                    await node.find_nearest_nodes([DHTID.generate() for _ in range(4)])
                # the Sybils settle (the attacker's process goes quiet, as one that joined a while
                # ago), while the honest client works among them; then the freeze
                await honest_dht_loop(client, target.peer_id, shared, SETTLE_SECONDS, victim, round_number)
                table_before = victim.lines[-1][1]["table"]
                attacker.process.send_signal(signal.SIGSTOP)
                frozen_at = time.monotonic()
                notes.append(
                    f"{ready['joined']} Sybils joined; victim table {table_before} entries "
                    f"({args.honest - 1} honest) at the freeze"
                )
            attacked = await honest_dht_loop(
                client, target.peer_id, shared, args.seconds, victim, round_number
            )
            if name.startswith("sybils"):
                notes.append(table_shrink(victim, frozen_at, args.honest + 10))
                early = [ms for ms, at in zip(attacked.latencies, attacked.started) if at < FIRST_SECONDS]
                late = [ms for ms, at in zip(attacked.latencies, attacked.started) if at >= FIRST_SECONDS]
                notes.append(
                    f"honest p50 {fmt(percentile(early, 50))} ms in the first {FIRST_SECONDS:.0f} s "
                    f"({len(early)} ops), {fmt(percentile(late, 50))} ms after ({len(late)} ops)"
                )
                notes.append(f"client table {len(client.routing_table)} at the end")
            else:
                notes.append(
                    ", ".join(
                        f"{key} {value:,}" if isinstance(value, int) else f"{key} {value}"
                        for key, value in attacker.lines[-1][1].items()
                        if key != "ready"
                    )
                )
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
    after = [
        (at - since, fields["table"]) for at, fields in victim.lines if at >= since and "table" in fields
    ]
    if not after:
        return "no table reports after the freeze"
    shrunk = next((at for at, size in after if size <= small), None)
    at_5 = next((size for at, size in after if at >= 5), after[-1][1])
    when = f"at most {small} after {shrunk:.1f} s" if shrunk is not None else f"still above {small}"
    return f"victim table {at_5} 5 s after the freeze, {when}, {after[-1][1]} at {after[-1][0]:.0f} s"


async def run_moe_attack(args) -> dict:
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
        notes = (
            f"200 calls of {args.max_batch} x {args.hidden} in flight: {counts['served']:,} served, "
            f"{counts['refused']:,} refused; honest calls of {args.honest_batch} rows"
        )
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
    print(
        f"\nhonest operations one at a time, {args.seconds:.0f} s without and {args.seconds:.0f} s with "
        f"each attack; ms; loopback; {args.honest} honest DHT nodes; attackers at {args.attacker_priority} "
        f"priority"
    )
    print(
        "| attack | p50 without → with | p99 without → with | success without → with | victim ping p50 "
        "without → with | victim MB before → peak | ops | notes |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        b, a = row["baseline"], row["attacked"]
        ratio = (percentile(a.latencies, 50) or 0) / max(percentile(b.latencies, 50) or 1e-9, 1e-9)
        ping = f"{fmt(percentile(b.pings, 50))} → {fmt(percentile(a.pings, 50))}" if b.pings else "—"
        success = f"{100 * sum(b.ok) / max(len(b.ok), 1):.1f}% → {100 * sum(a.ok) / max(len(a.ok), 1):.1f}%"
        print(
            f"| {row['attack']} | {fmt(percentile(b.latencies, 50))} → {fmt(percentile(a.latencies, 50))} "
            f"(x{ratio:.1f}) | {fmt(percentile(b.latencies, 99))} → {fmt(percentile(a.latencies, 99))} "
            f"| {success} | {ping} | {fmt(b.rss[-1] if b.rss else None, 0)} → "
            f"{fmt(max(a.rss, default=None), 0)} "
            f"| {len(b.ok)} / {len(a.ok)} | {row['notes']} |"
        )


async def run(args) -> None:
    rows = []
    for name in args.attacks:
        started = time.monotonic()
        rows.append(await (run_moe_attack(args) if name == "moe-flood" else run_dht_attack(name, args)))
        print(f"done: {name} in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    print_table(rows, args)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--attacks",
        type=lambda text: [a for a in text.split(",") if a],
        default=list(ATTACKS),
        help=f"comma-separated, of {', '.join(ATTACKS)}",
    )
    parser.add_argument("--seconds", type=float, default=15.0, help="length of each measured window")
    parser.add_argument("--honest", type=int, default=8, help="honest DHT nodes, the victim included")
    parser.add_argument("--sybils", type=int, default=200)
    parser.add_argument(
        "--silent-connections", type=int, default=500, help="conn-flood: sockets that never speak"
    )
    parser.add_argument(
        "--flood-connections",
        type=int,
        default=500,
        help="conn-flood: handshaken connections, each holding a silent DHT stream",
    )
    parser.add_argument("--flood-peers", type=int, default=4, help="ping-flood: peers pinging")
    parser.add_argument(
        "--attacker-priority",
        choices=("idle", "normal"),
        default="idle",
        help="CPU priority of the flooding attackers (idle: SCHED_IDLE)",
    )
    parser.add_argument("--hidden", type=int, default=256, help="ffn expert width")
    parser.add_argument(
        "--max-batch", type=int, default=256, help="the expert's max_batch_size: the flood's rows"
    )
    parser.add_argument("--honest-batch", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the expert server")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--role", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--attack", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--target", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--shared-key", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    random.seed(args.seed)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # a flood holds thousands of sockets
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
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
