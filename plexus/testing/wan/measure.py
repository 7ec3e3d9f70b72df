"""Measuring a lab's paths with plain TCP and UDP, next to what they are configured to deliver.

For a path from A to B, `measure_path` runs probe.py in the two namespaces: TCP round trips
(RTT), a paced UDP session from A to B (one-way delay, its spread, loss, reordering) and one
TCP stream from A to B (throughput at the receiver, after its slow start). When B is behind a
NAT the probe runs in B and the server in A sends (`--reverse`): the data still flows from A to B.
Two peers behind NATs cannot reach each other directly; such a pair is refused.

The figures to compare with: RTT and one-way delay as configured; the jitter as the half-width of
a uniform spread, estimated from the measured 10th-90th percentile range; loss; and for
throughput the bound one TCP flow can reach (profiles.PathModel.tcp_bound: the link's goodput,
or on a lossy path the bound of the lab's congestion control, whichever is lower).
"""

import dataclasses
import math
import statistics

from ...errors import UsageError
from ..netns import PeerProcess
from .profiles import PathModel, format_rate

PROBE_TIMEOUT = 120.0


@dataclasses.dataclass
class MeasureOptions:
    """How hard each path is probed."""

    rtt_count: int = 20
    """TCP round trips (10 ms apart); 0 skips them."""
    udp_count: int = 2000
    """UDP datagrams for one-way delay and loss (0 skips them); the loss estimate's relative error
    is about 1/sqrt(udp_count * loss)."""
    udp_interval: float = 0.002
    """Seconds between datagrams; keep it above twice the jitter, or ordering lifts the delay."""
    udp_size: int = 100
    """Bytes of each datagram's payload (at least 20)."""
    tcp_seconds: float = 3.0
    """How long the TCP stream sends; on long fat paths leave room for slow start (see `warmup`)."""
    warmup: float | None = None
    """Seconds of the stream left out of its throughput (None: slow start's estimated length)."""


@dataclasses.dataclass
class PathMeasurement:
    a: str
    b: str
    path: PathModel
    rtts: list[float]
    delays: list[float]
    sent: int
    reordered: int
    throughput: float | None
    """Bit/s at the receiver after the warm-up; None when the stream was too short to tell."""

    @property
    def rtt(self) -> float:
        return statistics.median(self.rtts) if self.rtts else math.nan

    @property
    def one_way(self) -> float:
        return statistics.fmean(self.delays) if self.delays else math.nan

    @property
    def jitter(self) -> float:
        """The half-width of the uniform spread whose 10th-90th percentile range was measured (a
        uniform +-j spans 1.6 j there); robust to the few late packets of a busy machine."""
        if len(self.delays) < 10:
            return math.nan
        deciles = statistics.quantiles(self.delays, n=10)
        return (deciles[-1] - deciles[0]) / 1.6

    @property
    def loss(self) -> float:
        return 1 - len(self.delays) / self.sent if self.sent else math.nan


def slow_start_seconds(path: PathModel) -> float:
    """About how long one TCP flow takes to fill the path from an initial window of 10 segments."""
    doublings = math.log2(max(path.bdp / (10 * path.mss), 1.0))
    return max(0.5, path.rtt * (doublings + 2))


class PathProber:
    """Runs probes in a lab, with one probe server per peer that needs one (started on first use)."""

    def __init__(self, lab, options: MeasureOptions | None = None):
        self.lab, self.options = lab, options or MeasureOptions()
        self._servers: dict[str, PeerProcess] = {}

    def server(self, name: str) -> str:
        """The address of a probe server in `name`'s namespace (started on first use)."""
        if name not in self._servers:
            server = self.lab.probe(name, "serve")
            server.wait_for("ready", PROBE_TIMEOUT)
            self._servers[name] = server
        return self.lab.address(name)

    def _run(self, name: str, event: str, *args: str) -> dict:
        return self.lab.probe(name, event, *args).wait_for(event, PROBE_TIMEOUT)

    def measure(self, a: str, b: str, options: MeasureOptions | None = None) -> PathMeasurement:
        """Probe the path from `a` to `b` (see the module docstring), with `options` or the prober's."""
        lab, options, path = self.lab, options or self.options, self.lab.path(a, b)
        if lab.profiles[b].nat and lab.profiles[a].nat:
            raise UsageError(f"{a} and {b} are both behind NATs: no direct path to measure")
        client, server, reverse = (b, a, ["--reverse"]) if lab.profiles[b].nat else (a, b, [])
        host = self.server(server)
        rtts = []
        if options.rtt_count > 0:
            rtts = self._run(client, "rtt", host, "--count", str(options.rtt_count))["samples"]
        udp = {"delays": [], "sent": 0, "reordered": 0}
        if options.udp_count > 0:
            drain = str(2 * path.rtt + 4 * path.jitter + 0.5)
            udp = self._run(
                client,
                "udp",
                host,
                "--count",
                str(options.udp_count),
                "--interval",
                str(options.udp_interval),
                "--size",
                str(options.udp_size),
                "--drain",
                drain,
                *reverse,
            )
        throughput = None
        if options.tcp_seconds > 0:
            tcp = self._run(client, "tcp", host, "--seconds", str(options.tcp_seconds), *reverse)
            warmup = options.warmup if options.warmup is not None else slow_start_seconds(path)
            throughput = steady_rate(tcp["bins"], tcp["bin"], warmup)
        return PathMeasurement(a, b, path, rtts, udp["delays"], udp["sent"], udp["reordered"], throughput)

    def close(self) -> None:
        for server in self._servers.values():
            if server.process.poll() is None:
                server.finish()
        self._servers.clear()


def steady_rate(bins: list[int], width: float, warmup: float) -> float | None:
    """Bit/s over the full bins after `warmup` seconds (the last bin is partial and left out)."""
    steady = bins[int(math.ceil(warmup / width)) : -1]
    return sum(steady) * 8 / (len(steady) * width) if steady else None


HEADER = (
    "| path | RTT ms set / measured | one-way ms set / measured | jitter ms set / measured "
    "| loss % set / measured | TCP bound / measured | x bound |"
)


def format_row(m: PathMeasurement) -> str:
    p = m.path
    bound = p.tcp_bound
    if m.throughput is None:
        tcp, ratio = f"{format_rate(bound)} / -", "-"
    else:
        tcp, ratio = f"{format_rate(bound)} / {format_rate(m.throughput)}", f"{m.throughput / bound:.2f}"
    bound_kind = f" ({p.congestion_control} at this loss)" if p.loss_bound < p.goodput else ""
    return (
        f"| {m.a} -> {m.b} | {p.rtt * 1e3:.2f} / {m.rtt * 1e3:.2f} | {p.one_way * 1e3:.2f} / "
        f"{m.one_way * 1e3:.2f} | {p.jitter * 1e3:.2f} / {m.jitter * 1e3:.2f} | {p.loss * 100:.2f} / "
        f"{m.loss * 100:.2f} | {tcp}{bound_kind} | {ratio} |"
    )
