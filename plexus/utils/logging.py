"""Logging that reads like the tutorial: `Nov 30 09:00:00.123 [INFO] [module] message`.

The library never prints; it logs through `get_logger(__name__)`. Applications (our CLIs, the
example) call `use_plexus_log_handler()` once to get this format; the level comes from
PLEXUS_LOGLEVEL (default INFO).
"""

import logging
import os
import sys

_ROOT = "plexus"


class _Formatter(logging.Formatter):
    def formatTime(self, record, datefmt=None):  # noqa: N802 (logging's API name)
        return self.converter(record.created) and (
            logging.Formatter.formatTime(self, record, "%b %d %H:%M:%S") + f".{int(record.msecs):03d}"
        )

    def format(self, record):
        record.short_name = record.name.removeprefix(_ROOT + ".")
        return super().format(record)


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
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(_Formatter("%(asctime)s [%(levelname)s] [%(short_name)s] %(message)s"))
    handler._plexus = True
    logger.addHandler(handler)
    if logger_name == _ROOT:
        logger.propagate = False


def remove_plexus_log_handler(logger_name: str = _ROOT) -> None:
    """Undo `use_plexus_log_handler` on that logger."""
    logger = logging.getLogger(logger_name)
    for handler in [h for h in logger.handlers if getattr(h, "_plexus", False)]:
        logger.removeHandler(handler)
    if logger_name == _ROOT:
        logger.propagate = True
