"""Typed RPC over libp2p streams: unary, client-, server- and bidirectional streaming calls.

Each RPC method has its own versioned protocol id (e.g. `/plexus/dht/1.0.0`), declared once by
the service that uses it, never derived from a Python class name. A call opens one stream
(multistream negotiation rides along with the request, so a unary call costs one round trip),
the caller writes its request frame(s) and half-closes, the handler writes response frame(s)
and closes. Frames are `kind (1 byte) | uvarint length | payload`; kind 0 is a message, kind 1
an error carrying the handler's message as UTF-8, after which the stream ends.

Messages are `bytes` or any class with `encode() -> bytes` and a `decode(bytes)` classmethod
(see `plexus.p2p.messages.Message`). A reader that copies large payloads to their destination
itself asks for `Chunks`: each message then arrives as a list of buffers, the received chunks
uncopied. Every frame is bounded by `max_message_size`; a handler that raises, or a caller that
sends garbage, costs that one stream and nothing else.

Bounds on the serving side, per method (`add_handler`): a frame's length is checked before its
body is read; a caller may have at most `max_concurrent_per_peer` requests under way at once (one
more gets an error frame saying so); and its request (the first one, for a streaming method) must
arrive within `request_timeout`. Later messages of a stream are paced by the service itself
(all-reduce's sender_timeout, the MoE server's request_timeout). Each refusal is logged through the
host, once a minute per peer.
"""

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from ..errors import PeerError, PeerMisbehaved
from ..utils.logging import get_logger
from .host import Host
from .identity import PeerID
from .limits import Counter
from .protocols.varint import NeedMoreData, VarintError, decode_uvarint, encode_uvarint
from .stream import Stream, StreamError, read_varint

logger = get_logger(__name__)

MESSAGE, ERROR = 0, 1
DEFAULT_MAX_MESSAGE_SIZE = 4 << 20
DEFAULT_MAX_CONCURRENT_PER_PEER = 64
DEFAULT_REQUEST_TIMEOUT = 60.0
MAX_ERROR_SIZE = 64 << 10
SMALL_FRAME = 64 << 10


class RPCError(PeerError):
    """The remote handler failed; the message is the handler's own error text."""

    def __init__(self, message: str, peer: PeerID | None = None, protocol: str | None = None):
        super().__init__(message, peer=peer, protocol=protocol)

    __str__ = Exception.__str__  # the handler's own text, exactly as the remote side raised it


class RPCProtocolError(PeerMisbehaved):
    """The other side broke the RPC framing (bad frame kind, oversized message, bad encoding)."""


class RPCContext:
    """What a handler knows about its caller."""

    def __init__(self, stream: Stream):
        self.stream = stream
        self.remote_peer: PeerID = stream.remote_peer
        self.protocol: str | None = stream.protocol  # negotiated: never None in a handler


class Chunks:
    """As a message type: deliver each message as a list of buffers (views of what was received,
    not joined; `b"".join` them for bytes). Keep them only until copied: they pin receive buffers."""


def _encode(message) -> bytes | bytearray | memoryview:
    return message if isinstance(message, (bytes, bytearray, memoryview)) else message.encode()


def _decode(message_type, data):
    if message_type is bytes or message_type is Chunks:
        return data
    try:
        return message_type.decode(data)
    except Exception as error:  # any decoding failure is the sender's fault
        raise RPCProtocolError(f"malformed {message_type.__name__}: {error}") from None


async def write_frame(stream: Stream, message, kind: int = MESSAGE) -> None:
    payload = _encode(message)
    header = bytes([kind]) + encode_uvarint(len(payload))
    if len(payload) <= SMALL_FRAME:
        await stream.write(header + bytes(payload))
    else:  # large payloads go out without being copied behind the header
        await stream.write(header)
        await stream.write(payload)


MAX_FRAME_HEADER = 11  # the kind byte and a uvarint length of up to 10 bytes


