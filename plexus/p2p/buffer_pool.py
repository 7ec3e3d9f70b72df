"""Reusable I/O buffers that are handed out again only once nothing still looks at them.

A connection decrypts received batches into buffers that streams keep views of until the
application reads them, and encrypts into buffers that asyncio's transport may keep a view of
until the socket takes them (Python 3.12+). Allocating a fresh buffer per batch costs page faults
and zeroing on every megabyte; reusing one that is still viewed corrupts data. The pool asks
CPython instead: a buffer object nobody else references (no live memoryview keeps it alive) is
free. Buffers are anonymous mappings, so their pages take memory only once written.
"""

import mmap
import sys


class BufferPool:
    """At most `limit` buffers of `size` bytes; `get()` returns a free one, or None at the limit."""

    def __init__(self, size: int, limit: int):
        self.size, self.limit = size, limit
        self._buffers: list[mmap.mmap] = []

    def get(self) -> mmap.mmap | None:
        for buffer in self._buffers:
            if sys.getrefcount(buffer) == 3:  # the list, `buffer` and the argument: nobody else
                return buffer
        if len(self._buffers) < self.limit:
            self._buffers.append(mmap.mmap(-1, self.size))
            return self._buffers[-1]
        return None

    def __len__(self) -> int:
        return len(self._buffers)
