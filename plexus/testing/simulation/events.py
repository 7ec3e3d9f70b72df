"""A discrete-event simulator: a virtual clock and a queue of callbacks, nothing else.

The protocol cores take `now` as an argument; the simulator's nodes pass `sim.now` and schedule
their timers and message deliveries here, so an hour of a 10,000-peer swarm runs in minutes of
real time and the same seed gives the same run. Events due at the same time run in the order
they were scheduled. A scheduled event can be cancelled (its callback is then skipped when due).
"""

import heapq
import itertools
import random


class Event:
    """A scheduled callback; `cancel()` keeps it from running."""

    __slots__ = ("args", "callback", "time")

    def __init__(self, time: float, callback, args: tuple):
        self.time, self.callback, self.args = time, callback, args

    def cancel(self) -> None:
        self.callback = None


class Simulator:
    """Virtual time (`now`, seconds from 0) and the events still to come."""

    def __init__(self, seed: int = 0):
        self.now = 0.0
        self.rng = random.Random(seed)
        self.events_run = 0
        self._queue: list[tuple[float, int, Event]] = []
        self._order = itertools.count()

    def at(self, time: float, callback, *args) -> Event:
        """Run `callback(*args)` at virtual `time` (not before now)."""
        event = Event(max(time, self.now), callback, args)
        heapq.heappush(self._queue, (event.time, next(self._order), event))
        return event

    def after(self, delay: float, callback, *args) -> Event:
        return self.at(self.now + delay, callback, *args)

    def run(self, until: float) -> None:
        """Run every event due up to `until`, then leave the clock there."""
        queue = self._queue
        while queue and queue[0][0] <= until:
            time, _, event = heapq.heappop(queue)
            if event.callback is not None:
                self.now = time
                event.callback(*event.args)
                self.events_run += 1
        self.now = max(self.now, until)

    @property
    def pending(self) -> int:
        return len(self._queue)

    def __repr__(self) -> str:
        return f"<Simulator t={self.now:.3f}s, {len(self._queue)} events pending, {self.events_run} run>"
