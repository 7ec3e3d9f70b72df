"""The simulated internet: where peers are, how long their messages take, how long they stay.

Latency. Each peer lives in a region, drawn by population share, and has an access network that
adds a one-way delay of its own (log-normal, median `access_median`: a few ms for fibre, tens for
DSL or Wi-Fi). A message's one-way delay is half the RTT between the two regions (a table of
typical inter-continental round-trip times) plus both peers' access delays.

Bandwidth and CPU. Each peer has an uplink and a downlink rate (log-normal around home broadband
medians). A message first waits for the sender's uplink (messages leave in the order they were
sent), then travels, then waits for the receiver: its downlink and its CPU act as one queue, in
arrival order, each message costing size / downlink + `service_time`. So a peer that many others
call, such as a bootstrap peer or the replica of a popular key, builds a queue that shows up as
delay, then as timeouts. (A message that would wait under QUEUE_SLACK is handled on arrival and
its answer leaves that much later: one event fewer for the common case, the same timing.)

Connections. The first message between two peers, or the first after `idle_timeout` of silence,
waits `handshake_rtts` round trips more (TCP, Noise and yamux before the first request, as the
WAN lab measures it); the handshake's bytes are not counted.

Calls and failures. `call` sends a request and delivers the answer to the caller, or None once its
timeout passes: a peer that left (a volunteer closing a laptop) answers nothing, so callers learn
of departures only through their timeouts. `send` is one-way.

Churn. `session_length` draws how long a volunteer stays online: Weibull with shape 0.5 (heavy
tailed: many short visits, a few peers that stay for days, as measured in peer-to-peer swarms)
scaled to a median of `median_session`, which puts about a quarter of the sessions under ten
minutes when the median is an hour. `residual_session` is what is left of the session of a peer
found online at a random moment (a length-biased draw), so a swarm starts in its steady state.
"""

import dataclasses
import math
import random

DEFAULT_REGIONS = {
    "north-america": 0.35,
    "europe": 0.35,
    "asia": 0.20,
    "south-america": 0.05,
    "oceania": 0.05,
}
# typical round-trip times between (and within) regions, in seconds
DEFAULT_REGION_RTT = {
    ("north-america", "north-america"): 0.040,
    ("north-america", "europe"): 0.090,
    ("north-america", "asia"): 0.160,
    ("north-america", "south-america"): 0.130,
    ("north-america", "oceania"): 0.160,
    ("europe", "europe"): 0.025,
    ("europe", "asia"): 0.200,
    ("europe", "south-america"): 0.200,
    ("europe", "oceania"): 0.280,
    ("asia", "asia"): 0.060,
    ("asia", "south-america"): 0.300,
    ("asia", "oceania"): 0.120,
    ("south-america", "south-america"): 0.040,
    ("south-america", "oceania"): 0.300,
    ("oceania", "oceania"): 0.030,
}
WEIBULL_SHAPE = 0.5
QUEUE_SLACK = 1e-3  # a message that waits less than this for its receiver is handled on arrival


@dataclasses.dataclass
class InternetOptions:
    """The simulated internet's figures. Times in seconds, rates in bit/s."""

    regions: dict = dataclasses.field(default_factory=lambda: dict(DEFAULT_REGIONS))
    """Region name -> share of the peers."""
    region_rtt: dict = dataclasses.field(default_factory=lambda: dict(DEFAULT_REGION_RTT))
    """(region, region) -> round-trip time between them (either order)."""
    access_median: float = 0.010
    """Median one-way delay a peer's own access network adds."""
    access_sigma: float = 0.7
    """Log-normal spread of that delay (0.7: a tenth of the peers above 25 ms)."""
    down_median: float = 50e6
    up_median: float = 10e6
    bandwidth_sigma: float = 0.8
    """Log-normal spread of the rates (0.8: a tenth of the peers below a third of the median)."""
    service_time: float = 200e-6
    """CPU seconds a peer spends on each message it receives (decrypting, decoding, handling)."""
    handshake_rtts: float = 4.0
    """Extra round trips before the first request on a new connection."""
    idle_timeout: float = 120.0
    """Connections unused this long are closed (the host's idle timeout)."""
    median_session: float = 3600.0
    """Median time a volunteer stays online."""


@dataclasses.dataclass(eq=False)
class Peer:
    """One machine on the simulated internet; `handler(sender, message, reply)` receives its messages."""

    index: int
    region: int
    access: float
    up: float
    down: float
    handler: object = None
    alive: bool = True
    uplink_free: float = 0.0
    busy_until: float = 0.0
    messages_sent: int = 0
    messages_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    busy_time: float = 0.0


class _Call:
    __slots__ = ("done", "on_done", "timer")

    def __init__(self, on_done):
        self.on_done, self.done, self.timer = on_done, False, None


