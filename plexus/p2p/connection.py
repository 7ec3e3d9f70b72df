"""One libp2p connection: TCP, upgraded with multistream-select to Noise, then to yamux.

Security: the dialer proposes its Noise cipher suites in order of preference (by default AESGCM
under Plexus's own protocol id, then libp2p's "/noise"), the listener takes the first it also
has. The host's dials are optimistic: the first Noise message leaves with the first proposal, so a
Plexus peer is reached in one round trip less. Another libp2p peer answers "na" to it and reads the
Noise message as garbage; the host then dials it again proposing one suite at a time (and
remembers to, for that peer).

Theory of operation. The connection is an asyncio BufferedProtocol reading into one linear
buffer. During the upgrade, an `_upgrade` coroutine pulls bytes from that buffer and feeds the
multistream and Noise cores. Once yamux is agreed, every read goes through the fast path in
`buffer_updated`: Noise frames are decrypted in place into a second buffer (`open_into`), the
plaintext is fed to the yamux core, and its events are dispatched to Stream objects. Writes go
the other way: the yamux core queues headers and memoryviews of the caller's data, `_flush` packs
them into Noise messages of the maximum size, encrypts them into a reusable output buffer and hands
a few messages at a time to the socket (`benchmarks/transport.py` measures the effect).

Copies. Received payload is copied once, when a reader takes it from its stream: each batch of
Noise messages is decrypted into a plaintext buffer from a small pool shared by the host's
connections (`DecryptBuffers`), and streams keep memoryviews of their large pieces
(SHARED_PIECE_MIN or more); a buffer goes back to the pool when no stream holds a view of it (its
reference count says so). Small pieces are copied at once, so a few idle bytes never pin a whole
buffer, and when every pooled buffer is held the batch goes to a scratch buffer and is copied out,
so memory stays bounded by MAX_PLAINTEXT_BUFFERS per host however many connections it has. Output
buffers come from a second pool: one is reused after each write unless the transport kept a view
of it (asyncio does on Python 3.12+, until the bytes are sent; earlier versions copy what the
socket did not take).

Coalescing. Control frames (stream opens, window updates, FIN/RST) are only queued, with one
flush scheduled by `call_soon` for the next loop iteration. A write flushes at once (zero-copy,
taking whatever was queued before it along, in order), unless it is small (up to COALESCE_LIMIT)
and a flush is already scheduled: then it joins that flush, copied first if the caller's buffer is
mutable (it may reuse it once `write` returns). So a unary RPC (SYN, multistream proposal, request,
FIN; on the other side ACK, answer, response, FIN) leaves in one Noise message and one send instead
of one each, while a lone write, as in a request/response ping-pong on an open stream, still goes
out without waiting a loop iteration. A queue grown to a full Noise message is flushed at once.

Bounds: the receive buffer never holds more than one partial Noise frame besides new data, the
upgrade has a deadline, and any RemoteProtocolError closes this connection alone, with the reason
logged.
"""

import asyncio
import enum
import mmap
import sys
import time
from collections.abc import Sequence

from ..errors import PeerError
from ..utils.logging import get_logger
from .buffer_pool import BufferPool, DecryptBuffers
from .identity import PeerID, PrivateKey, PublicKey
from .multiaddr import Multiaddr, from_socket_address
from .protocols import yamux
from .protocols.errors import ProtocolError, RemoteProtocolError
from .protocols.multistream import MultistreamDialer, MultistreamListener, NegotiationError
from .protocols.noise import SUITES, CipherSuite, NoiseHandshake, NoiseTransport
from .protocols.relay import Limit
from .stream import Stream

logger = get_logger(__name__)

