"""Link profiles of the WAN lab, and what a path between two profiled peers should deliver.

A `LinkProfile` describes one peer's access to the internet: its downlink and uplink rates, the
round-trip time and jitter it adds, the share of packets it loses, whether it sits behind a NAT,
and how much its bottleneck buffers. A path from peer A to peer B crosses A's link and B's link:

  * round-trip time: (A.rtt + B.rtt) / 2, so two peers of one profile see exactly its `rtt`;
    each direction gets half of it, varying uniformly within +-(A.jitter + B.jitter) / 2;
  * loss, each direction: 1 - (1 - A.loss)(1 - B.loss), as a packet crosses both links;
  * rate from A to B: min(A.up, B.down).

`PathModel` holds these configured figures and the bounds plain TCP can reach on them: the link
rate less the header overhead and, on a lossy path, the bound of a loss-based congestion control.
For Reno that is the Mathis et al. (1997) bound MSS / RTT * sqrt(3/2) / sqrt(loss), whatever the
link's rate; CUBIC averages the larger of that and its own response function (RFC 8312, section
5.1: 1.054 * (RTT / loss)^(3/4) segments per RTT, for C = 0.4 and beta = 0.7). BBR does not back
off on random loss, so for it the link's goodput is the bound.
"""

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

from ...errors import UsageError

ETHERNET_HEADER = 14  # what the kernel's shapers count on a veth besides the IP packet
TCP_IP_HEADERS = 52  # IPv4 (20) + TCP with the timestamp option (32)
MATHIS_CONSTANT = math.sqrt(1.5)
CUBIC_CONSTANT = (0.4 * (3 + 0.7) / (4 * (1 - 0.7))) ** 0.25  # RFC 8312: C = 0.4, beta_cubic = 0.7
LOSS_BASED = ("reno", "cubic")


@dataclasses.dataclass(frozen=True)
class LinkProfile:
    """One peer's access link. Rates in bit/s, times in seconds, loss as a probability."""

    down: float
    """Downlink rate: the most the peer can receive."""
    up: float
    """Uplink rate: the most the peer can send."""
    rtt: float
    """Round-trip time between two peers of this profile (each link adds half of it to a path)."""
    jitter: float = 0.0
    """Between two peers of this profile each direction's delay varies uniformly within +-jitter of
    its mean (on a path between two profiles, within +- the mean of their jitters)."""
    loss: float = 0.0
    """Share of packets this link loses in each direction."""
    nat: bool = False
    """The peer sits behind its own NAT router: it can reach out, nobody can reach in."""
    queue: float | None = None
    """Bottleneck buffer in seconds at the link's rate (None: max(rtt, 20 ms), about one
    bandwidth-delay product, the rule of thumb routers are sized by)."""

    def __post_init__(self):
        for name in ("down", "up"):
            if not getattr(self, name) > 0:
                raise UsageError(f"a link profile's {name} rate must be positive, got {getattr(self, name)}")
        if self.rtt < 0 or self.jitter < 0:
            raise UsageError(f"a link profile needs rtt >= 0 and jitter >= 0, got {self.rtt}, {self.jitter}")
        if not 0 <= self.loss < 1:
            raise UsageError(f"a link profile's loss must be within [0, 1), got {self.loss}")
        if self.queue is not None and not self.queue > 0:
            raise UsageError(f"a link profile's queue must be positive seconds, got {self.queue}")

    @property
    def queue_seconds(self) -> float:
        return self.queue if self.queue is not None else max(self.rtt, 0.02)

    def replace(self, **changes) -> "LinkProfile":
        return dataclasses.replace(self, **changes)


PROFILES: dict[str, LinkProfile] = {
    "datacenter": LinkProfile(down=10e9, up=10e9, rtt=0.001),
    "cross-continent": LinkProfile(down=1e9, up=1e9, rtt=0.150),
    "home": LinkProfile(down=100e6, up=20e6, rtt=0.030, jitter=0.001),
    "notebook": LinkProfile(down=50e6, up=10e6, rtt=0.080, jitter=0.004, loss=0.005, nat=True),
}
"""The named profiles: a rack, one end of a transatlantic path, home broadband, a laptop on Wi-Fi."""


