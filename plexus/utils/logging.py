"""Logging that reads like the tutorial: `Nov 30 09:00:00.123 [INFO] [module] message`.

The library never prints; it logs through `get_logger(__name__)`. Applications (our CLIs, the
example) call `use_plexus_log_handler()` once to get this format; the level comes from
PLEXUS_LOGLEVEL (default INFO).
"""

import logging
import os
import sys
import time
from collections import OrderedDict

_ROOT = "plexus"


class _Formatter(logging.Formatter):
    def formatTime(self, record, datefmt=None):  # noqa: N802 (logging's API name)
        return self.converter(record.created) and (
            logging.Formatter.formatTime(self, record, "%b %d %H:%M:%S") + f".{int(record.msecs):03d}"
        )

    def format(self, record):
        record.short_name = record.name.removeprefix(_ROOT + ".")
        return super().format(record)


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)


class RateLimitedLog:
    """Log each distinct event once per `interval` seconds (e.g. a peer's rejected record), so a
    flooding peer cannot flood the log too. Remembers at most `max_events` recent events."""

    def __init__(self, logger: logging.Logger, interval: float = 60.0, max_events: int = 1024,
                 clock=time.monotonic):
        self.logger, self.interval, self.max_events, self.clock = logger, interval, max_events, clock
        self._last: OrderedDict = OrderedDict()

    def log(self, level: int, event, message: str) -> bool:
        """Log `message` unless `event` was logged less than `interval` ago; True if logged."""
        now = self.clock()
        last = self._last.get(event)
        if last is not None and now - last < self.interval:
            return False
        self._last[event] = now
        self._last.move_to_end(event)
        while len(self._last) > self.max_events:
            self._last.popitem(last=False)
        self.logger.log(level, message)
        return True

    def warning(self, event, message: str) -> bool:
        return self.log(logging.WARNING, event, message)


def use_plexus_log_handler(level: str | None = None, stream=None) -> None:
    """Install the Plexus format on the `plexus` logger (idempotent)."""
    logger = logging.getLogger(_ROOT)
    level = level or os.environ.get("PLEXUS_LOGLEVEL", "INFO")
    logger.setLevel(level.upper())
    if any(getattr(handler, "_plexus", False) for handler in logger.handlers):
        return
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(_Formatter("%(asctime)s [%(levelname)s] [%(short_name)s] %(message)s"))
    handler._plexus = True
    logger.addHandler(handler)
    logger.propagate = False
