"""The WAN lab: peers in their own network namespaces, joined by a core router with real-world links.

Topology (addresses exist only inside the lab's namespaces):

    peer i  10.201.i.2 eth0 ---- p<i> 10.201.i.1  [core]  (router; every p<i> routes into tun0)
    NATed peer i: 10.202.i.2 eth0 -- lan 10.202.i.1 [nat i] wan 10.201.i.2 ---- p<i> 10.201.i.1

The core forwards every packet from a peer's link through a TUN device to the forwarder process
(forwarder.py: per-path delay, jitter, loss), then on to the destination's link. Rates are
enforced by kernel qdiscs in the core, so the queues sit in the router as on a real path and the
peers' own stacks are untouched: an htb class per peer on tun0's egress is that peer's uplink
(classified by source address, with a byte FIFO of the profile's queue), and a tbf on p<i> is
peer i's downlink. A NATed peer sits behind a router namespace of its own that masquerades
outgoing connections and drops new inbound ones (netns.NAT_RULES), as a home router does.

Each peer namespace gets TCP buffer limits large enough for its longest fat path (a host that is
not tuned that way cannot fill one either; the default limits stop near 6 MiB) and the congestion
control of the lab's options (CUBIC unless told otherwise, whatever the machine's default). IPv6 is off.

Life cycle: `WanLab(peers).start()` (or `with WanLab(...) as lab`) removes stale namespaces of
earlier crashed labs, builds everything under unique names (netns.Namespaces) and starts the
forwarder; `close()` removes all of it, also after a failed build. Up to 250 peers.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence

from ...errors import UsageError
from ..netns import NAT_RULES, Namespaces, PeerProcess, remove_stale, run_command
from .forwarder import DEFAULT_TICK
from .profiles import ETHERNET_HEADER, PROFILES, LinkProfile, PathModel

MAX_PEERS = 250
TUN_DEVICE, TUN_MTU, TUN_QUEUE = "tun0", 65000, 10000
ROUTE_TABLE = 100
FORWARDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "forwarder.py")
PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "probe.py")
MIN_TCP_BUFFER = 16 << 20


@dataclasses.dataclass
class LabOptions:
    """How the lab is built. Times in seconds."""

    mtu: int = 1500
    """MTU of every link. Larger MTUs (9000, up to 65000) cut the forwarder's per-packet work when
    rates pass a few hundred Mbit/s; TCP then sends segments of MTU - 52 bytes."""
    offload: bool = True
    """Let the forwarder take TCP bursts of up to 64 KiB as one super-packet (TSO/GRO through the
    TUN device, loss still drawn per segment): 10-40x fewer packets to move at high rates.
    Without it, each packet of at most `mtu` bytes costs a read and a write."""
    tick: float = DEFAULT_TICK
    """Resolution of the forwarder's timer wheel: each packet leaves within half a tick of its time."""
    seed: int | None = None
    """Seed of the forwarder's loss and jitter draws (None: a fresh one per lab)."""
    prefix: str = "pxwan"
    """Start of the lab's namespace names; namespaces of this prefix whose owner died are removed."""
    tcp_buffer: int | None = None
    """Largest TCP socket buffer in the peers' namespaces, bytes (None: 4x the largest
    bandwidth-delay product among the peer's paths, at least 16 MiB)."""
    congestion_control: str = "cubic"
    """TCP congestion control in the peers' namespaces: "cubic" (Linux's default, most of the
    internet's), "reno", or "bbr" (which ignores random loss); the kernel must offer it."""
    realtime: bool = True
    """Run the forwarder under SCHED_FIFO (else, or where refused, nice -10): on a busy machine a
    forwarder that waits for a core adds milliseconds to every packet's delay, which TCP takes for
    congestion. It only uses CPU while the lab's packets flow."""
    start_timeout: float = 10.0
    """How long the forwarder may take to report ready."""

    def __post_init__(self):
        if not 576 <= self.mtu <= TUN_MTU:
            raise UsageError(f"mtu must be within [576, {TUN_MTU}], got {self.mtu}")
        if not self.tick > 0:
            raise UsageError(f"tick must be positive seconds, got {self.tick}")