async def read_frame(stream: Stream, max_size: int, chunks: bool = False) -> tuple[int, Any] | None:
    """Read one frame; None at a clean end of stream. With `chunks`, a message's payload is a list
    of buffers (see Chunks) and an error's is still bytes."""
    head = stream._peek(MAX_FRAME_HEADER)
    if len(head) >= 2 and head[0] in (MESSAGE, ERROR):  # fast path: a well-formed header is buffered
        try:
            length, end = decode_uvarint(head, 1)
        except (NeedMoreData, VarintError):  # cut short here, or malformed: the byte-wise path says which
            length = None
        if (
            length is not None
            and length <= (max_size if head[0] == MESSAGE else MAX_ERROR_SIZE)
            and length <= SMALL_FRAME
        ):  # one read of header and body, one copy of the body
            frame = await stream.readexactly(end + length)
            return head[0], [frame[end:]] if chunks and head[0] == MESSAGE else frame[end:]
    kind = await stream.read(1)
    if not kind:
        return None
    if kind[0] not in (MESSAGE, ERROR):
        raise RPCProtocolError(f"unknown RPC frame kind {kind[0]} on {stream.protocol}")
    length = await read_varint(stream)
    if length is None:
        raise RPCProtocolError("stream ended inside an RPC frame header")
    limit = max_size if kind[0] == MESSAGE else MAX_ERROR_SIZE
    if length > limit:
        raise RPCProtocolError(
            f"a {length}-byte RPC message on {stream.protocol} exceeds the {limit}-byte limit"
        )
    if chunks and kind[0] == MESSAGE:
        return kind[0], await stream.readexactly_chunks(length)
    return kind[0], await stream.readexactly(length) if length else b""


async def _read_messages(stream: Stream, message_type, max_size: int, peer=None) -> AsyncIterator[Any]:
    while (frame := await read_frame(stream, max_size, message_type is Chunks)) is not None:
        kind, payload = frame
        if kind == ERROR:
            raise RPCError(payload.decode(errors="replace"), peer, stream.protocol)
        yield _decode(message_type, payload)


async def _first_within(
    messages: AsyncIterator[Any], timeout: float | None, protocol: str
) -> AsyncIterator[Any]:
    """The messages, the first of which must arrive within `timeout` (else RPCProtocolError)."""
    try:
        async with asyncio.timeout(timeout):
            first = await anext(messages, None)
    except TimeoutError:
        raise RPCProtocolError(
            f"no request arrived on {protocol} within {timeout} s (request_timeout)"
        ) from None
    if first is None:
        return
    yield first
    async for message in messages:
        yield message


