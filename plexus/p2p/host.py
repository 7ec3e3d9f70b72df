"""The libp2p host: listens, dials, keeps one connection per peer, opens and serves streams.

A Host owns TCP listeners, the live Connections (by peer), a small peer store (addresses learned
from dials and identify), and the stream handlers by protocol id. Every inbound stream is
negotiated with multistream-select under a deadline and then handed to its handler in its own
task; a handler that raises resets that stream and is logged, nothing more. Identify
(`/ipfs/id/1.0.0`) runs on every new connection and ping (`/ipfs/ping/1.0.0`) is always served.

The host never blocks: all of it runs on the caller's event loop, and `shutdown()` closes the
listeners, the connections and every task it started.
"""

import asyncio
import os
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from ..version import __version__
from ..utils.logging import get_logger
from .connection import Connection, ConnectionClosedError, host_decrypt_buffers
from .identity import PeerID, PrivateKey
from .multiaddr import Multiaddr, MultiaddrError, from_socket_address, parse_host_port
from .protocols import identify, noise
from .protocols.errors import ProtocolError
from .protocols.multistream import MultistreamDialer, MultistreamListener
from .stream import Stream, StreamError, read_delimited, write_delimited

logger = get_logger(__name__)

PING_PROTOCOL = "/ipfs/ping/1.0.0"
PING_SIZE = 32
MAX_KNOWN_PEERS = 10_000
MAX_ADDRS_PER_PEER = 16
AGENT_VERSION = f"plexus/{__version__}"

StreamHandler = Callable[[Stream], Awaitable[None]]


class DialError(ConnectionError):
    """Could not reach a peer; the message lists each address tried and why it failed."""


@dataclass
class HostOptions:
    """Knobs of the host. Times are seconds."""

    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    """Addresses to listen on (port 0: the OS picks one). Empty for a dial-only (client) host."""
    announce_maddrs: tuple[str, ...] = ()
    """Addresses to advertise instead of the listening ones (e.g. a public IP behind port forwarding)."""
    dial_timeout: float = 10.0
    """Deadline for TCP connect plus the Noise and yamux upgrade."""
    negotiate_timeout: float = 10.0
    """Deadline for the peer to pick a protocol on a new inbound stream."""
    idle_timeout: float = 120.0
    """Close connections that have had no stream for this long."""
    max_connections: int = 1024
    """Inbound connections past this are refused."""
    max_streams_per_connection: int = 512
    """Concurrent yamux streams per connection."""
    reuse_port: bool = False
    """Let outgoing sockets bind our listening ports (SO_REUSEPORT, set once each listener is bound, so a
    second listener on the same port still fails): hole punching (plexus/p2p/dcutr.py) dials from them."""
    noise_ciphers: tuple[str, ...] = tuple(noise.SUITES)
    """Noise cipher functions to offer, most preferred first. ChaChaPoly is libp2p's "/noise", which every
    libp2p peer speaks; AESGCM, which Plexus peers also speak, is 2-3x faster on CPUs with AES instructions."""

    def __post_init__(self):
        unknown = [name for name in self.noise_ciphers if name not in noise.SUITES]
        if unknown or not self.noise_ciphers:
            raise ValueError(f"noise_ciphers must name one or more of {sorted(noise.SUITES)}, "
                             f"got {list(self.noise_ciphers)}")


@dataclass
class PeerInfo:
    """What we know of a peer: its id, addresses and, after identify, its protocols."""

    peer_id: PeerID
    addrs: list[Multiaddr] = field(default_factory=list)
    protocols: list[str] = field(default_factory=list)
    agent_version: str | None = None
    observed_addr: Multiaddr | None = None


