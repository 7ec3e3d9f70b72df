"""A yamux substream as an asyncio byte stream: read, write with flow control, half-close, reset.

The connection owns the yamux core and calls `_on_data`, `_on_eof`, `_on_reset` and
`_on_window` as frames arrive; the application only sees `read`/`readexactly`/`write`/`close`.
Received data is held in a deque of chunks; its size is bounded by the receive window we
advertise, because the peer may not send past it (yamux flow control does the back-pressure).
Large chunks are views of the connection's decrypted batches: reads copy them out exactly once.

Errors follow trio: StreamClosedError means *our* side closed the stream for writing or the
connection was closed locally; StreamResetError means the peer (or a broken connection) killed it.
"""

import asyncio
import itertools
from collections import deque

from ..errors import PeerError
from .identity import PeerID
from .protocols.multistream import MultistreamDialer
from .protocols.varint import MAX_VARINT_BYTES, encode_uvarint


class StreamError(PeerError, ConnectionError):
    """Base of stream errors."""


class StreamClosedError(StreamError):
    """We already closed this stream (or its connection) for writing."""


class StreamResetError(StreamError):
    """The peer reset the stream, or the connection under it broke."""


class Stream:
    """One bidirectional libp2p stream over a yamux session."""

    def __init__(self, connection, stream_id: int, protocol: str | None = None):
        self._connection = connection
        self.stream_id = stream_id
        self.protocol = protocol
        self._chunks: deque[bytes | memoryview] = deque()
        self._offset = 0  # read position inside self._chunks[0]
        self._buffered = 0
        self._unread_bytes = 0
        self.bytes_received = 0  # ever, negotiation included: how a deadline tells a silent stream
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()
        self._eof = self._write_closed = False
        self._reset_reason: str | None = None
        self._negotiation: MultistreamDialer | None = None  # its answer is read before any data

    @property
    def remote_peer(self) -> PeerID:
        return self._connection.remote_peer

    @property
    def connection(self):
        return self._connection

    @property
    def is_reset(self) -> bool:
        return self._reset_reason is not None

    # --- reading -------------------------------------------------------------------------------

    async def read(self, max_bytes: int = -1) -> bytes:
        """Return up to `max_bytes` (all buffered if -1) bytes, waiting for some; b"" at EOF."""
        if not await self._data_buffered():
            return b""
        if max_bytes < 0 or max_bytes >= self._buffered:
            return self._take(self._buffered)
        return self._take(max_bytes)

    async def _data_buffered(self) -> bool:
        """Wait until data is buffered (True) or the peer ended the stream (False)."""
        while True:
            if self._negotiation is not None and self._buffered:
                self._finish_negotiation(self._negotiation)
            if self._buffered and self._negotiation is None:
                return True
            if self._reset_reason is not None:
                raise StreamResetError(self._reset_reason)
            if self._eof:
                if self._negotiation is not None:
                    raise StreamResetError(f"peer closed the stream before accepting {self._negotiation}")
                return False
            self._readable.clear()
            await self._readable.wait()

    async def readexactly_chunks(self, n: int) -> list:
        """Exactly n bytes as the received chunks themselves (views, not joined): for a reader that
        copies them straight to where they belong. Raises asyncio.IncompleteReadError at an early EOF."""
        chunks: list[bytes | memoryview] = []
        missing = n
        while missing:
            if not await self._data_buffered():
                raise asyncio.IncompleteReadError(b"".join(chunks), n)
            taken = min(missing, self._buffered)
            chunks += self._take_views(taken)
            self._consumed(taken)
            missing -= taken
        return chunks

    async def readexactly(self, n: int) -> bytes:
        """Read exactly n bytes; raises asyncio.IncompleteReadError at an early EOF."""
        pieces: list[bytes] = []
        missing = n
        while missing:
            piece = await self.read(missing)
            if not piece:
                raise asyncio.IncompleteReadError(b"".join(pieces), n)
            pieces.append(piece)
            missing -= len(piece)
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    async def read_until_eof(self, limit: int) -> bytes:
        """Read everything up to EOF; raises StreamError if more than `limit` bytes arrive."""
        pieces, total = [], 0
        while piece := await self.read():
            total += len(piece)
            if total > limit:
                self.reset()
                raise StreamError(f"peer sent more than {limit} bytes on {self.protocol}")
            pieces.append(piece)
        return b"".join(pieces)

    def _peek(self, n: int) -> bytes:
        """Up to `n` bytes already received, without consuming them (b"" if none are), so a
        framing layer can parse a header in place and then read header and body in one call."""
        if self._negotiation is not None and self._buffered:
            self._finish_negotiation(self._negotiation)
        if self._negotiation is not None or not self._buffered:
            return b""
        chunk, offset = self._chunks[0], self._offset
        if len(chunk) - offset >= n or len(self._chunks) == 1:
            return bytes(chunk[offset : offset + n])
        head = bytearray(chunk[offset:])
        for chunk in itertools.islice(self._chunks, 1, None):
            head += chunk[: n - len(head)]
            if len(head) >= n:
                break
        return bytes(head)

    def _take(self, n: int) -> bytes:
        pieces = self._take_views(n)
        self._consumed(n)
        return bytes(pieces[0]) if len(pieces) == 1 else b"".join(pieces)

    def _take_views(self, n: int) -> list:
        """Remove n buffered bytes (n <= self._buffered) as slices of the chunks, copying nothing."""
        pieces, missing = [], n
        while missing:
            chunk = self._chunks[0]
            available = len(chunk) - self._offset
            if available <= missing:
                pieces.append(memoryview(chunk)[self._offset :] if self._offset else chunk)
                self._chunks.popleft()
                self._offset = 0
                missing -= available
            else:
                pieces.append(memoryview(chunk)[self._offset : self._offset + missing])
                self._offset += missing
                missing = 0
        return pieces

    def _consumed(self, n: int) -> None:
        """Account for n bytes handed to the reader (window updates for what the peer sent)."""
        self._buffered -= n
        returned = min(n, self._unread_bytes)  # bytes put back by _unread were counted already
        self._unread_bytes -= returned
        if n > returned:
            self._connection._stream_consumed(self.stream_id, n - returned)

    def _unread(self, data: bytes) -> None:
        """Put bytes that a protocol core read past its end back in front of the stream."""
        if not data:
            return
        if self._offset:
            self._chunks[0] = self._chunks[0][self._offset :]
            self._offset = 0
        self._chunks.appendleft(data)
        self._buffered += len(data)
        self._unread_bytes += len(data)
        self._readable.set()

    def _finish_negotiation(self, dialer: MultistreamDialer) -> None:
        """Feed buffered bytes to the lazily started multistream dialer until it has an answer."""
        dialer.receive_data(self._take(self._buffered))  # raises NegotiationError if the protocol was refused
        if dialer.selected is not None:
            self._negotiation = None
            self.protocol = dialer.selected
            self._unread(dialer.unused_data)

    # --- writing -------------------------------------------------------------------------------

    async def write(self, data) -> None:
        """Send all of `data`, waiting for the peer's receive window and the socket as needed."""
        view = memoryview(data).cast("B")
        while view:
            if self._reset_reason is not None:
                raise StreamResetError(self._reset_reason)
            if self._write_closed:
                raise StreamClosedError(f"stream {self.stream_id} is closed for writing")
            await self._connection._wait_writable()
            accepted = self._connection._send(self.stream_id, view)
            view = view[accepted:]
            if view and not accepted:
                self._writable.clear()
                await self._writable.wait()

    async def close(self) -> None:
        """Half-close: tell the peer we will send nothing more. Reading stays possible."""
        if not self._write_closed and self._reset_reason is None:
            self._write_closed = True
            self._connection._end_stream(self.stream_id)

    def reset(self) -> None:
        """Abort the stream in both directions (the peer sees a reset)."""
        if self._reset_reason is None:
            self._connection._reset_stream(self.stream_id)
            self._on_reset("reset locally")

    # --- called by the connection --------------------------------------------------------------

    def _on_data(self, data: bytes | memoryview) -> None:
        self.bytes_received += len(data)
        self._chunks.append(data)
        self._buffered += len(data)
        self._readable.set()

    def _on_eof(self) -> None:
        self._eof = True
        self._readable.set()

    def _on_reset(self, reason: str) -> None:
        if self._reset_reason is None:
            self._reset_reason = reason
        self._readable.set()
        self._writable.set()

    def _on_window(self) -> None:
        self._writable.set()

    def __repr__(self) -> str:
        state = "reset" if self.is_reset else "eof" if self._eof else "open"
        return f"<Stream {self.stream_id} {self.protocol} peer={self.remote_peer.short()} {state}>"


async def read_varint(stream: Stream) -> int | None:
    """Read an unsigned varint byte by byte; None at a clean EOF before its first byte."""
    value = shift = 0
    for index in range(MAX_VARINT_BYTES):
        byte = await stream.read(1)
        if not byte:
            if index == 0:
                return None
            raise StreamError("stream ended inside a varint")
        value |= (byte[0] & 0x7F) << shift
        if byte[0] < 0x80:
            return value
        shift += 7
    raise StreamError(f"varint longer than {MAX_VARINT_BYTES} bytes")


async def read_delimited(stream: Stream, max_size: int) -> bytes | None:
    """Read one varint-length-prefixed message (libp2p's usual framing); None at a clean EOF."""
    length = await read_varint(stream)
    if length is None:
        return None
    if length > max_size:
        stream.reset()
        raise StreamError(f"peer sent a {length}-byte message on {stream.protocol}; the limit is {max_size}")
    return await stream.readexactly(length) if length else b""


async def write_delimited(stream: Stream, data: bytes) -> None:
    await stream.write(encode_uvarint(len(data)) + data)
