"""Which cached keys to re-fetch, and when: shortly before the cached copy expires.

Only keys that were actually read from the cache are scheduled (a key nobody reads is left to
expire), each at `expiration_time - cache_refresh_before_expiry`. Sans-I/O: the node asks for
`next_time()` to sleep until and for `pop_due(now)` when it wakes. Bounded by `max_size`; when
full, new keys are not scheduled (they are simply fetched again when next read).
"""

import heapq

from .routing import DHTID


class CacheRefreshQueue:
    def __init__(self, max_size: int = 10000):
        self.max_size = max_size
        self._due: dict[DHTID, float] = {}
        self._heap: list[tuple[float, DHTID]] = []

    def schedule(self, key: DHTID, refresh_time: float) -> bool:
        """Refresh `key` at `refresh_time` (the earlier time wins if it is already scheduled)."""
        current = self._due.get(key)
        if current is not None and current <= refresh_time:
            return False
        if current is None and len(self._due) >= self.max_size:
            return False
        self._due[key] = refresh_time
        heapq.heappush(self._heap, (refresh_time, key))
        if len(self._heap) > 2 * len(self._due) + 16:
            self._heap = [(time, key) for key, time in self._due.items()]
            heapq.heapify(self._heap)
        return True

    def _drop_stale(self) -> None:
        while self._heap and self._due.get(self._heap[0][1]) != self._heap[0][0]:
            heapq.heappop(self._heap)

    def next_time(self) -> float | None:
        self._drop_stale()
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: float) -> list[DHTID]:
        due = []
        self._drop_stale()
        while self._heap and self._heap[0][0] <= now:
            _, key = heapq.heappop(self._heap)
            del self._due[key]
            due.append(key)
            self._drop_stale()
        return due

    def __len__(self) -> int:
        return len(self._due)