YAMUX_PROTOCOL = "/yamux/1.0.0"
RECEIVE_BUFFER_SIZE = 1 << 20
MAX_PLAINTEXT_BUFFERS = 8  # per host: RECEIVE_BUFFER_SIZE each, held by unread stream data
MAX_OUTPUT_BUFFERS = 32  # per connection, ~256 KiB each, held by the transport until sent (Python 3.12+)
SHARED_PIECE_MIN = 64 << 10  # smaller received pieces are copied at once instead of pinning a buffer
MIN_FREE_SPACE = 128 << 10
NOISE_MESSAGES_PER_WRITE = 4
WRITE_HIGH_WATER = 4 << 20
COALESCE_LIMIT = 32 << 10  # writes up to this size join a flush already scheduled


def host_decrypt_buffers() -> DecryptBuffers:
    """The decrypt buffers that all of one host's connections share (see the module comment)."""
    return DecryptBuffers(RECEIVE_BUFFER_SIZE, MAX_PLAINTEXT_BUFFERS)


class TrafficCounter:
    """Bytes a host's connections moved over their sockets (encryption and framing included): how
    callers measure what a protocol costs on the wire. One per host, shared by its connections."""

    __slots__ = ("bytes_received", "bytes_sent")

    def __init__(self):
        self.bytes_sent = self.bytes_received = 0

    def snapshot(self) -> tuple[int, int]:
        """(bytes sent, bytes received) so far."""
        return self.bytes_sent, self.bytes_received


class Phase(enum.Enum):
    UPGRADING = "upgrading"
    MUXED = "muxed"
    CLOSED = "closed"


class ConnectionClosedError(PeerError, ConnectionError):
    """The connection is closed (its streams are reset)."""


class OptimismRefused(PeerError, ConnectionError):
    """The listener did not take the cipher suite we sent our first Noise message behind."""


