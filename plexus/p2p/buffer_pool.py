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


class DecryptBuffers:
    """Where a host's connections decrypt received batches: pooled buffers that streams may keep
    views of, and one scratch buffer for when all are held, whose contents are copied out before
    the next batch. The event loop decrypts one batch at a time, so all of a host's connections can
    share them: memory is bounded per host, not per connection (a peer averaging with 7 others
    held ~35 MiB of them with a pool and a scratch buffer per connection)."""

    def __init__(self, size: int, limit: int):
        self.pool = BufferPool(size, limit)
        self.scratch: mmap.mmap | None = None

    def get(self) -> tuple[mmap.mmap, bool]:
        """A buffer to decrypt into, and whether streams may keep views of it."""
        buffer = self.pool.get()
        if buffer is not None:
            return buffer, True
        if self.scratch is None:
            self.scratch = mmap.mmap(-1, self.pool.size)
        return self.scratch, False
