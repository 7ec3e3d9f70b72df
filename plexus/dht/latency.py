"""How long a DHT request may stay unanswered before a lookup stops waiting for it.

A lookup should not wait the full request timeout for a silent peer (see the stragglers in
`traverse.py`), yet the right wait differs by five orders of magnitude between 127.0.0.1 and a
busy intercontinental link. So the node learns it from its own answered requests, the way TCP
learns its retransmission timeout (RFC 6298, section 2): a smoothed round-trip time SRTT and its
mean deviation RTTVAR, updated with gains 1/8 and 1/4, and a limit of SRTT + 4 * RTTVAR, clamped
to [floor, ceiling]. Before the first answer the limit is the ceiling. Failed requests are not
samples: a dead peer says nothing about the network. Sans-I/O: durations come in as numbers.
"""

DEFAULT_FLOOR = 0.1  # s: absorbs event-loop stalls (GC, a busy training thread) on fast networks


class LatencyEstimator:
    """Smoothed request latency and the straggler limit derived from it."""

    def __init__(self, ceiling: float, floor: float = DEFAULT_FLOOR):
        if not 0 < floor <= ceiling:
            raise ValueError(f"need 0 < floor ({floor}) <= ceiling ({ceiling})")
        self.floor, self.ceiling = floor, ceiling
        self.srtt: float | None = None
        self.rttvar = 0.0

    def observe(self, duration: float) -> None:
        """Record the duration (s) of a request that was answered."""
        if duration < 0:
            return
        if self.srtt is None:
            self.srtt, self.rttvar = duration, duration / 2
        else:
            self.rttvar += (abs(self.srtt - duration) - self.rttvar) / 4
            self.srtt += (duration - self.srtt) / 8

    def straggler_timeout(self) -> float:
        """Seconds after which an unanswered request is probably lost (never above the ceiling)."""
        if self.srtt is None:
            return self.ceiling
        return min(self.ceiling, max(self.floor, self.srtt + 4 * self.rttvar))

    def __repr__(self) -> str:
        srtt = "?" if self.srtt is None else f"{self.srtt * 1e3:.1f}ms"
        return f"LatencyEstimator(srtt={srtt}, limit={self.straggler_timeout() * 1e3:.0f}ms)"