class Connection(asyncio.BufferedProtocol):
    """A secured, multiplexed connection to one peer. Created by the Host."""

    def __init__(
        self,
        local_key: PrivateKey,
        *,
        initiator: bool,
        expected_peer: PeerID | None = None,
        on_stream=None,
        on_close=None,
        max_streams: int = 512,
        noise_suites: tuple[CipherSuite, ...] = tuple(SUITES.values()),
        decrypt_buffers: DecryptBuffers | None = None,
        traffic: TrafficCounter | None = None,
    ):
        self.local_key, self.initiator, self.expected_peer = local_key, initiator, expected_peer
        self.noise_suites = noise_suites  # most preferred first
        self.noise_suite: CipherSuite | None = None  # the one agreed on
        self.remote_peer: PeerID | None = None  # known once upgraded (see `peer`)
        self.remote_public_key: PublicKey | None = None
        self.remote_addr: Multiaddr | None = None
        self.local_addr: Multiaddr | None = None
        self.phase = Phase.UPGRADING
        self.close_reason: str | None = None
        self.streams: dict[int, Stream] = {}
        self._on_stream, self._on_close, self._max_streams = on_stream, on_close, max_streams
        self._transport: asyncio.Transport | None = None
        # Buffers are anonymous mappings: their pages take memory only once written, where
        # zero-filled bytearrays would cost megabytes per connection at once, busy or idle.
        self._memory = mmap.mmap(-1, RECEIVE_BUFFER_SIZE + NoiseTransport.MAX_PLAINTEXT)
        memory = memoryview(self._memory)
        self._buffer = memory[:RECEIVE_BUFFER_SIZE]
        self._view = self._buffer
        self._start = self._end = 0
        self._decrypt_buffers = (
            decrypt_buffers or host_decrypt_buffers()
        )  # a connection without a host: its own
        self.traffic = traffic or TrafficCounter()  # a connection without a host: its own
        self._data_arrived = asyncio.Event()
        self._made = asyncio.Event()
        self._eof_received = False
        # Made by the upgrade; used only once it is done (phase MUXED, or streams that exist).
        self._noise: NoiseTransport
        self._yamux: yamux.YamuxSession
        # Set on relayed connections by the relay client (relay.py).
        self.relayed = False
        self.relay_limit: Limit | None = None
        self.relay_observed_addrs: Sequence[Multiaddr] = ()
        self._outputs = BufferPool(
            NOISE_MESSAGES_PER_WRITE * (NoiseTransport.MAX_PLAINTEXT + 18), MAX_OUTPUT_BUFFERS
        )
        out = self._outputs.get()
        assert out is not None  # a new pool has room
        self._out: mmap.mmap = out
        self._staging = memory[RECEIVE_BUFFER_SIZE:]
        self._can_write = asyncio.Event()
        self._can_write.set()
        self._flush_scheduled = False
        self.closed = asyncio.Event()
        self.last_activity = 0.0

    # --- asyncio protocol callbacks --------------------------------------------------------------

    def connection_made(self, transport) -> None:
        if self.phase is Phase.CLOSED:  # refused before the socket arrived (e.g. connection limit)
            transport.abort()
            return
        self._transport = transport
        self._made.set()
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        self.last_activity = asyncio.get_running_loop().time()
        sockname, peername = transport.get_extra_info("sockname"), transport.get_extra_info("peername")
        if peername:
            self.remote_addr = from_socket_address(peername[0], peername[1])
        if sockname:
            self.local_addr = from_socket_address(sockname[0], sockname[1])

    def get_buffer(self, sizehint: int) -> memoryview:
        if len(self._buffer) - self._end < MIN_FREE_SPACE:
            self._compact()
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        self._end += nbytes
        self.traffic.bytes_received += nbytes
        if self.phase is Phase.MUXED:
            try:
                self._receive_muxed()
            except ProtocolError as error:
                self.abort(f"protocol error: {error}")
        else:
            self._data_arrived.set()

    def eof_received(self) -> bool:
        self._eof_received = True
        self._data_arrived.set()
        self.abort("peer closed the connection")
        return False

    def connection_lost(self, exc) -> None:
        self._transport = None
        self.abort(f"connection lost: {exc}" if exc else "connection lost")

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    # --- the upgrade ----------------------------------------------------------------------------

    async def upgrade(self, optimistic: bool = False) -> None:
        """Negotiate Noise, authenticate the peer, negotiate yamux. Raises on any failure.

        With `optimistic`, a dialer sends its first Noise message right behind its first cipher suite's proposal instead of
        waiting for the answer; a listener that refuses that suite reads the Noise message as
        garbage, so that failure raises OptimismRefused and the caller dials again without it."""
        try:
            await self._made.wait()
            if self.initiator and optimistic:
                handshake = await self._secure_optimistically()
            else:
                suites = {suite.protocol_id: suite for suite in self.noise_suites}
                self.noise_suite = suites[await self._negotiate_plaintext(list(suites))]
                handshake = self._handshake()
                self._write_raw(handshake.data_to_send())
            while not handshake.complete:
                handshake.receive_data(await self._read_raw())
                self._write_raw(handshake.data_to_send())
            self.remote_peer, self.remote_public_key = handshake.remote_peer_id, handshake.remote_public_key
            self._noise = handshake.to_transport()
            self._prepend_raw(self._noise.pending)
            leftover = await self._negotiate_encrypted(YAMUX_PROTOCOL)
        except BaseException as error:
            self.abort(f"upgrade failed: {error!r}")
            raise
        self._yamux = yamux.YamuxSession(is_client=self.initiator, max_streams=self._max_streams)
        self.phase = Phase.MUXED
        if leftover or self._start < self._end:
            self._plain_input(leftover)

    def _handshake(self) -> NoiseHandshake:
        assert self.noise_suite is not None, "a suite is chosen before the handshake starts"
        return NoiseHandshake(
            self.local_key,
            initiator=self.initiator,
            expected_peer=self.expected_peer,
            suite=self.noise_suite,
        )

    async def _secure_optimistically(self) -> NoiseHandshake:
        """Propose our first suite and send the first Noise message in the same write."""
        self.noise_suite = self.noise_suites[0]
        core = MultistreamDialer([self.noise_suite.protocol_id])
        handshake = self._handshake()
        self._write_raw(core.data_to_send() + handshake.data_to_send())
        try:
            while core.selected is None:
                core.receive_data(await self._read_raw())
        except (NegotiationError, ConnectionError) as error:
            raise OptimismRefused(
                f"the listener did not take {self.noise_suite.protocol_id} with the Noise message sent "
                f"along ({error})"
            ) from error
        self._prepend_raw(core.unused_data)
        return handshake

    async def _negotiate_plaintext(self, protocols: list[str]) -> str:
        core = MultistreamDialer(protocols) if self.initiator else MultistreamListener(protocols)
        self._write_raw(core.data_to_send())
        while core.selected is None:
            core.receive_data(await self._read_raw())
            self._write_raw(core.data_to_send())
        self._prepend_raw(core.unused_data)
        return core.selected

    async def _negotiate_encrypted(self, protocol: str) -> bytes:
        core = MultistreamDialer([protocol]) if self.initiator else MultistreamListener([protocol])
        self._write_encrypted(core.data_to_send())
        while core.selected is None:
            core.receive_data(await self._read_decrypted())
            self._write_encrypted(core.data_to_send())
        return core.unused_data

    async def _read_raw(self) -> bytes:
        while self._start == self._end:
            if self._eof_received or self.phase is Phase.CLOSED:
                raise ConnectionClosedError(
                    self.close_reason or "peer closed the connection during the upgrade"
                )
            self._data_arrived.clear()
            await self._data_arrived.wait()
        data = bytes(self._view[self._start : self._end])
        self._start = self._end = 0
        return data

    async def _read_decrypted(self) -> bytes:
        while True:
            if self._start < self._end:
                plain, _ = self._decrypt_buffers.get()
                consumed, produced = self._noise.open_into(self._view[self._start : self._end], plain)
                self._start += consumed
                if produced:
                    return plain[:produced]
            if self._eof_received or self.phase is Phase.CLOSED:
                raise ConnectionClosedError(
                    self.close_reason or "peer closed the connection during the upgrade"
                )
            self._data_arrived.clear()
            await self._data_arrived.wait()

    def _prepend_raw(self, data: bytes) -> None:
        """Put bytes that a core read past its end back in front of the receive buffer."""
        if data:
            rest = bytes(self._view[self._start : self._end])
            self._start, self._end = 0, len(data) + len(rest)
            self._buffer[: self._end] = data + rest

    def _write_raw(self, data: bytes) -> None:
        if data and self._transport is not None:
            self._transport.write(data)
            self.traffic.bytes_sent += len(data)

    def _write_encrypted(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            piece, view = view[: NoiseTransport.MAX_PLAINTEXT], view[NoiseTransport.MAX_PLAINTEXT :]
            end = self._noise.seal_into(piece, self._out, 0)
            self._write_raw(bytes(self._out[:end]))

    # --- the muxed fast path --------------------------------------------------------------------

    def _compact(self) -> None:
        pending = self._end - self._start
        if pending and self._start:
            self._buffer[:pending] = self._view[self._start : self._end]
        self._start, self._end = 0, pending
        if len(self._buffer) - self._end < MIN_FREE_SPACE:  # cannot happen with frames <= 64 KiB
            raise RemoteProtocolError("receive buffer overflow")

    def _receive_muxed(self) -> None:
        plain, shareable = self._decrypt_buffers.get()
        consumed, produced = self._noise.open_into(self._view[self._start : self._end], plain)
        self._start += consumed
        if self._start == self._end:
            self._start = self._end = 0
        if produced:
            with memoryview(plain) as view:
                self._dispatch(self._yamux.receive_data(view[:produced], now=time.monotonic()), shareable)
        if self._yamux.pending_bytes():  # pongs, window updates; streams woken above may add replies
            self._flush_soon()

    def _plain_input(self, leftover: bytes) -> None:
        try:
            if leftover:
                self._dispatch(self._yamux.receive_data(leftover, now=time.monotonic()), True)
            self._receive_muxed()
        except ProtocolError as error:
            self.abort(f"protocol error: {error}")

    def _dispatch(self, events, shareable: bool) -> None:
        """Hand the yamux events to the streams; DATA is a view of the decrypted batch, kept as is
        only when `shareable` and large (streams copy it once, when read)."""
        self.last_activity = asyncio.get_running_loop().time()
        streams = self.streams
        for event in events:
            kind = type(event)
            if kind is yamux.DataReceived:
                stream = streams.get(event.stream_id)
                if stream is not None:
                    data = event.data
                    stream._on_data(data if shareable and len(data) >= SHARED_PIECE_MIN else bytes(data))
            elif kind is yamux.StreamOpened:
                stream = streams[event.stream_id] = Stream(self, event.stream_id)
                if self._on_stream is not None:
                    self._on_stream(stream)
            elif kind is yamux.WindowUpdated:
                stream = streams.get(event.stream_id)
                if stream is not None:
                    stream._on_window()
            elif kind is yamux.StreamEnded:
                stream = streams.get(event.stream_id)
                if stream is not None:
                    stream._on_eof()
                    self._forget_if_done(stream)
            elif kind is yamux.StreamReset:
                stream = streams.pop(event.stream_id, None)
                if stream is not None:
                    stream._on_reset("stream reset by peer")
            elif kind is yamux.GoAwayReceived:
                logger.debug(f"{self}: peer sent go-away (code {event.code})")

    def _flush(self) -> None:
        """Encrypt everything the yamux core queued into Noise messages and write them out."""
        chunks = self._yamux.data_to_send()
        if not chunks or self._transport is None:
            return
        limit = NoiseTransport.MAX_PLAINTEXT
        staging, noise = self._staging, self._noise
        out_end = staged = 0
        out_limit = len(self._out) - (limit + 18)
        for chunk in chunks:
            view = memoryview(chunk)
            while view:
                if not staged and len(view) >= limit:
                    out_end = noise.seal_into(view[:limit], self._out, out_end)
                    view = view[limit:]
                else:
                    take = min(limit - staged, len(view))
                    staging[staged : staged + take] = view[:take]
                    staged += take
                    view = view[take:]
                    if staged == limit:
                        out_end = noise.seal_into(staging, self._out, out_end)
                        staged = 0
                if out_end > out_limit:
                    self._write_out(out_end)
                    out_end = 0
        if staged:
            out_end = noise.seal_into(staging[:staged], self._out, out_end)
        if out_end:
            self._write_out(out_end)

    def _flush_soon(self) -> None:
        """Flush at the end of this loop iteration (at once if a full Noise message is queued)."""
        if self._yamux.pending_bytes() >= NoiseTransport.MAX_PLAINTEXT:
            self._flush()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._scheduled_flush)

    def _scheduled_flush(self) -> None:
        self._flush_scheduled = False
        if self.phase is Phase.MUXED:
            self._flush()

    def _write_out(self, length: int) -> None:
        """Write out[:length]; if the transport kept a view of the buffer, fill another one next (when
        all are kept, hand the transport a copy instead)."""
        transport = self._transport
        if transport is None:
            return
        with memoryview(self._out) as view:
            spare = self._outputs.get()
            transport.write(view[:length] if spare is not None else bytes(view[:length]))
        self.traffic.bytes_sent += length
        # the pool, the attribute and the argument; more: the transport's (never without a spare: copied)
        if spare is not None and sys.getrefcount(self._out) > 3:
            self._out = spare

    # --- used by streams and the host -----------------------------------------------------------

    def has_outbound_streams(self) -> bool:
        """Whether a stream we opened is still open: we wait on the peer (yamux: the client opens odd ids)."""
        ours = 1 if self.initiator else 0
        return any(stream_id % 2 == ours for stream_id in self.streams)

    @property
    def peer(self) -> PeerID:
        """The remote peer of an upgraded connection (every connection the Host hands out is one)."""
        if self.remote_peer is None:
            raise ConnectionClosedError("the connection has not been upgraded: its peer is not known")
        return self.remote_peer

    def keepalive(self) -> None:
        """Ping the peer (a yamux ping), so that both sides see traffic on a connection we still need."""
        if self.phase is Phase.MUXED:
            self._yamux.ping(int(time.monotonic() * 1000) & 0xFFFFFFFF, now=time.monotonic())
            self._flush_soon()

    def open_stream(self) -> Stream:
        if self.phase is not Phase.MUXED:
            raise ConnectionClosedError(f"connection to {self.remote_peer} is {self.phase.value}")
        stream_id = self._yamux.open_stream()
        stream = self.streams[stream_id] = Stream(self, stream_id)
        self._flush_soon()
        return stream

    async def _wait_writable(self) -> None:
        if self.phase is not Phase.MUXED:
            raise ConnectionClosedError(self.close_reason or "connection closed")
        if not self._can_write.is_set():
            await self._can_write.wait()
            if self.phase is not Phase.MUXED:
                raise ConnectionClosedError(self.close_reason or "connection closed")

    def _send(self, stream_id: int, data: memoryview) -> int:
        """Send what the send window allows of `data`; return how many bytes were taken."""
        if self._flush_scheduled and len(data) <= COALESCE_LIMIT:  # join the flush already due
            if type(data.obj) is not bytes:  # the caller may change its buffer once we return
                data = memoryview(bytes(data))
            accepted = self._yamux.send_data(stream_id, data)
            if accepted:
                self._flush_soon()
            return accepted
        accepted = self._yamux.send_data(stream_id, data)
        if accepted:
            self._flush()  # zero-copy: the socket (or its buffer) has the bytes on return
        return accepted

    def _stream_consumed(self, stream_id: int, n: int) -> None:
        if self.phase is Phase.MUXED and n:
            self._yamux.consumed(stream_id, n, now=time.monotonic())
            if self._yamux.pending_bytes():
                self._flush_soon()

    def _end_stream(self, stream_id: int) -> None:
        if self.phase is Phase.MUXED:
            self._yamux.end_stream(stream_id)
            self._flush_soon()
            stream = self.streams.get(stream_id)
            if stream is not None:
                self._forget_if_done(stream)

    def _reset_stream(self, stream_id: int) -> None:
        self.streams.pop(stream_id, None)
        if self.phase is Phase.MUXED:
            try:
                self._yamux.reset_stream(stream_id)
            except ProtocolError:
                return
            self._flush_soon()

    def _forget_if_done(self, stream: Stream) -> None:
        if stream._eof and stream._write_closed:
            self.streams.pop(stream.stream_id, None)

    def abort(self, reason: str) -> None:
        """Close at once: reset every stream, drop the socket. Safe to call more than once."""
        if self.phase is Phase.CLOSED:
            return
        logger.debug(f"{self}: closing ({reason})")
        self.phase, self.close_reason = Phase.CLOSED, reason
        for stream in self.streams.values():
            stream._on_reset(f"connection closed: {reason}")
        self.streams.clear()
        if self._transport is not None:
            self._transport.abort()
        self._data_arrived.set()
        self._made.set()
        self._can_write.set()
        self.closed.set()
        if self._on_close is not None:
            self._on_close(self)

    async def close(self) -> None:
        """Say go-away, flush, then close the socket."""
        if self.phase is Phase.MUXED and self._transport is not None:
            self._yamux.go_away(0)
            self._flush()
            self._transport.close()
        self.abort("closed locally")

    @property
    def is_closed(self) -> bool:
        return self.phase is Phase.CLOSED

    def __repr__(self) -> str:
        peer = self.remote_peer.short() if self.remote_peer else "?"
        return f"<Connection {peer} {self.remote_addr} {self.phase.value} streams={len(self.streams)}>"
