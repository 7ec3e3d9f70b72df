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


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)


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
