"""How long a DHT request may stay unanswered before a lookup stops waiting for it.

A lookup should not wait the full request timeout for a silent peer (see the stragglers in
`traverse.py`), yet the right wait differs by orders of magnitude between 127.0.0.1 and a busy
intercontinental link, and with whether a request must dial first. So the node learns it from
its own recent answered requests: the limit is `FACTOR` times the 90th percentile of the last
`WINDOW` durations, clamped to [floor, ceiling]; before the first answer it is the ceiling.

Why not TCP's SRTT + 4 * RTTVAR (RFC 6298)? Measured on a 256-node swarm on one loaded machine,
answers took 10 ms at the median and 43 ms at p99, yet the smoothed estimate sat at 430 ms: a few
one-second outliers (and the burst of joins at start-up) kept RTTVAR high for the many requests a
node needs to forget them. A windowed percentile forgets in `WINDOW` answers and ignores the worst
tenth. A false straggler costs one extra request; waiting too long costs the whole lookup.
Failed requests are not samples: a dead peer says nothing about the network.

The same samples bound a request itself (`request_timeout`): REQUEST_FACTOR times the p90,
clamped to [min_request_timeout, ceiling]. A silent peer then fails in about a second on a fast
network instead of the full `wait_timeout`, so it is banned and leaves the routing table sooner;
on a slow network the estimate grows back to `wait_timeout`.

Between sending and failing, a peer with a request unanswered for longer than the straggler
limit is *silent* (`Unanswered`): lookups do not ask it again meanwhile, so two hundred frozen
peers cost each lookup their first silence, not one wait per lookup that meets them. Sans-I/O:
durations and times come in as numbers.
"""

from collections import deque

from ..p2p.identity import PeerID

DEFAULT_FLOOR = 0.1  # s: absorbs event-loop stalls (GC, a busy training thread) on fast networks
DEFAULT_MIN_REQUEST_TIMEOUT = 1.0  # s: an event-loop stall or a new dial must not fail a live peer
WINDOW = 32
FACTOR = 4.0  # as traverse.STRAGGLER_FACTOR
REQUEST_FACTOR = 8.0  # a request fails at twice the wait after which it turns into a straggler


class LatencyEstimator:
    """Recent request durations and the straggler limit derived from them."""

    def __init__(
        self,
        ceiling: float,
        floor: float = DEFAULT_FLOOR,
        min_request_timeout: float = DEFAULT_MIN_REQUEST_TIMEOUT,
    ):
        if not 0 < floor <= ceiling:
            raise ValueError(f"need 0 < floor ({floor}) <= ceiling ({ceiling})")
        self.floor, self.ceiling = floor, ceiling
        self.min_request_timeout = min(max(floor, min_request_timeout), ceiling)
        self._recent: deque[float] = deque(maxlen=WINDOW)
        self._limit: float | None = ceiling
        self._p90: float | None = None

    def observe(self, duration: float) -> None:
        """Record the duration (s) of a request that was answered."""
        if duration >= 0:
            self._recent.append(duration)
            self._limit = None

    def straggler_timeout(self) -> float:
        """Seconds after which an unanswered request is probably lost (never above the ceiling)."""
        if self._limit is None:  # computed once per lookup, not once per answer
            ordered = sorted(self._recent)
            self._p90 = ordered[(9 * len(ordered)) // 10]
            self._limit = min(self.ceiling, max(self.floor, FACTOR * self._p90))
        return self._limit

    def request_timeout(self) -> float:
        """Seconds after which a request counts as failed: REQUEST_FACTOR x the recent p90, within
        [min_request_timeout, ceiling]; the ceiling before the first answer."""
        self.straggler_timeout()
        if self._p90 is None:
            return self.ceiling
        return min(self.ceiling, max(self.min_request_timeout, REQUEST_FACTOR * self._p90))

    def __repr__(self) -> str:
        return f"LatencyEstimator({len(self._recent)} samples, limit={self.straggler_timeout() * 1e3:.0f}ms)"


class Unanswered:
    """Peers with requests in flight, and since when each has been silent: since the first request
    it has left unanswered, or since its latest answer if requests sent before that are still out."""

    def __init__(self):
        self._peers: dict[PeerID, list] = {}  # peer -> [requests in flight, silent since]

    def sent(self, peer: PeerID, now: float) -> None:
        entry = self._peers.get(peer)
        if entry is None:
            self._peers[peer] = [1, now]
        else:
            entry[0] += 1

    def finished(self, peer: PeerID, now: float, answered: bool) -> None:
        """A request to `peer` ended: answered, or failed or cancelled."""
        entry = self._peers.get(peer)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] <= 0:
            del self._peers[peer]
        elif answered:
            entry[1] = now

    def silent_for(self, peer: PeerID, now: float) -> float:
        entry = self._peers.get(peer)
        return 0.0 if entry is None else now - entry[1]

    def __len__(self) -> int:
        return len(self._peers)
