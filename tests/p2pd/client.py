"""A test-side asyncio client of the Go libp2p daemon's (p2pd) control protocol.

Theory of operation (go-libp2p-daemon spec, field numbers from its pb/p2pd.proto):
every control message is a protobuf framed by an unsigned varint length. Each one-shot request
(IDENTIFY, CONNECT, LIST_PEERS, STREAM_OPEN, STREAM_HANDLER) opens its own unix-socket connection
to the daemon, writes one `Request` and reads one `Response`. After an OK to STREAM_OPEN the same
connection carries the raw bytes of the libp2p stream. For inbound streams the daemon dials the
unix socket we named in STREAM_HANDLER, writes one varint-delimited `StreamInfo`, then proxies raw
bytes. Multiaddrs travel in their binary form.

Left out: DHT, pubsub, connection manager, DISCONNECT and the persistent connection (unary calls);
add them when a test needs them. This is a fixture, never used by Plexus itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import base58

from plexus.p2p.identity import PeerID
from plexus.p2p.protocols import pb
from plexus.p2p.protocols.varint import NeedMoreData, VarintError, decode_uvarint, encode_uvarint

log = logging.getLogger(__name__)

MAX_CONTROL_MESSAGE = 4 * 1024 * 1024  # bound on one control protobuf (the daemon's own default)
DEFAULT_TIMEOUT = 10.0

# Request.Type and Response.Type enums.
IDENTIFY, CONNECT, STREAM_OPEN, STREAM_HANDLER, LIST_PEERS = 0, 1, 2, 3, 5
OK, ERROR = 0, 1

REQUEST = {
    "type": (1, "uint"),
    "connect": (2, "message"),
    "streamOpen": (3, "message"),
    "streamHandler": (4, "message"),
}
RESPONSE = {
    "type": (1, "uint"),
    "error": (2, "message"),
    "streamInfo": (3, "message"),
    "identify": (4, "message"),
    "peers": (6, "message*"),
}
IDENTIFY_RESPONSE = {"id": (1, "bytes"), "addrs": (2, "bytes*")}
CONNECT_REQUEST = {"peer": (1, "bytes"), "addrs": (2, "bytes*"), "timeout": (3, "uint")}
STREAM_OPEN_REQUEST = {"peer": (1, "bytes"), "proto": (2, "string*"), "timeout": (3, "uint")}
STREAM_HANDLER_REQUEST = {"addr": (1, "bytes"), "proto": (2, "string*"), "balanced": (3, "bool")}
ERROR_RESPONSE = {"msg": (1, "string")}
STREAM_INFO = {"peer": (1, "bytes"), "addr": (2, "bytes"), "proto": (3, "string")}
PEER_INFO = {"id": (1, "bytes"), "addrs": (2, "bytes*")}


class DaemonError(Exception):
    """The daemon answered a control request with ERROR, or broke the control protocol."""


# --- multiaddrs: just the protocols a local test meets ---------------------------------------

# name -> (code, size): size in bytes, 0 for no value, -1 for a varint-length-prefixed value.
_PROTOCOLS = {
    "ip4": (4, 4), "tcp": (6, 2), "udp": (273, 2), "ip6": (41, 16),
    "dns": (53, -1), "dns4": (54, -1), "dns6": (55, -1), "dnsaddr": (56, -1),
    "unix": (400, -1), "p2p": (421, -1), "p2p-circuit": (290, 0),
    "quic": (460, 0), "quic-v1": (461, 0), "ws": (477, 0), "wss": (478, 0), "tls": (448, 0),
    "webtransport": (465, 0),
}  # fmt: skip
_BY_CODE = {code: (name, size) for name, (code, size) in _PROTOCOLS.items()}


def encode_multiaddr(text: str) -> bytes:
    """Text multiaddr -> binary. `/unix/` takes the rest of the address as an absolute path."""
    parts = text.split("/")
    if parts[0] != "" or len(parts) < 2:
        raise ValueError(f"multiaddr {text!r} must start with '/'")
    out, index = bytearray(), 1
    while index < len(parts):
        name = parts[index]
        if name not in _PROTOCOLS:
            raise ValueError(f"multiaddr {text!r}: protocol {name!r} is not known to the test client")
        code, size = _PROTOCOLS[name]
        out += encode_uvarint(code)
        index += 1
        if size == 0:
            continue
        if name == "unix":
            value, index = ("/" + "/".join(parts[index:])).encode(), len(parts)
        else:
            if index >= len(parts):
                raise ValueError(f"multiaddr {text!r}: {name} needs a value")
            value, index = _value_to_bytes(name, parts[index]), index + 1
        out += encode_uvarint(len(value)) + value if size < 0 else value
    return bytes(out)


def _value_to_bytes(name: str, value: str) -> bytes:
    if name in ("ip4", "ip6"):
        return ipaddress.ip_address(value).packed
    if name in ("tcp", "udp"):
        return int(value).to_bytes(2, "big")
    if name == "p2p":
        return PeerID.from_string(value).to_bytes()
    return value.encode()


def decode_multiaddr(data: bytes) -> str:
    """Binary multiaddr -> text; unknown protocol codes raise ValueError."""
    parts, offset = [], 0
    try:
        while offset < len(data):
            code, offset = decode_uvarint(data, offset)
            if code not in _BY_CODE:
                raise ValueError(f"multiaddr {data.hex()}: protocol code {code} is unknown here")
            name, size = _BY_CODE[code]
            parts.append(name)
            if size == 0:
                continue
            if size < 0:
                size, offset = decode_uvarint(data, offset)
            value, offset = data[offset : offset + size], offset + size
            if len(value) != size:
                raise ValueError(f"multiaddr {data.hex()}: {name} value is truncated")
            if name in ("ip4", "ip6"):
                parts.append(str(ipaddress.ip_address(value)))
            elif name in ("tcp", "udp"):
                parts.append(str(int.from_bytes(value, "big")))
            elif name == "p2p":
                parts.append(base58.b58encode(value).decode())
            else:
                parts.append(value.decode().lstrip("/") if name == "unix" else value.decode())
    except (NeedMoreData, VarintError):
        raise ValueError(f"multiaddr {data.hex()}: malformed varint") from None
    return "/" + "/".join(parts)


# --- framing ----------------------------------------------------------------------------------


async def read_delimited(reader: asyncio.StreamReader, limit: int = MAX_CONTROL_MESSAGE) -> bytes:
    """Read one varint-length-prefixed message, refusing anything over `limit` bytes."""
    length = shift = 0
    for _ in range(9):
        byte = (await reader.readexactly(1))[0]
        length |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            break
    else:
        raise DaemonError("the daemon sent a length prefix longer than 9 bytes")
    if length > limit:
        raise DaemonError(f"the daemon sent a {length}-byte control message, over our {limit}-byte limit")
    return await reader.readexactly(length)


def write_delimited(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(encode_uvarint(len(data)) + data)


@dataclass(frozen=True)
class StreamInfo:
    peer_id: PeerID
    addr: str
    protocol: str

    @classmethod
    def decode(cls, data: bytes) -> StreamInfo:
        fields = pb.decode(STREAM_INFO, data)
        peer_id = PeerID(fields.get("peer", b""))
        return cls(peer_id, decode_multiaddr(fields.get("addr", b"")), fields.get("proto", ""))


@dataclass(frozen=True)
class PeerInfo:
    peer_id: PeerID
    addrs: list[str]


StreamHandler = Callable[[StreamInfo, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class ControlClient:
    """Talks to one daemon's control socket; serves inbound streams on `handler_socket`."""

    def __init__(self, control_socket: str, handler_socket: str, timeout: float = DEFAULT_TIMEOUT):
        self.control_socket = control_socket
        self.handler_socket = handler_socket
        self.timeout = timeout
        self._handlers: dict[str, StreamHandler] = {}
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def identify(self) -> tuple[PeerID, list[str]]:
        response = await self._call({"type": IDENTIFY})
        fields = pb.decode(IDENTIFY_RESPONSE, response.get("identify") or b"")
        return PeerID(fields.get("id", b"")), [decode_multiaddr(addr) for addr in fields["addrs"]]

    async def connect(self, peer_id: PeerID, addrs: list[str], timeout: float | None = None) -> None:
        timeout = timeout or self.timeout
        binary_addrs = [encode_multiaddr(addr) for addr in addrs]
        body = pb.encode(
            CONNECT_REQUEST, {"peer": peer_id.to_bytes(), "addrs": binary_addrs, "timeout": int(timeout)}
        )
        await self._call({"type": CONNECT, "connect": body}, timeout + 1)

    async def list_peers(self) -> list[PeerInfo]:
        response = await self._call({"type": LIST_PEERS})
        peers = [pb.decode(PEER_INFO, raw) for raw in response["peers"]]
        return [PeerInfo(PeerID(p.get("id", b"")), [decode_multiaddr(a) for a in p["addrs"]]) for p in peers]

    async def stream_open(
        self, peer_id: PeerID, protocols: list[str], timeout: float | None = None
    ) -> tuple[StreamInfo, asyncio.StreamReader, asyncio.StreamWriter]:
        """Open a libp2p stream; the returned unix connection then carries its raw bytes."""
        timeout = timeout or self.timeout
        body = pb.encode(
            STREAM_OPEN_REQUEST, {"peer": peer_id.to_bytes(), "proto": protocols, "timeout": int(timeout)}
        )
        reader, writer = await asyncio.open_unix_connection(self.control_socket)
        try:
            response = await asyncio.wait_for(
                self._exchange(reader, writer, {"type": STREAM_OPEN, "streamOpen": body}), timeout + 1
            )
            return StreamInfo.decode(response.get("streamInfo") or b""), reader, writer
        except BaseException:
            writer.close()
            raise

    async def stream_handler(self, protocol: str, handler: StreamHandler, balanced: bool = False) -> None:
        """Ask the daemon to forward inbound `protocol` streams to `handler(info, reader, writer)`."""
        if self._server is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.handler_socket)
            self._server = await asyncio.start_unix_server(self._on_inbound, self.handler_socket)
        self._handlers[protocol] = handler
        addr = encode_multiaddr("/unix" + os.path.abspath(self.handler_socket))
        body = pb.encode(STREAM_HANDLER_REQUEST, {"addr": addr, "proto": [protocol], "balanced": balanced})
        await self._call({"type": STREAM_HANDLER, "streamHandler": body})

    async def close(self) -> None:
        """Stop serving inbound streams and cancel the handlers still running."""
        if self._server is not None:
            self._server.close()
            self._server = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.handler_socket)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _on_inbound(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._tasks.add(task := asyncio.current_task())
        try:
            info = StreamInfo.decode(await asyncio.wait_for(read_delimited(reader), self.timeout))
            handler = self._handlers.get(info.protocol)
            if handler is None:
                log.warning("p2pd forwarded a %r stream from %s; no handler", info.protocol, info.peer_id)
                return
            await handler(info, reader, writer)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("test stream handler failed")
        finally:
            self._tasks.discard(task)
            writer.close()

    async def _call(self, request: dict, timeout: float | None = None) -> dict:
        reader, writer = await asyncio.open_unix_connection(self.control_socket)
        try:
            return await asyncio.wait_for(self._exchange(reader, writer, request), timeout or self.timeout)
        finally:
            writer.close()

    async def _exchange(self, reader, writer, request: dict) -> dict:
        write_delimited(writer, pb.encode(REQUEST, request))
        await writer.drain()
        try:
            response = pb.decode(RESPONSE, await read_delimited(reader))
        except asyncio.IncompleteReadError:
            raise DaemonError(
                f"the daemon closed the control connection before answering request type {request['type']}"
            ) from None
        if response.get("type") == ERROR:
            message = pb.decode(ERROR_RESPONSE, response.get("error") or b"").get("msg", "(no message)")
            raise DaemonError(message)
        if response.get("type") != OK:
            raise DaemonError(f"the daemon answered with unknown response type {response.get('type')}")
        return response
