"""yamux: many flow-controlled streams over one secured connection.

Theory of operation
-------------------
Spec: hashicorp/yamux spec.md (framing, flags, flow control, keepalive, GO_AWAY), as used by
libp2p under "/yamux/1.0.0". Every frame starts with a 12-byte big-endian header:
version u8 (0) | type u8 | flags u16 | stream id u32 | length u32. DATA carries `length` payload
bytes; for WINDOW_UPDATE the length is a window delta, for PING an opaque value, for GO_AWAY an
error code. PING and GO_AWAY use stream id 0; DATA and WINDOW_UPDATE never do. The client (the
dialer of the connection) opens odd stream ids, the server even ones.

Stream life. A stream appears with a SYN flag and is acknowledged with ACK. We send both at once,
on a WINDOW_UPDATE that also grows the receive window from the spec's 256 KiB to
`initial_receive_window` (go-libp2p does the same; a 256 KiB window caps throughput at a fraction of
the link: `benchmarks/transport.py` measures it). Each direction is then OPEN until a FIN
(half-close) in that direction; a stream closed in both directions, or reset (RST) by either side,
is forgotten at once, so nothing leaks. Frames for forgotten streams are dropped (the peer may
still have had data in flight), their payload skipped within the usual size bound.

    per direction:  OPEN --FIN--> CLOSED          either side: any state --RST--> forgotten
    stream:         both directions CLOSED --> forgotten

Flow control. For each stream we track `recv_credit` (bytes the peer may still send us) and
`send_credit` (bytes we may still send). DATA beyond `recv_credit` is a RemoteProtocolError: the
peer overran the window we advertised. The application reports reads with `consumed()`; once half
the receive window has been read we send the read amount back as a WINDOW_UPDATE. Auto-tuning
(after go-yamux): when that half window was read within two round-trip times of the previous
update, the window is too small for the path and doubles, up to `max_receive_window`. Time is an
argument (`now`), never read from a clock; without it the window stays where it is. The round-trip
time comes from our own pings (pass `now` to `ping` and `receive_data`) or is set by the driver
(`session.rtt`); until known it is DEFAULT_RTT.

Parsing is incremental over a byte stream cut anywhere (Noise messages do not align with frames):
the core keeps at most one partial 12-byte header; DATA payload is handed out as DataReceived events
as soon as its bytes arrive (a frame cut in two yields two events), so nothing is buffered. The
payload is a memoryview slice of the input, not a copy: valid while the caller's buffer is.
Sending never copies the payload: `data_to_send()` returns the header bytes and the caller's
memoryview slices as separate chunks, in wire order.

Errors. A malformed frame, a window overrun, a duplicate SYN or a SYN with the wrong parity raises
RemoteProtocolError from `receive_data`; the core then queues GO_AWAY(protocol error) for the driver
to flush, and is terminal. Extra inbound streams beyond `max_streams`, or arriving after we sent
GO_AWAY, are refused with RST, not an error.

Left out: keepalive scheduling (the driver calls `ping`), accept backlogs (the driver bounds them),
and stream-id reuse checks beyond "not currently open".
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from plexus.p2p.protocols.errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "DataReceived",
    "GoAwayReceived",
    "PingReceived",
    "PongReceived",
    "StreamEnded",
    "StreamOpened",
    "StreamReset",
    "WindowUpdated",
    "YamuxSession",
    "encode_header",
]

VERSION = 0
TYPE_DATA, TYPE_WINDOW_UPDATE, TYPE_PING, TYPE_GO_AWAY = 0, 1, 2, 3
FLAG_SYN, FLAG_ACK, FLAG_FIN, FLAG_RST = 1, 2, 4, 8
GO_AWAY_NORMAL, GO_AWAY_PROTOCOL_ERROR, GO_AWAY_INTERNAL_ERROR = 0, 1, 2

HEADER = struct.Struct(">BBHII")
HEADER_SIZE = HEADER.size  # 12
SPEC_WINDOW = 256 << 10  # every stream starts with this window in both directions
MAX_U32 = (1 << 32) - 1
DEFAULT_RTT = 0.1  # seconds, assumed until a ping measures it

_pack = HEADER.pack
_unpack_from = HEADER.unpack_from


def encode_header(type_: int, flags: int, stream_id: int, length: int) -> bytes:
    return _pack(VERSION, type_, flags, stream_id, length)


# ----------------------------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class StreamOpened:
    """The peer opened a stream (SYN); the core has already acknowledged it."""

    stream_id: int


@dataclass(frozen=True, slots=True)
class DataReceived:
    """Payload bytes for a stream (a view of the input to `receive_data`: copy it, or keep the
    input unchanged, before reusing it); report them with `consumed()` once read."""

    stream_id: int
    data: memoryview


@dataclass(frozen=True, slots=True)
class StreamEnded:
    """The peer half-closed the stream (FIN): no more data will arrive on it."""

    stream_id: int


@dataclass(frozen=True, slots=True)
class StreamReset:
    """The peer reset the stream (RST); the core has forgotten it."""

    stream_id: int


@dataclass(frozen=True, slots=True)
class WindowUpdated:
    """Our send window on the stream grew: blocked writers may continue."""

    stream_id: int


@dataclass(frozen=True, slots=True)
class PingReceived:
    """The peer pinged us; the core has already queued the reply."""

    opaque: int


@dataclass(frozen=True, slots=True)
class PongReceived:
    """The peer answered one of our pings."""

    opaque: int


@dataclass(frozen=True, slots=True)
class GoAwayReceived:
    """The peer will accept no new streams; existing ones continue. Code 0 normal, 1 protocol, 2 internal."""

    code: int


# ---------------------------------------------------------------------------------------- streams


class _Stream:
    __slots__ = (
        "epoch_start",
        "local_closed",
        "read_pending",
        "recv_credit",
        "recv_window",
        "remote_closed",
        "send_credit",
        "stream_id",
        "unread",
    )

    def __init__(self, stream_id: int, recv_window: int):
        self.stream_id = stream_id
        self.send_credit = SPEC_WINDOW
        self.recv_window = recv_window  # target window; the update threshold is half of it
        self.recv_credit = recv_window  # what the peer may still send (our SYN/ACK carries the delta)
        self.unread = 0  # delivered to the application, not yet reported by consumed()
        self.read_pending = 0  # consumed but not yet returned to the peer in a WINDOW_UPDATE
        self.local_closed = False
        self.remote_closed = False
        self.epoch_start: float | None = None  # time of our last window update, for auto-tuning


# ---------------------------------------------------------------------------------------- session


class YamuxSession:
    """One side of a yamux connection. `is_client` is True for the side that dialed."""

    def __init__(
        self,
        *,
        is_client: bool,
        initial_receive_window: int = 1 << 20,
        # 16 MiB (go-yamux's default) holds one stream to ~0.6x of a 1 Gbit/s x 150 ms path (BDP 18 MB)
        # with window updates every half window; 64 MiB fills it. The window grows only while the
        # application reads that fast, so a slow reader never has more in flight to it.
        max_receive_window: int = 64 << 20,
        max_streams: int = 512,
    ):
        if not SPEC_WINDOW <= initial_receive_window <= max_receive_window <= MAX_U32:
            raise ValueError(
                f"need {SPEC_WINDOW} <= initial_receive_window ({initial_receive_window}) <= "
                f"max_receive_window ({max_receive_window}) <= {MAX_U32}"
            )
        if max_streams < 1:
            raise ValueError(f"max_streams must be positive, got {max_streams}")
        self.is_client = is_client
        self.initial_receive_window = initial_receive_window
        self.max_receive_window = max_receive_window
        self.max_streams = max_streams
        self.rtt: float | None = None  # seconds; measured by ping() / receive_data(now=...) or set here
        self._streams: dict[int, _Stream] = {}
        self._next_id = 1 if is_client else 2
        self._peer_parity = 0 if is_client else 1
        self._out: list = []
        self._out_bytes = 0
        self._local_go_away = False
        self._remote_go_away = False
        self._error: str | None = None
        self._ping_sent: tuple[int, float] | None = None
        # parser state: a partial header, or the rest of a DATA payload being delivered/skipped
        self._hdr = bytearray()
        self._payload_left = 0
        self._payload_stream: _Stream | None = None  # None while skipping a dropped frame's payload
        self._payload_flags = 0

    def __repr__(self) -> str:
        role = "client" if self.is_client else "server"
        going_away = self._local_go_away or self._remote_go_away
        state = "FAILED" if self._error else ("GOING_AWAY" if going_away else "OPEN")
        return f"<YamuxSession {role} {state} streams={len(self._streams)} queued={self._out_bytes}B>"

    # ------------------------------------------------------------------------- queries

    @property
    def stream_ids(self) -> list[int]:
        return list(self._streams)

    def send_window(self, stream_id: int) -> int:
        return self._stream(stream_id).send_credit

    def receive_window(self, stream_id: int) -> int:
        """The current target receive window of the stream (grows with auto-tuning)."""
        return self._stream(stream_id).recv_window

    def pending_bytes(self) -> int:
        return self._out_bytes

    def data_to_send(self) -> list:
        """Drain the queued chunks (bytes and memoryviews), in wire order."""
        out = self._out
        self._out = []
        self._out_bytes = 0
        return out

    # ------------------------------------------------------------------------- sending

    def open_stream(self) -> int:
        """Open an outbound stream; queues its SYN with our receive-window delta."""
        self._check_usable()
        if self._remote_go_away or self._local_go_away:
            raise LocalProtocolError("cannot open a stream: the session is going away (GO_AWAY exchanged)")
        if len(self._streams) >= self.max_streams:
            raise LocalProtocolError(f"cannot open a stream: {self.max_streams} streams are already open")
        stream_id = self._next_id
        if stream_id > MAX_U32:
            raise LocalProtocolError("stream ids exhausted on this session; open a new connection")
        self._next_id += 2
        self._streams[stream_id] = _Stream(stream_id, self.initial_receive_window)
        self._queue_header(TYPE_WINDOW_UPDATE, FLAG_SYN, stream_id, self.initial_receive_window - SPEC_WINDOW)
        return stream_id

    def send_data(self, stream_id: int, data, max_frame: int = 256 << 10) -> int:
        """Queue as much of `data` as the send window allows, without copying it; return bytes taken.

        Frames hold at most `max_frame` bytes. A short return means the window is exhausted: wait for
        WindowUpdated and send the rest.
        """
        stream = self._stream(stream_id)
        if stream.local_closed:
            raise LocalProtocolError(f"stream {stream_id}: cannot send after end_stream()")
        if max_frame < 1:
            raise LocalProtocolError(f"max_frame must be positive, got {max_frame}")
        total = min(len(data), stream.send_credit)
        if total <= 0:
            return 0
        view = data if isinstance(data, memoryview) else memoryview(data)
        if view.itemsize != 1 or view.ndim != 1:
            view = view.cast("B")
        out = self._out
        offset = 0
        while offset < total:
            size = min(max_frame, total - offset)
            out.append(_pack(VERSION, TYPE_DATA, 0, stream_id, size))
            out.append(view[offset : offset + size])
            offset += size
        self._out_bytes += total + HEADER_SIZE * len(range(0, total, max_frame))
        stream.send_credit -= total
        return total

    def end_stream(self, stream_id: int) -> None:
        """Half-close: we send no more data on the stream (FIN); the peer may still send."""
        stream = self._stream(stream_id)
        if stream.local_closed:
            raise LocalProtocolError(f"stream {stream_id}: end_stream() called twice")
        stream.local_closed = True
        self._queue_header(TYPE_WINDOW_UPDATE, FLAG_FIN, stream_id, 0)
        if stream.remote_closed:
            del self._streams[stream_id]

    def reset_stream(self, stream_id: int) -> None:
        """Abort the stream in both directions (RST) and forget it. A no-op for unknown streams,
        since the peer may have reset or closed it first."""
        self._check_usable()
        stream = self._streams.pop(stream_id, None)
        if stream is not None:
            if self._payload_stream is stream:
                self._payload_stream = None  # skip the rest of a frame being received for it
            self._queue_header(TYPE_WINDOW_UPDATE, FLAG_RST, stream_id, 0)

    def consumed(self, stream_id: int, n: int, now: float | None = None) -> None:
        """The application has read `n` bytes of the stream; returns window once half of it is read.

        `now` (seconds, any monotonic origin) enables auto-tuning of the window.
        Unknown streams are ignored: a reset may race with the application's read.
        """
        self._check_usable()
        stream = self._streams.get(stream_id)
        if stream is None:
            return
        if n < 0 or n > stream.unread:
            raise LocalProtocolError(
                f"stream {stream_id}: consumed({n}) but only {stream.unread} received bytes are unread"
            )
        stream.unread -= n
        stream.read_pending += n
        if stream.remote_closed or stream.read_pending < stream.recv_window // 2:
            return
        growth = 0
        if now is not None:
            if stream.epoch_start is not None and stream.recv_window < self.max_receive_window:
                rtt = self.rtt if self.rtt is not None else DEFAULT_RTT
                if now - stream.epoch_start < 2 * rtt:
                    new_window = min(stream.recv_window * 2, self.max_receive_window)
                    growth = new_window - stream.recv_window
                    stream.recv_window = new_window
            stream.epoch_start = now
        delta = stream.read_pending + growth
        stream.read_pending = 0
        stream.recv_credit += delta
        self._queue_header(TYPE_WINDOW_UPDATE, 0, stream_id, delta)

    def ping(self, opaque: int, now: float | None = None) -> None:
        """Send a PING; with `now`, its PONG (fed with `now` too) measures the round-trip time."""
        self._check_usable()
        if not 0 <= opaque <= MAX_U32:
            raise LocalProtocolError(f"ping opaque value must fit in 32 bits, got {opaque}")
        if now is not None:
            self._ping_sent = (opaque, now)
        self._queue_header(TYPE_PING, FLAG_SYN, 0, opaque)

    def go_away(self, code: int = GO_AWAY_NORMAL) -> None:
        """Tell the peer we accept no new streams; existing streams continue."""
        self._check_usable()
        if self._local_go_away:
            raise LocalProtocolError("go_away() already sent")
        if not 0 <= code <= MAX_U32:
            raise LocalProtocolError(f"go-away code must fit in 32 bits, got {code}")
        self._local_go_away = True
        self._queue_header(TYPE_GO_AWAY, 0, 0, code)

    # ------------------------------------------------------------------------- receiving

    def receive_data(self, data, now: float | None = None) -> list:
        """Parse bytes from the peer (cut anywhere) and return the events they complete.

        Raises RemoteProtocolError if the peer broke the protocol; a GO_AWAY(protocol error) is then
        queued and the session is terminal.
        """
        if self._error is not None:
            raise RemoteProtocolError(f"yamux session already failed: {self._error}")
        view = data if isinstance(data, memoryview) else memoryview(data)
        if view.itemsize != 1 or view.ndim != 1:
            view = view.cast("B")
        try:
            return self._parse(view, now)
        except RemoteProtocolError as exc:
            self._fail(str(exc))
            raise

    def _parse(self, view: memoryview, now: float | None) -> list:
        events: list = []
        pos = 0
        end = len(view)
        hdr = self._hdr
        while pos < end:
            if self._payload_left:
                take = min(self._payload_left, end - pos)
                stream = self._payload_stream
                if stream is not None:
                    events.append(DataReceived(stream.stream_id, view[pos : pos + take]))
                    stream.unread += take
                pos += take
                self._payload_left -= take
                if not self._payload_left:
                    self._end_of_frame(events)
                continue
            if hdr:
                need = HEADER_SIZE - len(hdr)
                hdr += view[pos : pos + need]
                pos += need
                if len(hdr) < HEADER_SIZE:
                    break
                fields = _unpack_from(hdr)
                hdr.clear()
            elif end - pos >= HEADER_SIZE:
                fields = _unpack_from(view, pos)
                pos += HEADER_SIZE
            else:
                hdr += view[pos:end]
                break
            self._on_header(fields, events, now)
        return events

    def _on_header(self, fields: tuple, events: list, now: float | None) -> None:
        version, type_, flags, stream_id, length = fields
        if version != VERSION:
            raise RemoteProtocolError(
                f"yamux frame with version {version} (only 0 exists); not a yamux peer?"
            )
        if type_ == TYPE_DATA or type_ == TYPE_WINDOW_UPDATE:
            if stream_id == 0:
                raise RemoteProtocolError(
                    f"yamux frame type {type_} on stream 0, which is reserved for the session"
                )
            self._on_stream_frame(type_, flags, stream_id, length, events)
        elif type_ == TYPE_PING:
            if stream_id != 0:
                raise RemoteProtocolError(f"yamux PING on stream {stream_id} (must be 0)")
            if flags & FLAG_SYN:
                self._queue_header(TYPE_PING, FLAG_ACK, 0, length)
                events.append(PingReceived(length))
            elif flags & FLAG_ACK:
                sent = self._ping_sent
                if sent is not None and sent[0] == length and now is not None:
                    self.rtt = max(now - sent[1], 0.0)
                    self._ping_sent = None
                events.append(PongReceived(length))
            else:
                raise RemoteProtocolError(f"yamux PING with flags {flags:#x}: neither SYN nor ACK")
        elif type_ == TYPE_GO_AWAY:
            if stream_id != 0:
                raise RemoteProtocolError(f"yamux GO_AWAY on stream {stream_id} (must be 0)")
            self._remote_go_away = True
            events.append(GoAwayReceived(length))
        else:
            raise RemoteProtocolError(f"unknown yamux frame type {type_}")

    def _on_stream_frame(self, type_: int, flags: int, stream_id: int, length: int, events: list) -> None:
        stream = self._streams.get(stream_id)
        if flags & FLAG_SYN:
            stream = self._on_syn(stream_id, stream, events)
        if stream is None:
            # Forgotten (closed, reset, refused) or never opened: drop, but keep the size bound.
            if type_ == TYPE_DATA:
                self._skip_payload(length, stream_id)
            return
        if flags & FLAG_RST:
            del self._streams[stream_id]
            events.append(StreamReset(stream_id))
            if type_ == TYPE_DATA:
                self._skip_payload(length, stream_id)
            return
        if type_ == TYPE_WINDOW_UPDATE:
            if length:
                stream.send_credit += length
                if stream.send_credit > MAX_U32:
                    raise RemoteProtocolError(
                        f"yamux stream {stream_id}: peer grew our send window past {MAX_U32} bytes"
                    )
                if not stream.local_closed:
                    events.append(WindowUpdated(stream_id))
            if flags & FLAG_FIN:
                self._on_fin(stream, events)
            return
        # DATA
        if length:
            if stream.remote_closed:
                raise RemoteProtocolError(
                    f"yamux stream {stream_id}: {length} bytes of data after the peer's FIN"
                )
            if length > stream.recv_credit:
                raise RemoteProtocolError(
                    f"yamux stream {stream_id}: peer sent a {length}-byte frame but its window was "
                    f"{stream.recv_credit} bytes (flow-control violation)"
                )
            stream.recv_credit -= length
            self._payload_left = length
            self._payload_stream = stream
            self._payload_flags = flags
        elif flags & FLAG_FIN:
            self._on_fin(stream, events)

    def _on_syn(self, stream_id: int, stream: _Stream | None, events: list) -> _Stream | None:
        if stream is not None:
            raise RemoteProtocolError(f"yamux: peer opened stream {stream_id} twice (duplicate SYN)")
        if stream_id % 2 != self._peer_parity:
            side = "client (odd ids)" if self.is_client else "server (even ids)"
            raise RemoteProtocolError(
                f"yamux: peer opened stream {stream_id}, but that id belongs to us, the {side}"
            )
        if self._local_go_away or len(self._streams) >= self.max_streams:
            self._queue_header(TYPE_WINDOW_UPDATE, FLAG_RST, stream_id, 0)
            return None
        stream = _Stream(stream_id, self.initial_receive_window)
        self._streams[stream_id] = stream
        self._queue_header(TYPE_WINDOW_UPDATE, FLAG_ACK, stream_id, self.initial_receive_window - SPEC_WINDOW)
        events.append(StreamOpened(stream_id))
        return stream

    def _skip_payload(self, length: int, stream_id: int) -> None:
        if length > self.max_receive_window:
            raise RemoteProtocolError(
                f"yamux stream {stream_id}: {length}-byte frame exceeds any window we advertise "
                f"({self.max_receive_window} bytes)"
            )
        self._payload_left = length
        self._payload_stream = None
        self._payload_flags = 0

    def _end_of_frame(self, events: list) -> None:
        stream = self._payload_stream
        self._payload_stream = None
        if stream is not None and self._payload_flags & FLAG_FIN:
            self._on_fin(stream, events)

    def _on_fin(self, stream: _Stream, events: list) -> None:
        if stream.remote_closed:
            return  # a repeated FIN changes nothing
        stream.remote_closed = True
        events.append(StreamEnded(stream.stream_id))
        if stream.local_closed:
            del self._streams[stream.stream_id]

    # ------------------------------------------------------------------------- plumbing

    def _stream(self, stream_id: int) -> _Stream:
        self._check_usable()
        stream = self._streams.get(stream_id)
        if stream is None:
            raise LocalProtocolError(f"yamux stream {stream_id} is not open (never opened, closed or reset)")
        return stream

    def _check_usable(self) -> None:
        if self._error is not None:
            raise LocalProtocolError(f"yamux session failed earlier: {self._error}")

    def _queue_header(self, type_: int, flags: int, stream_id: int, length: int) -> None:
        self._out.append(_pack(VERSION, type_, flags, stream_id, length))
        self._out_bytes += HEADER_SIZE

    def _fail(self, reason: str) -> None:
        self._error = reason
        self._streams.clear()
        self._payload_left = 0
        self._payload_stream = None
        self._hdr.clear()
        if not self._local_go_away:
            self._local_go_away = True
            self._queue_header(TYPE_GO_AWAY, 0, 0, GO_AWAY_PROTOCOL_ERROR)