class Internet:
    """Peers and the messages between them; see the module docstring."""

    def __init__(self, sim, options: InternetOptions | None = None, rng: random.Random | None = None):
        self.sim, self.options = sim, options or InternetOptions()
        self.rng = rng or sim.rng
        names = list(self.options.regions)
        self._region_names = names
        self._weights = [self.options.regions[name] for name in names]
        rtt = self.options.region_rtt
        self._half_rtt = [[(rtt.get((a, b)) or rtt[(b, a)]) / 2 for b in names] for a in names]
        self.peers: list[Peer] = []
        self._connections: dict[int, float] = {}  # pair key -> last use
        self._next_sweep = self.options.idle_timeout
        self.handshakes = 0

    # --- peers ------------------------------------------------------------------------------------

    def add_peer(self, handler=None, up: float | None = None, down: float | None = None) -> Peer:
        o, rng = self.options, self.rng
        region = rng.choices(range(len(self._region_names)), self._weights)[0]
        peer = Peer(
            len(self.peers),
            region,
            o.access_median * math.exp(rng.gauss(0, o.access_sigma)),
            up or o.up_median * math.exp(rng.gauss(0, o.bandwidth_sigma)),
            down or o.down_median * math.exp(rng.gauss(0, o.bandwidth_sigma)),
            handler,
        )
        self.peers.append(peer)
        return peer

    def region(self, peer: Peer) -> str:
        return self._region_names[peer.region]

    def one_way(self, a: Peer, b: Peer) -> float:
        return self._half_rtt[a.region][b.region] + a.access + b.access

    def rtt(self, a: Peer, b: Peer) -> float:
        return 2 * self.one_way(a, b)

    def session_length(self) -> float:
        """Seconds one volunteer session lasts (see the module docstring)."""
        scale = self.options.median_session / math.log(2) ** (1 / WEIBULL_SHAPE)
        return self.rng.weibullvariate(scale, WEIBULL_SHAPE)

    def residual_session(self) -> float:
        """What is left of the session of a peer seen online at a random moment."""
        # length-biased: a session of length L is seen with probability ~ L; then a uniform point in it
        lengths = [self.session_length() for _ in range(64)]
        length = self.rng.choices(lengths, lengths)[0]
        return self.rng.uniform(0, length)

    # --- messages ---------------------------------------------------------------------------------

    def send(self, src: Peer, dst: Peer, message, size: int) -> None:
        """Send one message; it reaches `dst.handler(src, message, None)` unless `dst` is gone."""
        self._transmit(src, dst, size, 0.0, self._handle, src, dst, message, None)

    def call(self, src: Peer, dst: Peer, request, size: int, timeout: float, on_done) -> None:
        """Send a request; `on_done(response)` gets the answer `dst` replies with, or None at the timeout."""
        call = _Call(on_done)
        call.timer = self.sim.after(timeout, self._expire, call)
        self._transmit(src, dst, size, self._connect(src, dst), self._handle, src, dst, request, call)

    def _connect(self, src: Peer, dst: Peer) -> float:
        now = self.sim.now
        if now >= self._next_sweep:
            limit = now - self.options.idle_timeout
            self._connections = {key: used for key, used in self._connections.items() if used >= limit}
            self._next_sweep = now + self.options.idle_timeout
        key = (min(src.index, dst.index) << 32) | max(src.index, dst.index)
        last = self._connections.get(key)
        self._connections[key] = now
        if last is not None and now - last <= self.options.idle_timeout:
            return 0.0
        self.handshakes += 1
        return self.options.handshake_rtts * self.rtt(src, dst)

    def _transmit(self, src: Peer, dst: Peer, size: int, delay: float, deliver, *args) -> None:
        """Queue `size` bytes on src's uplink (after `delay`); `deliver(*args)` once dst has taken them.

        A message held by a connection set-up joins the uplink's queue only once the set-up is
        over: meanwhile the uplink carries the peer's other messages (a busy peer dials new peers
        all the time, and would otherwise stall every answer behind each dial)."""
        if delay > QUEUE_SLACK:
            self.sim.after(delay, self._transmit, src, dst, size, 0.0, deliver, *args)
            return
        departure = max(self.sim.now + delay, src.uplink_free) + size * 8 / src.up
        src.uplink_free = departure
        src.messages_sent += 1
        src.bytes_sent += size
        self.sim.at(departure + self.one_way(src, dst), self._arrive, dst, size, deliver, args)

    def _arrive(self, dst: Peer, size: int, deliver, args: tuple) -> None:
        if not dst.alive:
            return  # nobody answers; a caller learns it from its timeout
        cost = size * 8 / dst.down + self.options.service_time
        now = self.sim.now
        ready = max(now, dst.busy_until) + cost
        dst.busy_until = ready
        dst.busy_time += cost
        dst.messages_received += 1
        dst.bytes_received += size
        if ready - now <= QUEUE_SLACK:  # not queued: handle now, and let the answer leave `cost` later
            deliver(*args, ready - now)
        else:
            self.sim.at(ready, deliver, *args, 0.0)

    def _handle(self, src: Peer, dst: Peer, message, call: _Call | None, delay: float) -> None:
        if not dst.alive:
            return
        if call is None:
            dst.handler(src, message, None)
            return

        def reply(response, size: int) -> None:  # a late answer still costs both ends; it is dropped then
            if dst.alive:
                self._transmit(
                    dst,
                    src,
                    size,
                    max(0.0, delay - (self.sim.now - handled)),
                    self._finish,
                    src,
                    call,
                    response,
                )

        handled = self.sim.now
        dst.handler(src, message, reply)

    def _finish(self, caller: Peer, call: _Call, response, delay: float) -> None:
        if not call.done and caller.alive:
            call.done = True
            call.timer.cancel()
            call.on_done(response)

    def _expire(self, call: _Call) -> None:
        if not call.done:
            call.done = True
            call.on_done(None)

    def __repr__(self) -> str:
        alive = sum(peer.alive for peer in self.peers)
        return f"<Internet {alive} of {len(self.peers)} peers online, {len(self._connections)} connections>"