def add_handler(
    host: Host,
    protocol: str,
    handler: Callable[..., Any],
    request_type=bytes,
    response_type=bytes,
    *,
    stream_input: bool = False,
    stream_output: bool = False,
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
    max_concurrent_per_peer: int | None = DEFAULT_MAX_CONCURRENT_PER_PEER,
    request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT,
) -> None:
    """Serve `protocol` with `handler(request_or_iterator, context)`.

    The handler gets one decoded request, or an async iterator of them when `stream_input`;
    it returns one response, or is an async generator of them when `stream_output`.

    Args:
        max_message_size: the largest frame accepted, checked before the frame is read.
        max_concurrent_per_peer: requests one peer may have under way on this method at once
            (None: no bound but the host's max_inbound_streams_per_peer); one more gets an error.
        request_timeout: the request (the first message of a streaming one) must arrive within
            this many seconds of the stream opening, else the caller gets an error.
    """
    under_way = Counter()

    async def serve(stream: Stream) -> None:
        context = RPCContext(stream)
        peer = context.remote_peer
        if not under_way.acquire(peer, max_concurrent_per_peer):
            host.refused(
                ("rpc requests per peer", peer, protocol),
                f"refused a {protocol} request from {peer}: it has {max_concurrent_per_peer} "
                f"under way (max_concurrent_per_peer)",
            )
            message = (
                f"too many concurrent {protocol} requests from you ({max_concurrent_per_peer}); retry later"
            )
            await write_frame(stream, message.encode(), ERROR)
            stream.reset()
            return
        try:
            await _serve_request(stream, context)
        finally:
            under_way.release(peer)

    async def _serve_request(stream: Stream, context: RPCContext) -> None:
        try:
            messages = _read_messages(stream, request_type, max_message_size, context.remote_peer)
            requests = _first_within(messages, request_timeout, protocol)
            request: Any
            if stream_input:
                request = requests
            else:
                request = await anext(requests, None)
                if request is None:
                    raise RPCProtocolError("the caller sent no request")
                try:
                    async with asyncio.timeout(request_timeout):
                        extra = await anext(requests, None)
                except TimeoutError:
                    raise RPCProtocolError(
                        f"the request on {protocol} did not end within {request_timeout} s (request_timeout)"
                    ) from None
                if extra is not None:
                    raise RPCProtocolError("the caller sent more than one request to a unary method")
            if stream_output:
                async for response in handler(request, context):
                    await write_frame(stream, response)
            else:
                await write_frame(stream, await handler(request, context))
        except (StreamError, ConnectionError, asyncio.IncompleteReadError):
            raise
        except asyncio.CancelledError:
            stream.reset()
            raise
        except Exception as error:
            if isinstance(error, RPCProtocolError):
                host.refused(
                    ("bad rpc request", context.remote_peer, protocol),
                    f"refused a {protocol} request from {context.remote_peer}: {error}",
                )
            elif not isinstance(error, RPCError):
                logger.debug(f"{protocol} handler failed for {context.remote_peer}: {error!r}", exc_info=True)
            message = str(error) or type(error).__name__
            await write_frame(stream, message.encode()[:MAX_ERROR_SIZE], ERROR)
            if isinstance(error, RPCProtocolError):  # unread input remains: end the stream, error first
                stream.reset()
                return
        await stream.close()

    host.set_stream_handler(protocol, serve)


async def call(
    host: Host,
    peer: PeerID,
    protocol: str,
    request,
    response_type=bytes,
    *,
    timeout: float | None = None,
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
):
    """Unary call: send one request, return the one response. Raises RPCError, TimeoutError."""
    async with asyncio.timeout(timeout):
        stream = await host.new_stream(peer, protocol, lazy=True)
        try:
            try:
                await write_frame(stream, request)
                await stream.close()
            except StreamError:
                pass  # the handler may have refused the request already: its reply says why
            # one frame read directly: an abandoned async generator here would cost a finalizer
            # task and a wake-up of the loop through its self-pipe on every call
            frame = await read_frame(stream, max_message_size)
            if frame is None:
                raise RPCProtocolError(f"{peer} closed {protocol} without a response")
            kind, payload = frame
            if kind == ERROR:
                raise RPCError(payload.decode(errors="replace"), peer, stream.protocol)
            return _decode(response_type, payload)
        except BaseException:
            stream.reset()
            raise


async def call_stream(
    host: Host,
    peer: PeerID,
    protocol: str,
    requests,
    response_type=bytes,
    *,
    timeout: float | None = None,
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
) -> AsyncGenerator[Any, None]:
    """Streaming call: `requests` is one message or an async iterable; yields the responses.

    Requests are sent by a background task while responses are read, so bidirectional streams
    never deadlock on full windows. `timeout` bounds the whole call.
    """
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    async with asyncio.timeout_at(deadline):
        stream = await host.new_stream(peer, protocol, lazy=True)

    async def send() -> None:
        if hasattr(requests, "__aiter__"):
            async for request in requests:
                await write_frame(stream, request)
                del request  # sent: let it go while the next one is made
        else:
            await write_frame(stream, requests)
        await stream.close()

    sender = loop.create_task(send())
    try:
        messages = _read_messages(stream, response_type, max_message_size, peer)
        while True:
            async with asyncio.timeout_at(deadline):
                try:
                    response = await anext(messages)
                except StopAsyncIteration:
                    break
            yield response
        await sender  # every response is in: a failed send is the error now
    except BaseException:
        if not sender.done():
            sender.cancel()
        elif not sender.cancelled():
            sender.exception()  # the error in flight (the handler's refusal, say) says more than a reset
        stream.reset()
        raise
