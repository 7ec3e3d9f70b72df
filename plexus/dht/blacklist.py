"""Peers that failed to answer are skipped for a while, longer each time they fail again.

A failure bans the peer for `base_time * backoff_rate ** (failures before this one)`, capped at
`max_ban_time`; any success clears its record. Time is a parameter. The table is bounded: past
`max_peers` entries the oldest record is forgotten (the worst that does is one wasted request).
"""

from ..p2p.identity import PeerID


class Blacklist:
    def __init__(
        self,
        base_time: float = 5.0,
        backoff_rate: float = 2.0,
        max_ban_time: float = 3600.0,
        max_peers: int = 10000,
    ):
        if base_time < 0 or backoff_rate < 1:
            raise ValueError("blacklist_time must be >= 0 and backoff_rate >= 1")
        self.base_time, self.backoff_rate = base_time, backoff_rate
        self.max_ban_time, self.max_peers = max_ban_time, max_peers
        self._failures: dict[PeerID, int] = {}
        self._banned_until: dict[PeerID, float] = {}

    def register_failure(self, peer_id: PeerID, now: float) -> float:
        """Ban the peer; returns the ban's length in seconds."""
        failures = self._failures.pop(peer_id, 0)
        ban = min(self.base_time * self.backoff_rate ** min(failures, 64), self.max_ban_time)
        self._failures[peer_id] = failures + 1
        self._banned_until.pop(peer_id, None)
        self._banned_until[peer_id] = now + ban
        while len(self._failures) > self.max_peers:
            oldest = next(iter(self._failures))
            del self._failures[oldest]
            self._banned_until.pop(oldest, None)
        return ban

    def register_success(self, peer_id: PeerID) -> None:
        self._failures.pop(peer_id, None)
        self._banned_until.pop(peer_id, None)

    def is_banned(self, peer_id: PeerID, now: float) -> bool:
        until = self._banned_until.get(peer_id)
        return until is not None and until > now

    def banned_until(self, peer_id: PeerID) -> float | None:
        return self._banned_until.get(peer_id)

    def __len__(self) -> int:
        return len(self._failures)

    def __repr__(self) -> str:
        return f"Blacklist({len(self)} peers, base={self.base_time}s, rate={self.backoff_rate})"