def resolve_profile(profile: LinkProfile | str) -> LinkProfile:
    if isinstance(profile, LinkProfile):
        return profile
    try:
        return PROFILES[profile]
    except KeyError:
        raise UsageError(f"unknown link profile {profile!r}; the named ones are {sorted(PROFILES)}") from None


class WanLab:
    """Peers on emulated internet links; see the module docstring."""

    def __init__(self, peers: Mapping[str, LinkProfile | str], options: LabOptions | None = None, **kwargs):
        if not peers or len(peers) > MAX_PEERS:
            raise UsageError(f"a lab holds 1 to {MAX_PEERS} peers, got {len(peers)}")
        for name in peers:
            if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_.-]{0,31}", name):
                raise UsageError(f"peer name {name!r}: use letters, digits, '_', '.', '-' (at most 32)")
        self.profiles = {name: resolve_profile(profile) for name, profile in peers.items()}
        self.options = options or LabOptions(**kwargs)
        self.index = {name: i for i, name in enumerate(self.profiles, start=1)}
        self.namespaces: Namespaces | None = None
        self.forwarder: PeerProcess | None = None

    # --- addresses and configured figures -------------------------------------------------------

    def address(self, name: str) -> str:
        """The peer's own address, for its processes to bind (private when it is behind a NAT)."""
        i = self._index(name)
        return f"10.202.{i}.2" if self.profiles[name].nat else f"10.201.{i}.2"

    def public_address(self, name: str) -> str:
        """Where the peer's packets come from as others see them (its NAT router's, if NATed)."""
        return f"10.201.{self._index(name)}.2"

    def namespace(self, name: str) -> str:
        return self._namespaces().full(f"p{self._index(name)}")

    def path(self, a: str, b: str) -> PathModel:
        """The configured path from `a` to `b`."""
        options = self.options
        return PathModel(self.profiles[a], self.profiles[b], options.mtu, options.congestion_control)

    def _index(self, name: str) -> int:
        try:
            return self.index[name]
        except KeyError:
            raise UsageError(f"no peer {name!r} in this lab; it has {sorted(self.index)}") from None

    def _namespaces(self) -> Namespaces:
        if self.namespaces is None or self.namespaces.closed:
            raise UsageError("the lab is not running: call start() or use `with WanLab(...) as lab`")
        return self.namespaces

    # --- life cycle -----------------------------------------------------------------------------

    def start(self) -> "WanLab":
        remove_stale(self.options.prefix)
        self.namespaces = Namespaces(self.options.prefix)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Remove every namespace, interface and process of the lab (idempotent)."""
        if self.forwarder is not None and self.forwarder.process.poll() is None:
            self.forwarder.finish()
        if self.namespaces is not None:
            self.namespaces.close()

    def __enter__(self) -> "WanLab":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _build(self) -> None:
        ns = self.namespaces
        self._add_namespace("core")
        ns.sysctl(
            "core",
            "net.ipv4.ip_forward=1",
            "net.ipv4.conf.all.rp_filter=0",
            "net.ipv4.conf.default.rp_filter=0",
            "net.ipv4.conf.all.send_redirects=0",
        )
        self._start_forwarder()
        ns.ip("core", "link", "set", TUN_DEVICE, "mtu", str(TUN_MTU), "txqueuelen", str(TUN_QUEUE), "up")
        ns.ip("core", "route", "add", "default", "dev", TUN_DEVICE, "table", str(ROUTE_TABLE))
        ns.tc("core", "qdisc", "add", "dev", TUN_DEVICE, "root", "handle", "1:", "htb")
        for name, i in self.index.items():
            self._add_peer(name, i)

    def _add_namespace(self, name: str) -> None:
        self.namespaces.add(name)
        self.namespaces.run(
            "sysctl",
            "-q",
            "-w",
            "net.ipv6.conf.all.disable_ipv6=1",
            "net.ipv6.conf.default.disable_ipv6=1",
            ns=name,
            check=False,
        )

    def _start_forwarder(self) -> None:
        paths = []
        for a in self.profiles:
            for b in self.profiles:
                if a != b:
                    path = self.path(a, b)
                    paths.append(
                        [self.public_address(a), self.public_address(b), path.one_way, path.jitter, path.loss]
                    )
        process = self.namespaces.spawn(
            "core",
            [
                sys.executable,
                "-S",
                FORWARDER,
                "--dev",
                TUN_DEVICE,
                "--mtu",
                str(self.options.mtu),
                *(() if self.options.offload else ("--no-offload",)),
                *(("--realtime",) if self.options.realtime else ()),
                "--lab",
                self.namespaces.tag,
            ],
        )
        self.forwarder = PeerProcess("forwarder", process)
        config = {"paths": paths, "tick": self.options.tick, "seed": self.options.seed}
        self.forwarder.send(json.dumps(config))
        self.forwarder.wait_for("ready", self.options.start_timeout)

    def _add_peer(self, name: str, i: int) -> None:
        ns, profile, mtu = self.namespaces, self.profiles[name], self.options.mtu
        peer, edge = f"p{i}", (f"n{i}" if profile.nat else f"p{i}")
        self._add_namespace(peer)
        if profile.nat:
            self._add_namespace(edge)
            ns.veth(peer, "eth0", edge, "lan", mtu)
            ns.ip(edge, "addr", "add", f"10.202.{i}.1/24", "dev", "lan")
            ns.ip(edge, "link", "set", "lan", "up")
            ns.ip(peer, "addr", "add", f"10.202.{i}.2/24", "dev", "eth0")
            ns.ip(peer, "link", "set", "eth0", "up")
            ns.ip(peer, "route", "add", "default", "via", f"10.202.{i}.1", *self._congestion_control)
            ns.sysctl(edge, "net.ipv4.ip_forward=1")
            ns.nft(edge, NAT_RULES)
        uplink = "wan" if profile.nat else "eth0"
        ns.veth(edge, uplink, "core", f"p{i}", mtu)
        ns.ip(edge, "addr", "add", f"10.201.{i}.2/24", "dev", uplink)
        ns.ip(edge, "link", "set", uplink, "up")
        ns.ip(
            edge,
            "route",
            "add",
            "default",
            "via",
            f"10.201.{i}.1",
            *(() if profile.nat else self._congestion_control),
        )
        ns.ip("core", "addr", "add", f"10.201.{i}.1/24", "dev", f"p{i}")
        ns.ip("core", "link", "set", f"p{i}", "up")
        ns.ip("core", "rule", "add", "iif", f"p{i}", "lookup", str(ROUTE_TABLE), "priority", "100")
        self._shape(name, i)
        buffer = self.options.tcp_buffer or self._tcp_buffer(name)
        ns.sysctl(peer, f"net.ipv4.tcp_rmem=4096 131072 {buffer}", f"net.ipv4.tcp_wmem=4096 16384 {buffer}")

    @property
    def _congestion_control(self) -> tuple[str, ...]:
        """Set on the peer's default route, which every connection to another peer takes: a
        namespace's own default may only name the machine's allowed algorithms, a route any."""
        return ("congctl", self.options.congestion_control)

    def _shape(self, name: str, i: int) -> None:
        """Uplink: an htb class on tun0 for packets from the peer; downlink: a tbf on its core link."""
        ns, profile = self.namespaces, self.profiles[name]
        for rate, add in ((profile.up, self._uplink), (profile.down, self._downlink)):
            frame = self.options.mtu + ETHERNET_HEADER
            burst = max(2 * frame, int(rate / 8 * 1e-3))  # 1 ms at the rate: the kernel's timers keep up
            queue = max(int(rate / 8 * profile.queue_seconds), 4 * frame, burst)
            add(ns, i, rate, burst, queue)

    def _uplink(self, ns: Namespaces, i: int, rate: float, burst: int, queue: int) -> None:
        rate_text, classid, leaf = f"{int(rate)}bit", f"1:{i:x}", f"{i + 0x100:x}:"
        ns.tc(
            "core",
            "class",
            "add",
            "dev",
            TUN_DEVICE,
            "parent",
            "1:",
            "classid",
            classid,
            "htb",
            "rate",
            rate_text,
            "ceil",
            rate_text,
            "burst",
            str(burst),
            "cburst",
            str(burst),
            "quantum",
            str(max(burst, TUN_MTU)),
        )
        ns.tc(
            "core",
            "qdisc",
            "add",
            "dev",
            TUN_DEVICE,
            "parent",
            classid,
            "handle",
            leaf,
            "bfifo",
            "limit",
            str(queue),
        )
        ns.tc(
            "core",
            "filter",
            "add",
            "dev",
            TUN_DEVICE,
            "parent",
            "1:",
            "protocol",
            "ip",
            "prio",
            "1",
            "u32",
            "match",
            "ip",
            "src",
            f"10.201.{i}.2/32",
            "flowid",
            classid,
        )

    def _downlink(self, ns: Namespaces, i: int, rate: float, burst: int, queue: int) -> None:
        ns.tc(
            "core",
            "qdisc",
            "add",
            "dev",
            f"p{i}",
            "root",
            "tbf",
            "rate",
            f"{int(rate)}bit",
            "burst",
            str(burst),
            "limit",
            str(queue),
        )

    def _tcp_buffer(self, name: str) -> int:
        bdp = max(
            (
                max(self.path(name, other).bdp, self.path(other, name).bdp)
                for other in self.profiles
                if other != name
            ),
            default=0,
        )
        return max(MIN_TCP_BUFFER, int(4 * bdp))

    # --- running things inside ------------------------------------------------------------------

    def spawn(
        self,
        name: str,
        argv: Sequence[str],
        env: dict | None = None,
        cwd: str | None = None,
        stderr=subprocess.PIPE,
    ) -> subprocess.Popen:
        """Start `argv` in peer `name`'s namespace (a subprocess.Popen with text pipes)."""
        return self._namespaces().spawn(f"p{self._index(name)}", argv, env=env, cwd=cwd, stderr=stderr)

    def run(self, name: str, *argv: str) -> str:
        """Run a command to its end in `name`'s namespace and return its output."""
        return self._namespaces().run(*argv, ns=f"p{self._index(name)}")

    def peer(
        self, name: str, argv: Sequence[str], env: dict | None = None, cwd: str | None = None
    ) -> PeerProcess:
        """Start `argv` in `name`'s namespace and follow the JSON events it prints (netns.emit)."""
        return PeerProcess(name, self.spawn(name, argv, env=env, cwd=cwd))

    def probe(self, name: str, *args: str) -> PeerProcess:
        """Run the lab's measuring tool (probe.py) in `name`'s namespace."""
        return self.peer(name, [sys.executable, "-S", PROBE, *args, "--lab", self._namespaces().tag])

    def forwarder_stats(self, timeout: float = 10.0) -> dict:
        """The forwarder's counters, plus the packets the kernel dropped because it was not reading
        fast enough (`tun_dropped`: when not zero, the lab itself lost packets)."""
        self.forwarder.events.pop("stats", None)
        self.forwarder.send("stats")
        stats = dict(self.forwarder.wait_for("stats", timeout))
        stats.pop("event")
        core = self._namespaces().full("core")
        output = run_command(["ip", "-n", core, "-s", "-j", "link", "show", TUN_DEVICE])
        stats["tun_dropped"] = json.loads(output)[0]["stats64"]["tx"]["dropped"]
        return stats

    def __repr__(self) -> str:
        state = "running" if self.namespaces is not None and not self.namespaces.closed else "stopped"
        return f"<WanLab {len(self.profiles)} peers, mtu {self.options.mtu}, {state}>"