@dataclasses.dataclass(frozen=True)
class PathModel:
    """What the lab is configured to deliver from `a` to `b` (one direction)."""

    a: LinkProfile
    b: LinkProfile
    mtu: int = 1500
    congestion_control: str = "cubic"

    @property
    def rtt(self) -> float:
        return (self.a.rtt + self.b.rtt) / 2

    @property
    def one_way(self) -> float:
        return self.rtt / 2

    @property
    def jitter(self) -> float:
        """Half-width of the uniform spread of one direction's delay."""
        return (self.a.jitter + self.b.jitter) / 2

    @property
    def loss(self) -> float:
        return 1 - (1 - self.a.loss) * (1 - self.b.loss)

    @property
    def rate(self) -> float:
        return min(self.a.up, self.b.down)

    @property
    def mss(self) -> int:
        return self.mtu - TCP_IP_HEADERS

    @property
    def goodput(self) -> float:
        """TCP payload bit/s the link rate carries: the rate less IP, TCP and Ethernet headers."""
        return self.rate * self.mss / (self.mtu + ETHERNET_HEADER)

    @property
    def mathis(self) -> float:
        """The Mathis bound on one Reno-like TCP flow (bit/s); infinite without loss."""
        if self.loss == 0 or self.rtt == 0:
            return math.inf
        return self.mss * 8 / self.rtt * MATHIS_CONSTANT / math.sqrt(self.loss)

    @property
    def loss_bound(self) -> float:
        """The most the congestion control lets one flow carry at this loss (bit/s; see above)."""
        if self.congestion_control not in LOSS_BASED or math.isinf(self.mathis):
            return math.inf
        if self.congestion_control == "reno":
            return self.mathis
        cubic = CUBIC_CONSTANT * (self.rtt / self.loss) ** 0.75 * self.mss * 8 / self.rtt
        return max(self.mathis, cubic)

    @property
    def tcp_bound(self) -> float:
        """What one TCP flow can reach: the smaller of the goodput and the loss bound."""
        return min(self.goodput, self.loss_bound)

    @property
    def bdp(self) -> float:
        """Bandwidth-delay product in bytes."""
        return self.rate / 8 * self.rtt


# --- reading figures written by people: "100mbit", "30ms", "0.5%" -----------------------------------

_RATE_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_TIME_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6}


def parse_rate(value) -> float:
    """Bit/s from a number or a text like "100mbit", "1 Gbit/s", "20Mbps"."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    match = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?)(?:bit|bps|b)?(?:/s)?\s*", str(value).lower())
    if not match:
        raise UsageError(f"cannot read {value!r} as a rate: write e.g. 100mbit, 1gbit or 20e6 (bit/s)")
    return float(match.group(1)) * _RATE_UNITS[match.group(2)]


def parse_duration(value) -> float:
    """Seconds from a number or a text like "30ms", "1.5s", "200us"."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    match = re.fullmatch(r"\s*([0-9.]+)\s*(s|ms|us|µs)?\s*", str(value).lower())
    if not match:
        raise UsageError(f"cannot read {value!r} as a duration: write e.g. 30ms, 1.5s or 0.03 (seconds)")
    return float(match.group(1)) * _TIME_UNITS[match.group(2) or ""]


def parse_loss(value) -> float:
    """A probability from a number or a percentage like "0.5%"."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    match = re.fullmatch(r"\s*([0-9.]+)\s*(%?)\s*", str(value))
    if not match:
        raise UsageError(f"cannot read {value!r} as a loss rate: write e.g. 0.5% or 0.005")
    return float(match.group(1)) / (100 if match.group(2) else 1)


def profile_from_fields(fields: dict, base: LinkProfile | None = None, where: str = "profile") -> LinkProfile:
    """A profile from config fields (down, up, rtt, jitter, loss, nat, queue), over `base` if given."""
    readers: dict[str, Callable[[Any], Any]] = {
        "down": parse_rate,
        "up": parse_rate,
        "rtt": parse_duration,
        "jitter": parse_duration,
        "loss": parse_loss,
        "nat": bool,
        "queue": parse_duration,
    }
    unknown = set(fields) - set(readers)
    if unknown:
        raise UsageError(f"{where}: unknown field(s) {sorted(unknown)}; a link has {sorted(readers)}")
    values = {name: readers[name](value) for name, value in fields.items()}
    if base is not None:
        return base.replace(**values)
    missing = {"down", "up", "rtt"} - set(values)
    if missing:
        raise UsageError(f"{where}: a new profile needs {sorted(missing)} (or `base = <profile>`)")
    return LinkProfile(**values)


def format_rate(bits_per_second: float) -> str:
    if math.isinf(bits_per_second):
        return "inf"
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_second >= scale:
            return f"{bits_per_second / scale:.3g} {unit}"
    return f"{bits_per_second:.0f} bit/s"