class Host:
    """A libp2p peer speaking TCP + Noise + yamux, with identify and ping."""

    def __init__(self, private_key: PrivateKey | None = None, options: HostOptions | None = None, **kwargs):
        self.private_key = private_key or PrivateKey.generate()
        self.peer_id = self.private_key.peer_id
        self.options = options or HostOptions(**kwargs)
        self._handlers: dict[str, StreamHandler] = {}
        self._connections: dict[PeerID, list[Connection]] = {}
        self._decrypt_buffers = host_decrypt_buffers()
        self._pending_dials: dict[PeerID, asyncio.Task] = {}
        self._peers: dict[PeerID, PeerInfo] = {}
        self._servers: list[asyncio.AbstractServer] = []
        self._listen_addrs: list[Multiaddr] = []
        self._observed_addrs: dict[Multiaddr, int] = {}
        self._tasks: set[asyncio.Task] = set()
        self._identified: dict[PeerID, asyncio.Event] = {}
        self._running = False
        self._routing: set[PeerID] = set()  # peers whose addresses the peer router is looking up
        self.peer_router: Callable[[PeerID], Awaitable[None]] | None = None
        """Called to find addresses of a peer we must dial but know no address of (set by the DHT)."""
        # Hooks for transports that live in their own modules (circuit relay: plexus/p2p/relay.py).
        self.circuit_dialer: Callable[[PeerID, Multiaddr], Awaitable[Connection]] | None = None
        """Dials a /p2p-circuit address and returns the relayed Connection (set by RelayClient)."""
        self.address_sources: list[Callable[[], Iterable[Multiaddr]]] = []
        """Extra addresses to advertise, e.g. /p2p/<relay>/p2p-circuit ones (added to visible addrs)."""
        self.set_stream_handler(identify.IDENTIFY_PROTOCOL, self._serve_identify)
        self.set_stream_handler(identify.IDENTIFY_PUSH_PROTOCOL, self._serve_identify_push)
        self.set_stream_handler(PING_PROTOCOL, self._serve_ping)

    # --- life cycle --------------------------------------------------------------------------------

    async def start(self) -> "Host":
        loop = asyncio.get_running_loop()
        for text in self.options.host_maddrs:
            host, port, family = parse_host_port(Multiaddr(text))
            server = await loop.create_server(
                lambda: self._accept(), host, port, family=socket.AF_INET6 if family == "ip6" else socket.AF_INET,
                reuse_address=True,
            )
            self._servers.append(server)
            for sock in server.sockets:
                if self.options.reuse_port:
                    _share_port(sock)
                address = sock.getsockname()
                self._listen_addrs.append(from_socket_address(address[0], address[1]))
        self._running = True
        self._spawn(self._close_idle_connections())
        logger.debug(f"host {self.peer_id} listening on {[str(a) for a in self._listen_addrs]}")
        return self

    async def shutdown(self) -> None:
        """Close listeners, connections and tasks; leaves no socket or task behind."""
        self._running = False
        for server in self._servers:
            server.close()
        for task in list(self._tasks) + list(self._pending_dials.values()):
            task.cancel()
        for connections in list(self._connections.values()):
            for connection in list(connections):
                await connection.close()
        for server in self._servers:
            await server.wait_closed()
        await asyncio.gather(*self._tasks, *self._pending_dials.values(), return_exceptions=True)
        self._servers.clear()

    async def __aenter__(self) -> "Host":
        return await self.start()

    async def __aexit__(self, *exc_info) -> None:
        await self.shutdown()

    def _spawn(self, coroutine) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # --- addresses ----------------------------------------------------------------------------------

    def get_listen_maddrs(self) -> list[Multiaddr]:
        return list(self._listen_addrs)

    def get_visible_maddrs(self, include_observed: bool = False) -> list[Multiaddr]:
        """Addresses others can dial us at, each ending in /p2p/<our id>.

        Announced addresses win. Otherwise wildcard listeners are expanded to this machine's
        addresses (loopback included, so local peers can always connect), plus, when asked, the
        addresses peers observed us at through identify.
        """
        if self.options.announce_maddrs:
            addrs = [Multiaddr(text) for text in self.options.announce_maddrs]
        else:
            addrs = []
            for addr in self._listen_addrs:
                host, port, family = parse_host_port(addr)
                if host in ("0.0.0.0", "::"):
                    addrs.extend(Multiaddr(f"/{family}/{ip}/tcp/{port}") for ip in local_ips(family))
                else:
                    addrs.append(addr)
            if include_observed:
                addrs.extend(addr for addr in self._observed_addrs if addr not in addrs)
        for source in self.address_sources:  # relay addresses (plexus/p2p/relay.py)
            addrs.extend(source())
        return [addr.with_peer_id(self.peer_id) for addr in dict.fromkeys(addrs)]

    def add_addrs(self, peer_id: PeerID, addrs: Iterable[Multiaddr]) -> None:
        """Remember where a peer can be dialed (newest first; bounded per peer and in peers)."""
        info = self._peers.get(peer_id)
        if info is None:
            if len(self._peers) >= MAX_KNOWN_PEERS:
                self._forget_a_disconnected_peer()
            info = self._peers[peer_id] = PeerInfo(peer_id)
        for addr in addrs:
            addr = addr.without_peer_id()
            if addr in info.addrs:
                info.addrs.remove(addr)
            info.addrs.insert(0, addr)
        del info.addrs[MAX_ADDRS_PER_PEER:]

    def _forget_a_disconnected_peer(self) -> None:
        for peer_id in self._peers:  # oldest first
            if peer_id not in self._connections:
                del self._peers[peer_id]
                self._identified.pop(peer_id, None)
                return

    def peer_info(self, peer_id: PeerID) -> PeerInfo | None:
        return self._peers.get(peer_id)

    # --- connections --------------------------------------------------------------------------------

    def _accept(self) -> Connection:
        connection = self.make_connection(initiator=False)
        if not self._running or sum(map(len, self._connections.values())) >= self.options.max_connections:
            connection.abort("connection limit reached")
            return connection
        self._spawn(self._upgrade_inbound(connection))
        return connection

    async def _upgrade_inbound(self, connection: Connection) -> None:
        try:
            async with asyncio.timeout(self.options.dial_timeout):
                await connection.upgrade()
        except (TimeoutError, OSError, ProtocolError) as error:
            logger.debug(f"inbound connection from {connection.remote_addr} failed its upgrade: {error!r}")
            connection.abort(f"upgrade failed: {error!r}")
            return
        self._register(connection)

    def _register(self, connection: Connection) -> None:
        self._connections.setdefault(connection.remote_peer, []).append(connection)
        if connection.initiator:
            self.add_addrs(connection.remote_peer, [connection.remote_addr])
        self._spawn(self._identify(connection))

    def _on_close(self, connection: Connection) -> None:
        connections = self._connections.get(connection.remote_peer, [])
        if connection in connections:
            connections.remove(connection)
            if not connections:
                del self._connections[connection.remote_peer]

    def get_connection(self, peer_id: PeerID) -> Connection | None:
        """A live connection to the peer, a direct one if there is any (relayed ones are limited)."""
        fallback = None
        for connection in self._connections.get(peer_id, ()):
            if not connection.is_closed:
                if not getattr(connection, "relayed", False):
                    return connection
                fallback = fallback or connection
        return fallback

    # Used by transports in other modules (relay circuits, hole punching) to add their connections.

    def make_connection(self, *, initiator: bool, expected_peer: PeerID | None = None) -> Connection:
        """A Connection wired to this host's stream handlers, for a transport to drive and upgrade."""
        return Connection(self.private_key, initiator=initiator, expected_peer=expected_peer,
                          on_stream=self._on_stream, on_close=self._on_close,
                          max_streams=self.options.max_streams_per_connection,
                          noise_suites=tuple(noise.SUITES[name] for name in self.options.noise_ciphers),
                          decrypt_buffers=self._decrypt_buffers)

    def add_connection(self, connection: Connection) -> None:
        """Adopt an upgraded Connection made by another transport (identify runs on it)."""
        self._register(connection)

    def connected_peers(self) -> list[PeerID]:
        return [peer for peer, connections in self._connections.items() if connections]

    async def connect(self, target: Multiaddr | str | PeerID, timeout: float | None = None) -> Connection:
        """Return a live connection to a peer, dialing it if needed.

        `target` is a multiaddr ending in /p2p/<id> or a peer id whose addresses we know.
        Concurrent calls for the same peer share one dial.
        """
        if isinstance(target, PeerID):
            peer_id, addrs = target, None
        else:
            addr = Multiaddr(target) if isinstance(target, str) else target
            peer_id = addr.peer_id
            if peer_id is None:
                raise DialError(f"cannot dial {addr}: it has no /p2p/<peer id> part, so the peer cannot be authenticated")
            addrs = [addr.without_peer_id()]
        if peer_id == self.peer_id:
            raise DialError("refusing to dial ourselves")
        if addrs:
            self.add_addrs(peer_id, addrs)
        connection = self.get_connection(peer_id)
        if connection is not None:
            return connection
        if peer_id in self._routing and not addrs:  # the lookup for this very peer asks it: not yet
            raise DialError(f"{peer_id} is being looked up; its address is not known yet")
        dial = self._pending_dials.get(peer_id)
        if dial is None:
            dial = self._pending_dials[peer_id] = asyncio.get_running_loop().create_task(self._dial(peer_id, addrs))
            dial.add_done_callback(lambda task: self._dial_done(peer_id, task))
        async with asyncio.timeout(timeout):
            return await asyncio.shield(dial)

    def _dial_done(self, peer_id: PeerID, dial: asyncio.Task) -> None:
        self._pending_dials.pop(peer_id, None)
        if not dial.cancelled():
            dial.exception()  # mark it retrieved: callers that timed out already left, and asyncio would log it

    async def _dial(self, peer_id: PeerID, addrs: list[Multiaddr] | None) -> Connection:
        info = self._peers.get(peer_id)
        if not addrs and not (info and info.addrs) and self.peer_router is not None:
            self._routing.add(peer_id)
            try:
                await self.peer_router(peer_id)  # e.g. a DHT lookup that teaches us its addresses
            finally:
                self._routing.discard(peer_id)
            info = self._peers.get(peer_id)
        candidates = addrs or (info.addrs if info else [])
        if not candidates:
            raise DialError(f"no known address for peer {peer_id}")
        failures = []
        for addr in list(candidates):
            try:
                return await self._dial_addr(peer_id, addr)
            except (OSError, TimeoutError, ProtocolError, MultiaddrError, ConnectionError) as error:
                failures.append(f"{addr}: {_describe(error)}")
        raise DialError(f"could not connect to {peer_id} (tried {'; '.join(failures)})")

    async def _dial_addr(self, peer_id: PeerID, addr: Multiaddr) -> Connection:
        if addr.is_circuit:  # /…/p2p/<relay>/p2p-circuit: dialed by plexus/p2p/relay.py
            if self.circuit_dialer is None:
                raise DialError(f"{addr} is a relay address, but this host has no relay client")
            return await self.circuit_dialer(peer_id, addr)
        host, port, _ = parse_host_port(addr)
        loop = asyncio.get_running_loop()
        connection = self.make_connection(initiator=True, expected_peer=peer_id)
        try:
            async with asyncio.timeout(self.options.dial_timeout):
                await loop.create_connection(lambda: connection, host, port)
                await connection.upgrade()
        except BaseException as error:
            connection.abort(f"dial failed: {error!r}")
            raise
        self._register(connection)
        return connection

    async def disconnect(self, peer_id: PeerID) -> None:
        for connection in list(self._connections.get(peer_id, ())):
            await connection.close()

    async def _close_idle_connections(self) -> None:
        period = max(self.options.idle_timeout / 4, 0.05)
        while True:
            await asyncio.sleep(period)  # a periodic sweep, not synchronisation
            now = asyncio.get_running_loop().time()
            for connections in list(self._connections.values()):
                for connection in list(connections):
                    if not connection.streams and now - connection.last_activity > self.options.idle_timeout:
                        await connection.close()

    # --- streams ------------------------------------------------------------------------------------

    def set_stream_handler(self, protocol: str, handler: StreamHandler) -> None:
        self._handlers[protocol] = handler

    def remove_stream_handler(self, protocol: str) -> None:
        self._handlers.pop(protocol, None)

    @property
    def protocols(self) -> list[str]:
        return list(self._handlers)

    async def new_stream(self, peer: PeerID | Multiaddr | str, protocols: list[str] | str, *,
                         timeout: float | None = None, lazy: bool = False) -> Stream:
        """Open a stream to `peer` speaking the first of `protocols` the peer accepts.

        With `lazy=True` and a single protocol, the proposal travels with the first data and the
        answer is read with the first reply, saving a round trip (the peer's refusal then shows up
        as an error on the first read).
        """
        if isinstance(protocols, str):
            protocols = [protocols]
        async with asyncio.timeout(timeout):
            connection = await self.connect(peer)
            stream = connection.open_stream()
            dialer = MultistreamDialer(protocols)
            try:
                await stream.write(dialer.data_to_send())
                if lazy and len(protocols) == 1:
                    stream._negotiation = dialer
                    stream.protocol = protocols[0]
                    return stream
                while dialer.selected is None:
                    data = await stream.read()
                    if not data:
                        raise StreamError(f"{stream.remote_peer} closed the stream while negotiating {protocols}")
                    dialer.receive_data(data)
                    if out := dialer.data_to_send():
                        await stream.write(out)
            except BaseException:
                stream.reset()
                raise
        stream.protocol = dialer.selected
        stream._unread(dialer.unused_data)
        return stream

    def _on_stream(self, stream: Stream) -> None:
        self._spawn(self._serve_stream(stream))

    async def _serve_stream(self, stream: Stream) -> None:
        listener = MultistreamListener(lambda protocol: protocol in self._handlers)
        try:
            async with asyncio.timeout(self.options.negotiate_timeout):
                await stream.write(listener.data_to_send())
                while listener.selected is None:
                    data = await stream.read(1024)
                    if not data:
                        return
                    listener.receive_data(data)
                    if out := listener.data_to_send():
                        await stream.write(out)
        except (TimeoutError, ProtocolError, StreamError, ConnectionError) as error:
            logger.debug(f"inbound stream from {stream.remote_peer} failed negotiation: {_describe(error)}")
            stream.reset()
            return
        stream.protocol = listener.selected
        stream._unread(listener.unused_data)
        handler = self._handlers.get(stream.protocol)
        try:
            await handler(stream)
        except (StreamError, ConnectionError, asyncio.IncompleteReadError) as error:
            logger.debug(f"{stream.protocol} stream from {stream.remote_peer} broke: {_describe(error)}")
            stream.reset()
        except Exception as error:  # a handler's bug must not take the host down
            logger.warning(f"handler for {stream.protocol} raised {error!r}", exc_info=True)
            stream.reset()

    # --- identify and ping --------------------------------------------------------------------------

    async def _serve_identify(self, stream: Stream) -> None:
        connection = stream.connection
        message = identify.encode_identify({
            "public_key": self.private_key.public_key.to_protobuf(),
            "listen_addrs": [addr.without_peer_id().to_bytes() for addr in self.get_visible_maddrs()],
            "protocols": self.protocols,
            "observed_addr": connection.remote_addr.to_bytes() if connection.remote_addr else None,
            "protocol_version": identify.PROTOCOL_VERSION,
            "agent_version": AGENT_VERSION,
        })
        await write_delimited(stream, message)
        await stream.close()

    async def push_identify(self, timeout: float = 5.0) -> None:
        """Send our identify to every connected peer (`/ipfs/id/push/1.0.0`), e.g. once a relay
        reservation gave us new circuit addresses (called by plexus/p2p/relay.py)."""
        async def push(peer: PeerID) -> None:
            try:
                async with asyncio.timeout(timeout):
                    await self._serve_identify(await self.new_stream(peer, identify.IDENTIFY_PUSH_PROTOCOL))
            except (TimeoutError, ProtocolError, StreamError, ConnectionError) as error:
                logger.debug(f"identify push to {peer} failed: {_describe(error)}")

        await asyncio.gather(*(push(peer) for peer in self.connected_peers()))

    async def _serve_identify_push(self, stream: Stream) -> None:
        data = await read_delimited(stream, identify.MAX_IDENTIFY_SIZE)
        if data is not None:
            self._apply_identify(stream.remote_peer, identify.decode_identify(data), stream.connection)

    async def _identify(self, connection: Connection) -> None:
        peer = connection.remote_peer
        event = self._identified.setdefault(peer, asyncio.Event())
        try:
            stream = connection.open_stream()
            dialer = MultistreamDialer([identify.IDENTIFY_PROTOCOL])
            await stream.write(dialer.data_to_send())
            stream._negotiation = dialer
            async with asyncio.timeout(self.options.negotiate_timeout):
                data = await read_delimited(stream, identify.MAX_IDENTIFY_SIZE)
            await stream.close()
            if data is not None:
                self._apply_identify(peer, identify.decode_identify(data), connection)
        except (TimeoutError, ProtocolError, StreamError, ConnectionError, asyncio.IncompleteReadError) as error:
            logger.debug(f"identify with {peer} failed: {_describe(error)}")
        finally:
            event.set()

    def _apply_identify(self, peer: PeerID, fields: dict, connection: Connection) -> None:
        info = self._peers.setdefault(peer, PeerInfo(peer))
        addrs = []
        for raw in fields.get("listen_addrs", []):
            try:
                addrs.append(Multiaddr.from_bytes(raw))
            except MultiaddrError:
                continue
        self.add_addrs(peer, [addr for addr in addrs if not _is_unspecified(addr)])
        info.protocols = list(fields.get("protocols", []))
        info.agent_version = fields.get("agent_version")
        if observed := fields.get("observed_addr"):
            try:
                info.observed_addr = Multiaddr.from_bytes(observed)
                self._observed_addrs[info.observed_addr] = self._observed_addrs.get(info.observed_addr, 0) + 1
            except MultiaddrError:
                pass

    async def identify(self, peer: PeerID, timeout: float | None = None) -> PeerInfo:
        """Wait for the identify exchange with a connected peer and return what it told us."""
        await self.connect(peer, timeout=timeout)
        async with asyncio.timeout(timeout):
            await self._identified.setdefault(peer, asyncio.Event()).wait()
        return self._peers[peer]

    async def _serve_ping(self, stream: Stream) -> None:
        while True:
            try:
                payload = await stream.readexactly(PING_SIZE)
            except asyncio.IncompleteReadError:
                break
            await stream.write(payload)
        await stream.close()

    async def ping(self, peer: PeerID | Multiaddr | str, timeout: float | None = 10.0) -> float:
        """Round-trip time to the peer in seconds, over `/ipfs/ping/1.0.0`."""
        async with asyncio.timeout(timeout):
            stream = await self.new_stream(peer, PING_PROTOCOL)
            payload = os.urandom(PING_SIZE)
            started = time.perf_counter()
            await stream.write(payload)
            echo = await stream.readexactly(PING_SIZE)
            rtt = time.perf_counter() - started
            await stream.close()
        if echo != payload:
            raise ProtocolError(f"{peer} answered our ping with different bytes")
        return rtt

    def __repr__(self) -> str:
        return f"<Host {self.peer_id} listening={[str(a) for a in self._listen_addrs]}>"


def _describe(error: BaseException) -> str:
    if isinstance(error, TimeoutError):
        return "timed out"
    if isinstance(error, ConnectionRefusedError):
        return "connection refused"
    return str(error) or type(error).__name__


def _is_unspecified(addr: Multiaddr) -> bool:
    try:
        return parse_host_port(addr)[0] in ("0.0.0.0", "::")
    except MultiaddrError:
        return False


def _share_port(sock: socket.socket) -> None:
    if not hasattr(socket, "SO_REUSEPORT"):
        logger.debug("this platform has no SO_REUSEPORT: hole punching will dial from other ports")
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    except OSError as error:
        logger.debug(f"cannot share listening port {sock.getsockname()}: {error}")


def local_ips(family: str) -> list[str]:
    """This machine's addresses of `family` ("ip4"/"ip6"), loopback first: what 0.0.0.0 or :: stand for."""
    loopback = "127.0.0.1" if family == "ip4" else "::1"
    ips = [loopback]
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET if family == "ip4" else socket.AF_INET6)
    except OSError:
        return ips
    for info in infos:
        ip = info[4][0].split("%")[0]
        if ip not in ips and not ip.startswith("127."):
            ips.append(ip)
    return ips
