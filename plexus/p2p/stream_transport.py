"""Run a `Connection` over a libp2p `Stream` instead of a socket (relayed and tunnelled connections).

Theory of operation. A relayed connection is a whole new Noise + yamux session carried inside one
stream of another connection (circuit relay v2: the hop or stop stream). `Connection` is an asyncio
BufferedProtocol, so rather than teach it a second input path we give it a transport-shaped object:

- a reader pump task reads the stream and copies what arrives into `get_buffer()` /
  `buffer_updated()`, exactly as the event loop does for a socket; EOF becomes `eof_received()`;
- `write()` copies the bytes into a bounded queue drained by a writer task through
  `Stream.write` (so the outer yamux window gives back-pressure); above the high-water mark the
  protocol is paused with `pause_writing()` and resumed below the low-water mark;
- `close()` flushes the queue and half-closes the stream; `abort()` resets it at once (or, after a
  `close()`, lets the flush finish first, bounded by `CLOSE_TIMEOUT`). `connection_lost()` is called
  exactly once, from the loop, when both pumps are done.

Nothing of Noise, multistream or yamux is repeated here: the same Connection code runs on top.
`get_extra_info` knows no socket names; the creator sets `connection.remote_addr` (the circuit
address) itself.
"""

import asyncio
from collections import deque
from typing import cast

from ..utils.logging import get_logger
from .stream import Stream, StreamError

logger = get_logger(__name__)

READ_CHUNK = 64 << 10
DEFAULT_HIGH_WATER = 1 << 20
CLOSE_TIMEOUT = 10.0


class StreamTransport(asyncio.Transport):
    """An asyncio.Transport whose bytes travel over a libp2p Stream."""

    def __init__(self, stream: Stream, protocol: asyncio.BufferedProtocol, extra: dict | None = None):
        super().__init__(extra)
        self._stream, self._protocol = stream, protocol
        self._queue: deque[bytes] = deque()
        self._queued = 0
        self._high, self._low = DEFAULT_HIGH_WATER, DEFAULT_HIGH_WATER // 4
        self._paused = False
        self._closing = False  # close() was called: flush, then half-close
        self._aborted = False
        self._lost = False
        self._wakeup = asyncio.Event()
        loop = asyncio.get_running_loop()
        protocol.connection_made(self)
        self._reader = loop.create_task(self._read_pump())
        self._writer = loop.create_task(self._write_pump())
        self._reader.add_done_callback(self._pump_done)
        self._writer.add_done_callback(self._pump_done)

    # --- asyncio.Transport -----------------------------------------------------------------------

    def write(self, data) -> None:
        if self._closing or self._aborted:
            return
        data = bytes(data)  # the protocol reuses its buffer once we report nothing buffered
        if not data:
            return
        self._queue.append(data)
        self._queued += len(data)
        self._wakeup.set()
        if not self._paused and self._queued > self._high:
            self._paused = True
            self._protocol.pause_writing()

    def get_write_buffer_size(self) -> int:
        return self._queued

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._high = DEFAULT_HIGH_WATER if high is None else high
        self._low = self._high // 4 if low is None else low

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._low, self._high

    def is_closing(self) -> bool:
        return self._closing or self._aborted

    def close(self) -> None:
        """Send what is queued, then half-close the stream."""
        if not self._closing and not self._aborted:
            self._closing = True
            self._wakeup.set()

    def abort(self) -> None:
        """Reset the stream now, dropping queued bytes (after close(): let the flush finish first)."""
        if self._aborted:
            return
        if self._closing and not self._writer.done():
            self._writer.add_done_callback(lambda _: self._hard_abort())
            asyncio.get_running_loop().call_later(CLOSE_TIMEOUT, self._hard_abort)
            return
        self._hard_abort()

    def _hard_abort(self) -> None:
        if self._aborted:
            return
        self._aborted = True
        self._queue.clear()
        self._queued = 0
        self._stream.reset()
        self._reader.cancel()
        self._writer.cancel()

    def get_extra_info(self, name, default=None):
        if name == "stream":
            return self._stream
        return super().get_extra_info(name, default)

    def is_reading(self) -> bool:
        return not self._reader.done()

    # --- pumps --------------------------------------------------------------------------------------

    async def _read_pump(self) -> None:
        stream, protocol = self._stream, self._protocol
        try:
            while data := await stream.read(READ_CHUNK):
                view = memoryview(data)
                while view:
                    buffer = cast(memoryview, protocol.get_buffer(len(view)))  # a Connection's is one
                    n = min(len(buffer), len(view))
                    buffer[:n] = view[:n]
                    view = view[n:]
                    protocol.buffer_updated(n)
                    if self._aborted:
                        return
            if not self._aborted:
                protocol.eof_received()
        except (StreamError, ConnectionError) as error:
            logger.debug(f"relayed stream to {stream.remote_peer} broke: {error}")
            self._hard_abort()

    async def _write_pump(self) -> None:
        stream = self._stream
        try:
            while True:
                while self._queue:
                    data = self._queue.popleft()
                    await stream.write(data)
                    self._queued -= len(data)
                    if self._paused and self._queued <= self._low:
                        self._paused = False
                        self._protocol.resume_writing()
                if self._closing:
                    await stream.close()
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
        except (StreamError, ConnectionError) as error:
            logger.debug(f"writing to relayed stream to {stream.remote_peer} failed: {error}")
            self._hard_abort()

    def _pump_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.warning(f"stream transport pump failed: {task.exception()!r}")
            self._hard_abort()
        if self._reader.done() and (self._writer.done() or self._aborted) and not self._lost:
            self._lost = True
            if not self._aborted:
                self._hard_abort()  # the peer is gone both ways: release the outer stream
            self._protocol.connection_lost(None)

    def __repr__(self) -> str:
        state = "aborted" if self._aborted else "closing" if self._closing else "open"
        return f"<StreamTransport over {self._stream!r} {state} queued={self._queued}>"
