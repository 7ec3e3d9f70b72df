"""Logging that reads like the tutorial: `Nov 30 09:00:00.123 [INFO] [module] message`.

The library never prints; it logs through `get_logger(__name__)`. Applications (our CLIs, the
example) call `use_plexus_log_handler()` once to get this format; the level comes from
PLEXUS_LOGLEVEL (default INFO). A script that configured no logging at all still sees what it asked
for, as with hivemind: `Optimizer(verbose=True)`, or PLEXUS_LOGLEVEL set in the environment, call
`use_default_log_handler()`, which installs the Plexus handler unless the application has handlers
of its own. That handler never prints the same line twice in a row: repeats are counted and
reported once, when a different line comes.

Events a peer can cause at will (a refused connection, a request over a limit) go through
`RateLimitedLog`, so a flooding peer gets one line that names it, not one line per attempt.
"""

import logging
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

_ROOT = "plexus"


class _Formatter(logging.Formatter):
    def formatTime(self, record, datefmt=None):
        return self.converter(record.created) and (
            logging.Formatter.formatTime(self, record, "%b %d %H:%M:%S") + f".{int(record.msecs):03d}"
        )

    def format(self, record):
        record.short_name = record.name.removeprefix(_ROOT + ".")
        return super().format(record)


class _Handler(logging.StreamHandler):
    """A stream handler that never writes the same line twice in a row (same logger, level and
    message): it counts the repeats and says how many there were before the next different line.
    Marked `_plexus`, so that it is added once and removed again by that mark."""

    _plexus = True

    def __init__(self, stream):
        super().__init__(stream)
        self._last: tuple | None = None
        self._repeats = 0

    def emit(self, record: logging.LogRecord) -> None:
        key = (record.name, record.levelno, record.getMessage())
        if key == self._last:
            self._repeats += 1
            return
        if self._repeats and self._last is not None:
            name, level, _ = self._last
            note = logging.LogRecord(
                name,
                level,
                __file__,
                0,
                f"(the line above was repeated {'once more' if self._repeats == 1 else f'{self._repeats} more times'})",
                None,
                None,
            )
            note.created, note.msecs = record.created, record.msecs
            super().emit(note)
        self._last, self._repeats = key, 0
        super().emit(record)


def eta_text(seconds: float, unknown_above: float = 1e6) -> str:
    """An ETA for people: "12.34 sec", or "unknown" when there is no sensible estimate (no speed
    measured yet, so an infinite or absurdly long time)."""
    if seconds != seconds or seconds > unknown_above:  # NaN, inf, or a speed of ~0 samples/s
        return "unknown"
    return f"{max(0.0, seconds):.2f} sec"


def get_logger(name: str | None = None) -> logging.Logger:
    """The logger for `name` (a module's `__name__`), or Plexus's own when no name is given."""
    return logging.getLogger(name or _ROOT)


def use_plexus_log_handler(level: str | None = None, stream=None, logger_name: str = _ROOT) -> None:
    """Install the Plexus format on the `plexus` logger, or on another one such as the root
    logger (`logger_name=""`) to format an application's own logs too (idempotent)."""
    logger = logging.getLogger(logger_name)
    level = level or os.environ.get("PLEXUS_LOGLEVEL", "INFO")
    logger.setLevel(level.upper())
    if any(getattr(handler, "_plexus", False) for handler in logger.handlers):
        return
    handler = _Handler(stream or sys.stderr)
    handler.setFormatter(_Formatter("%(asctime)s [%(levelname)s] [%(short_name)s] %(message)s"))
    logger.addHandler(handler)
    if logger_name == _ROOT:
        logger.propagate = False


def application_configured_logging() -> bool:
    """Whether the application installed handlers (on the root or the `plexus` logger) itself."""
    return bool(logging.getLogger().handlers or logging.getLogger(_ROOT).handlers)


def use_default_log_handler() -> bool:
    """Install the Plexus handler on the `plexus` logger unless the application configured logging;
    True if it did (see the module docstring)."""
    if application_configured_logging():
        return False
    use_plexus_log_handler()
    return True


def remove_plexus_log_handler(logger_name: str = _ROOT) -> None:
    """Undo `use_plexus_log_handler` on that logger."""
    logger = logging.getLogger(logger_name)
    for handler in [h for h in logger.handlers if getattr(h, "_plexus", False)]:
        logger.removeHandler(handler)
    if logger_name == _ROOT:
        logger.propagate = True


class RateLimitedLog:
    """Log each kind of event once per `interval` per key, and at most `per_kind` lines per kind.

    A key is `(kind, peer)` or any hashable whose first item is the kind ("connections per peer",
    "ping rate", ...). Occurrences that were not logged are counted and reported with the next line
    logged for the same kind, so nothing is lost but the repetition. Memory is bounded by `max_keys`.
    """

    def __init__(
        self,
        logger: logging.Logger,
        *,
        interval: float = 60.0,
        per_kind: int = 10,
        max_keys: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.logger, self.interval, self.per_kind, self.max_keys = logger, interval, per_kind, max_keys
        self._clock = clock
        self._last: OrderedDict[Hashable, float] = OrderedDict()  # key -> when it was last logged
        self._kinds: dict[Hashable, list] = {}  # kind -> [window start, lines in window, suppressed]

    def warning(self, key: tuple, message: str) -> bool:
        return self.log(logging.WARNING, key, message)

    def log(self, level: int, key: tuple, message: str) -> bool:
        """Log `message` unless this key or its kind was logged too often lately; True if logged."""
        now, kind = self._clock(), key[0]
        window = self._kinds.setdefault(kind, [now, 0, 0])
        if now - window[0] >= self.interval:
            window[0], window[1] = now, 0
        last = self._last.get(key)
        if (last is not None and now - last < self.interval) or window[1] >= self.per_kind:
            window[2] += 1
            return False
        self._last[key] = now
        self._last.move_to_end(key)
        while len(self._last) > self.max_keys:
            self._last.popitem(last=False)
        window[1] += 1
        if window[2]:
            message += f" ({window[2]} more like it not logged)"
            window[2] = 0
        self.logger.log(level, message)
        return True
