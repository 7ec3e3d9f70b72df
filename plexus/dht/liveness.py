"""Evicting routing-table entries that went silent, before lookups have to find out one by one.

Theory of operation. Kademlia drops an entry only when a request to it fails, so an entry a node
never asks stays, and the node keeps handing it to everyone who asks for nearby peers. After 200
Sybil ids froze, honest tables took 45-55 s to shrink or never did, and the lookups of everyone
who was handed those entries paid for them. Two triggers find silent entries, both cheap while
the swarm is healthy:

- Hand-out checks. Answering a find, a node vouches for the peers it names. An entry it names
  that has shown no sign of life (an answer, or a request of its own) for `stale_after` seconds
  is pinged in the background (it is named anyway), each entry at most once per `stale_after`,
  within a budget of `checks_per_second` (a token bucket holding up to `check_burst`). A busy
  swarm hears from its peers anyway and checks little.
- Sweeps. A failed request is evidence of churn, and peers tend to go silent together (a frozen
  machine, a cut link, a Sybil operator): after a failure the node pings every entry that has shown
  no sign of life since the failed request was sent, `sweep_concurrency` at a time. Sweeps do not
  overlap, and one starts at most `sweep_interval` seconds after the last, or `stale_after`
  seconds after it when the failure was a quiet entry's (a hand-out check or a full bucket's
  least-recently-seen peer that did not answer): that is the surest sign that more entries died,
  and the one a node that never asks its dead entries anything gets.

A ping that fails evicts its entry the usual way (the node bans the peer and removes it, and a
replacement moves in) and may itself start the next sweep. This module decides; the node pings.
Times are DHT times, passed in.
"""

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Iterable

from ..p2p.identity import PeerID
from .routing import DHTID

MAX_REMEMBERED_CHECKS = 4096  # entries whose last hand-out check is remembered (oldest forgotten)


@dataclasses.dataclass(frozen=True)
class LivenessOptions:
    """When a node checks that its routing-table entries are alive (see the module docstring)."""

    stale_after: float | None = 2.0
    """An entry handed out in a find answer is pinged when nothing was heard from it for this many
    seconds (None: no hand-out checks)."""
    checks_per_second: float = 1.0
    """Average rate of hand-out checks (pings per second), so checking costs a healthy swarm little."""
    check_burst: int = 10
    """Hand-out checks that may go out at once before `checks_per_second` applies."""
    sweep_interval: float | None = 10.0
    """Least time between two sweeps that failed requests start (None: no sweeps); after a quiet
    entry failed its ping, `stale_after` instead."""
    sweep_concurrency: int = 128
    """Pings of one sweep in flight at once."""

    def __post_init__(self):
        if self.stale_after is not None and self.stale_after <= 0:
            raise ValueError(f"LivenessOptions.stale_after must be None or positive, got {self.stale_after}")
        if self.sweep_interval is not None and self.sweep_interval < 0:
            raise ValueError(
                f"LivenessOptions.sweep_interval must be None or >= 0, got {self.sweep_interval}"
            )
        if self.checks_per_second <= 0 or self.check_burst < 1 or self.sweep_concurrency < 1:
            raise ValueError(
                "LivenessOptions: checks_per_second must be positive, check_burst and "
                f"sweep_concurrency at least 1 (got {self.checks_per_second}, "
                f"{self.check_burst}, {self.sweep_concurrency})"
            )


class LivenessChecker:
    """Which entries to ping, and when to sweep; the node does the pinging."""

    def __init__(self, options: LivenessOptions):
        self.options = options
        self._tokens = float(options.check_burst)
        self._refilled_at: float | None = None
        self._checked: OrderedDict[DHTID, float] = OrderedDict()
        self._last_sweep = float("-inf")

    def _take_token(self, now: float) -> bool:
        if self._refilled_at is not None:
            elapsed = max(0.0, now - self._refilled_at)
            refilled = self._tokens + elapsed * self.options.checks_per_second
            self._tokens = min(float(self.options.check_burst), refilled)
        self._refilled_at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True

    def to_check(
        self,
        handed_out: Iterable[tuple[DHTID, PeerID]],
        last_seen: Callable[[DHTID], float | None],
        now: float,
    ) -> list[tuple[DHTID, PeerID]]:
        """Of the entries just named in an answer, those to ping now."""
        stale_after = self.options.stale_after
        if stale_after is None:
            return []
        due = []
        for node_id, peer_id in handed_out:
            seen = last_seen(node_id)
            checked = self._checked.get(node_id)
            recently_checked = checked is not None and now - checked < stale_after
            if seen is None or now - seen < stale_after or recently_checked:
                continue
            if not self._take_token(now):
                break
            self._checked[node_id] = now
            self._checked.move_to_end(node_id)
            while len(self._checked) > MAX_REMEMBERED_CHECKS:
                self._checked.popitem(last=False)
            due.append((node_id, peer_id))
        return due

    def sweep_after_failure(self, sent_at: float, now: float, quiet_entry: bool = False) -> float | None:
        """A request sent at `sent_at` failed (`quiet_entry`: a ping of an entry that had been quiet):
        the moment since which silent entries should be pinged, or None when the last sweep is too
        recent (or sweeps are off)."""
        interval = self.options.sweep_interval
        if interval is not None and quiet_entry and self.options.stale_after is not None:
            interval = min(interval, self.options.stale_after)
        if interval is None or now - self._last_sweep < interval:
            return None
        self._last_sweep = now
        return sent_at

    def __repr__(self) -> str:
        return f"LivenessChecker({self.options}, {self._tokens:.1f} checks available)"
