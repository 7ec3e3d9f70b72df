"""The last few warnings this process logged, kept in memory for the dashboard's "recent warnings".

A `logging.Handler` with a bounded deque: a peer that makes us log a warning a second costs a fixed
amount of memory, and each message is cut to `max_message_length` characters.
"""

import collections
import logging
import threading


class LogBuffer(logging.Handler):
    """Keeps the newest `capacity` records at `level` or above; `attach()` puts it on a logger."""

    def __init__(self, capacity: int = 200, level: int = logging.WARNING, max_message_length: int = 2000):
        super().__init__(level)
        if capacity < 1 or max_message_length < 1:
            raise ValueError("capacity and max_message_length must be at least 1")
        self.max_message_length = max_message_length
        self._records: collections.deque[dict] = collections.deque(maxlen=capacity)
        self._records_lock = threading.Lock()  # emit() runs on any thread that logs
        self._attached_to: logging.Logger | None = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except (TypeError, ValueError):  # a bad format string in someone's log call
            self.handleError(record)
            return
        entry = dict(
            time=record.created,
            level=record.levelname,
            logger=record.name,
            message=message[: self.max_message_length],
        )
        with self._records_lock:
            self._records.append(entry)

    def records(self) -> list[dict]:
        """The kept records, oldest first."""
        with self._records_lock:
            return list(self._records)

    def attach(self, logger_name: str = "plexus") -> "LogBuffer":
        self.detach()
        self._attached_to = logging.getLogger(logger_name)
        self._attached_to.addHandler(self)
        return self

    def detach(self) -> None:
        if self._attached_to is not None:
            self._attached_to.removeHandler(self)
            self._attached_to = None
