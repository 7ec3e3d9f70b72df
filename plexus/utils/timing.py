"""DHT time: plain wall-clock seconds, with a clock that tests can swap out.

Expirations in the DHT are absolute timestamps compared across machines, so every peer reads the
same kind of clock (`time.time`). There is no clock synchronisation; peers only compare clocks on
ping and warn on skew. Tests replace the clock with `use_clock` to move time without sleeping.
"""

import contextlib
import time
from collections.abc import Callable, Iterator

DHTExpiration = float
MAX_DHT_TIME_DISCREPANCY_SECONDS = 3.0  # peers whose clocks differ by more get a warning on ping
_clock: Callable[[], float] = time.time


def get_dht_time() -> DHTExpiration:
    """Current DHT time in seconds since the epoch (the clock every expiration is measured on)."""
    return _clock()


@contextlib.contextmanager
def use_clock(clock: Callable[[], float]) -> Iterator[None]:
    """Make `get_dht_time` read `clock` inside the block (tests: expiry without waiting)."""
    global _clock
    previous, _clock = _clock, clock
    try:
        yield
    finally:
        _clock = previous


class ManualClock:
    """A clock that stands still until advanced: `with use_clock(clock): ...; clock.advance(10)`."""

    def __init__(self, start: float | None = None):
        self.now = time.time() if start is None else start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
