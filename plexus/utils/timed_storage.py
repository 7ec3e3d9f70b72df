"""A dictionary whose entries expire at absolute times, with an optional size cap.

Time is a parameter (`now`), so expiry is deterministic in tests; a call that leaves it out reads
the DHT clock (`get_dht_time`), as hivemind's TimedStorage does. Expired entries
vanish: every read first sweeps them out. Expirations sit in a heap with lazy deletion (an entry is
live only if it still matches the stored expiration); the heap is rebuilt when stale entries
outnumber live ones, so memory stays proportional to the live size. With `maxsize`, storing past
the cap evicts the entry that would expire soonest, which is the least useful one to keep.
Every entry that leaves (expired, evicted, removed or replaced) passes through `_forget`, so a
subclass can keep its own bookkeeping of what is held.
"""

import heapq
import itertools
from collections.abc import Hashable, Iterator
from typing import Generic, NamedTuple, TypeVar

from .timing import get_dht_time

KeyType = TypeVar("KeyType", bound=Hashable)
ValueType = TypeVar("ValueType")


class ValueWithExpiration(NamedTuple, Generic[ValueType]):
    """A value and the absolute DHT time after which it no longer exists; unpacks as a pair."""

    value: ValueType
    expiration_time: float


class TimedStorage(Generic[KeyType, ValueType]):
    """key -> (value, expiration_time); a store wins only with a later expiration than the current one."""

    def __init__(self, maxsize: int | None = None):
        if maxsize is not None and maxsize <= 0:
            raise ValueError(f"maxsize must be positive or None, got {maxsize}")
        self.maxsize = maxsize
        self.data: dict[KeyType, ValueWithExpiration[ValueType]] = {}
        self._heap: list[tuple[float, int, KeyType]] = []
        self._counter = itertools.count()

    def store(self, key: KeyType, value: ValueType, expiration_time: float, now: float | None = None) -> bool:
        """Keep `value` unless it is already expired or the current entry expires no earlier."""
        now = get_dht_time() if now is None else now
        self.remove_outdated(now)
        if expiration_time <= now:
            return False
        current = self.data.get(key)
        if current is not None and current.expiration_time >= expiration_time:
            return False
        self._put(key, ValueWithExpiration(value, expiration_time))
        if self.maxsize is not None:
            while len(self.data) > self.maxsize:
                self._pop_soonest()
        return key in self.data

    def _put(self, key: KeyType, item: ValueWithExpiration[ValueType]) -> None:
        previous = self.data.get(key)
        self.data[key] = item
        if previous is not None:
            self._forget(key, previous)
        heapq.heappush(self._heap, (item.expiration_time, next(self._counter), key))
        if len(self._heap) > 2 * len(self.data) + 16:
            self._heap = [(item.expiration_time, next(self._counter), k) for k, item in self.data.items()]
            heapq.heapify(self._heap)

    def _is_live(self, expiration_time: float, key: KeyType) -> bool:
        current = self.data.get(key)
        return current is not None and current.expiration_time == expiration_time

    def _pop_soonest(self) -> None:
        while self._heap:
            expiration_time, _, key = heapq.heappop(self._heap)
            if self._is_live(expiration_time, key):
                self._forget(key, self.data.pop(key))
                return

    def remove_outdated(self, now: float | None = None) -> None:
        now = get_dht_time() if now is None else now
        while self._heap and self._heap[0][0] <= now:
            expiration_time, _, key = heapq.heappop(self._heap)
            if self._is_live(expiration_time, key):
                self._forget(key, self.data.pop(key))

    def get(self, key: KeyType, now: float | None = None) -> ValueWithExpiration[ValueType] | None:
        self.remove_outdated(now)
        return self.data.get(key)

    def items(self, now: float | None = None) -> Iterator[tuple[KeyType, ValueWithExpiration[ValueType]]]:
        self.remove_outdated(now)
        return iter(list(self.data.items()))

    def top(self, now: float | None = None) -> tuple[KeyType, ValueWithExpiration[ValueType]] | None:
        """The entry that expires soonest (the next to vanish), or None when empty."""
        self.remove_outdated(now)
        while self._heap and not self._is_live(self._heap[0][0], self._heap[0][2]):
            heapq.heappop(self._heap)
        if not self._heap:
            return None
        key = self._heap[0][2]
        return key, self.data[key]

    def remove(self, key: KeyType) -> bool:
        """Forget `key` at once (its heap entry goes stale and is skipped later)."""
        item = self.data.pop(key, None)
        if item is None:
            return False
        self._forget(key, item)
        return True

    def _forget(self, key: KeyType, item: ValueWithExpiration[ValueType]) -> None:
        """Called for every entry that leaves (expired, evicted, removed or replaced); no-op here."""

    def __getitem__(self, key: KeyType) -> ValueWithExpiration[ValueType]:
        """The live entry for `key` (KeyError if there is none) at the current DHT time."""
        item = self.get(key)
        if item is None:
            raise KeyError(key)
        return item

    def __delitem__(self, key: KeyType) -> None:
        if not self.remove(key):
            raise KeyError(key)

    def __contains__(self, key: KeyType) -> bool:
        return key in self.data

    def __len__(self) -> int:
        return len(self.data)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self.data)} entries, maxsize={self.maxsize})"
