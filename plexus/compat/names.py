"""hivemind's spellings of things Plexus names differently or keeps elsewhere, for the hivemind
views (hook.py): `hivemind.utils` also holds `TensorDescriptor`, `MPFuture` and (in the older API)
`CompressionType`."""

from __future__ import annotations

import os
from typing import Any, NamedTuple

from ..compression.base import TensorDescriptor
from ..compression.wire import CompressionType
from ..utils.futures import AwaitableFuture
from ..utils.logging import remove_plexus_log_handler, use_plexus_log_handler

MPFuture = AwaitableFuture
"""hivemind's future: here a thread-safe future that asyncio code can await. It does not cross
processes (Plexus runs in one), so a child process cannot set its result."""


class HeapEntry(NamedTuple):
    """An expiration time and a key, ordered by expiration (hivemind's timed_storage)."""

    expiration_time: float
    key: Any


HANDLER_PLACES = {"in_hivemind": "plexus", "in_root_logger": "", "nowhere": None}


def use_hivemind_log_handler(where: str = "in_hivemind") -> None:
    """hivemind's switch for where its log format applies: "in_hivemind" (Plexus's own loggers),
    "in_root_logger" (every logger of the application) or "nowhere"."""
    where = getattr(where, "name", where).lower()  # hivemind also takes its HandlerMode enum
    if where not in HANDLER_PLACES:
        raise ValueError(f"where must be one of {sorted(HANDLER_PLACES)}, got {where!r}")
    for name in ("plexus", ""):
        remove_plexus_log_handler(name)
    logger_name = HANDLER_PLACES[where]
    if logger_name is not None:  # the level: HIVEMIND_LOGLEVEL, else PLEXUS_LOGLEVEL, else INFO
        use_plexus_log_handler(os.environ.get("HIVEMIND_LOGLEVEL"), logger_name=logger_name)


__all__ = ["CompressionType", "HeapEntry", "MPFuture", "TensorDescriptor", "use_hivemind_log_handler"]
