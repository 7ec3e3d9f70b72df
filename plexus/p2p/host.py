"""The libp2p host: listens, dials, keeps one connection per peer, opens and serves streams.

A Host owns TCP listeners, the live Connections (by peer), a small peer store (addresses learned
from dials and identify), and the stream handlers by protocol id. Every inbound stream is
negotiated with multistream-select under a deadline and then handed to its handler in its own
task; a handler that raises resets that stream and is logged, nothing more. Identify
(`/ipfs/id/1.0.0`, plexus/p2p/identify.py) runs on every new connection and ping
(`/ipfs/ping/1.0.0`, plexus/p2p/ping.py) is always served.

Bounds (every one a `HostOptions` field; plexus/p2p/limits.py keeps the counts). Inbound
connections are counted from the accepted socket on, in total, while handshaking, per IP and per
subnet, and rate-limited per IP; connections per peer once the handshake names it. Inbound streams
are counted per peer and, for protocols registered with `max_per_peer`, per peer and protocol. A
new inbound stream must pick its protocol within `negotiate_timeout` and send its first bytes
within `request_timeout` after that, or it is reset. With an `authorizer`, streams from a peer that
has shown no valid access token are refused (plexus/p2p/auth.py). A connection on which nothing
arrived for `idle_timeout` is closed whatever streams are open on it; while a stream we opened is
waiting, we ping the peer so that neither side takes the connection for idle. Each refusal is
logged once per peer and minute (`refused`).

The host never blocks: all of it runs on the caller's event loop, and `shutdown()` closes the
listeners, the connections and every task it started.
"""

import asyncio
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from ..errors import PeerError
from ..utils.logging import RateLimitedLog, get_logger
from .auth import AUTH_PROTOCOL, AuthGate, AuthorizerBase
from .connection import Connection, OptimismRefused, TrafficCounter, host_decrypt_buffers
from .host_options import HostOptions
from .identify import AGENT_VERSION, IdentifyService, describe
from .identity import PeerID, PrivateKey
from .limits import Counter, InboundConnections, InboundTicket
from .multiaddr import Multiaddr, MultiaddrError, from_socket_address, parse_host_port
from .ping import PING_PROTOCOL, PING_SIZE, PingService
from .pnet import PrivateNetworkLayer
from .protocols import noise
from .protocols.errors import ProtocolError
from .protocols.multistream import MultistreamDialer, MultistreamListener
from .stream import Stream, StreamError

logger = get_logger(__name__)

MAX_KNOWN_PEERS = 10_000
MAX_ADDRS_PER_PEER = 16
__all__ = ["AGENT_VERSION", "PING_PROTOCOL", "PING_SIZE", "DialError", "Host", "HostOptions", "PeerInfo"]

StreamHandler = Callable[[Stream], Awaitable[None]]


class DialError(PeerError, ConnectionError):
    """Could not reach a peer; the message lists each address tried and why it failed."""


@dataclass
class PeerInfo:
    """What we know of a peer: its id, addresses and, after identify, its protocols."""

    peer_id: PeerID
    addrs: list[Multiaddr] = field(default_factory=list)
    protocols: list[str] = field(default_factory=list)
    agent_version: str | None = None
    observed_addr: Multiaddr | None = None
    refuses_optimism: bool = False
    """It refused our first cipher suite with a Noise message sent along (see `Connection.upgrade`)."""


class Host:
    """A libp2p peer speaking TCP + Noise + yamux, with identify and ping."""

    def __init__(
        self,
        private_key: PrivateKey | None = None,
        options: HostOptions | None = None,
        *,
        authorizer: AuthorizerBase | None = None,
        **kwargs,
    ):
        """
        Args:
            options: the host's bounds and settings (or pass HostOptions' fields as keyword arguments).
            authorizer: admit only peers it accepts, on every protocol (a private swarm, plexus/p2p/auth.py).
        """
        self.private_key = private_key or PrivateKey.generate()
        self.peer_id = self.private_key.peer_id
        self.options = options or HostOptions(**kwargs)
        self._handlers: dict[str, StreamHandler] = {}
        self._max_per_peer: dict[str, int] = {}  # protocol -> inbound streams one peer may hold on it
        self._connections: dict[PeerID, list[Connection]] = {}
        self._decrypt_buffers = host_decrypt_buffers()
        self.traffic = TrafficCounter()
        """Bytes all of this host's connections sent and received, ever (see `TrafficCounter`)."""
        self._pending_dials: dict[PeerID, asyncio.Task] = {}
        self._peers: dict[PeerID, PeerInfo] = {}
        self._servers: list[asyncio.AbstractServer] = []
        self._listen_addrs: list[Multiaddr] = []
        self._tasks: set[asyncio.Task] = set()
        self._running = False
        options = self.options
        self._inbound = InboundConnections(
            max_total=options.max_connections,
            max_pending=options.max_pending_connections,
            per_ip=options.max_connections_per_ip,
            per_subnet=options.max_connections_per_subnet,
            rate_per_ip=options.max_connection_rate_per_ip,
            exempt_networks=options.limit_exempt_networks,
        )
        self._tickets: dict[Connection, InboundTicket] = {}
        self._inbound_streams = Counter()  # by peer, and by (peer, protocol)
        self._refusals = RateLimitedLog(logger)
        self._routing: set[PeerID] = set()  # peers whose addresses the peer router is looking up
        self.peer_router: Callable[[PeerID], Awaitable[None]] | None = None
        """Called to find addresses of a peer we must dial but know no address of (set by the DHT)."""
        # Hooks for transports that live in their own modules (circuit relay: plexus/p2p/relay.py).
        self.circuit_dialer: Callable[[PeerID, Multiaddr], Awaitable[Connection]] | None = None
        """Dials a /p2p-circuit address and returns the relayed Connection (set by RelayClient)."""
        self.address_sources: list[Callable[[], Iterable[Multiaddr]]] = []
        """Extra addresses to advertise, e.g. /p2p/<relay>/p2p-circuit ones (added to visible addrs)."""
        self.identify_service = IdentifyService(self)
        self.ping_service = PingService(self)
        self.auth_gate = AuthGate(self, authorizer, self.options.negotiate_timeout) if authorizer else None

    # --- life cycle --------------------------------------------------------------------------------

    async def start(self) -> "Host":
        loop = asyncio.get_running_loop()
        for text in self.options.host_maddrs:
            host, port, family = parse_host_port(Multiaddr(text))
            server = await loop.create_server(
                lambda: self._accept(),
                host,
                port,
                family=socket.AF_INET6 if family == "ip6" else socket.AF_INET,
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
        if self.auth_gate is not None:
            self.auth_gate.start()
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
                addrs.extend(addr for addr in self.identify_service.observed_addrs if addr not in addrs)
        for source in self.address_sources:  # relay addresses (plexus/p2p/relay.py)
            addrs.extend(source())
        return [addr.with_peer_id(self.peer_id) for addr in dict.fromkeys(addrs)]

    def peer_store_entry(self, peer_id: PeerID) -> PeerInfo:
        """What we know of a peer, made empty if we knew nothing (the store is bounded in peers)."""
        info = self._peers.get(peer_id)
        if info is None:
            if len(self._peers) >= MAX_KNOWN_PEERS:
                self._forget_a_disconnected_peer()
            info = self._peers[peer_id] = PeerInfo(peer_id)
        return info

    def add_addrs(self, peer_id: PeerID, addrs: Iterable[Multiaddr]) -> None:
        """Remember where a peer can be dialed (newest first; bounded per peer and in peers)."""
        info = self.peer_store_entry(peer_id)
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
                self.identify_service.forget(peer_id)
                return

    def peer_info(self, peer_id: PeerID) -> PeerInfo | None:
        return self._peers.get(peer_id)

    # --- connections --------------------------------------------------------------------------------

    def _accept(self) -> "_Gate":
        return _Gate(self)

    def _admit(self, transport: asyncio.Transport) -> None:
        """An accepted socket: refuse it at once if its source is past a bound, else start its upgrade."""
        peername = transport.get_extra_info("peername")
        ip = peername[0] if peername else None
        ticket, refusal = (
            self._inbound.admit(ip, asyncio.get_running_loop().time())
            if self._running
            else (None, "the host is shutting down")
        )
        if ticket is None:
            self.refused(("inbound connection", ip), f"refused an inbound connection from {ip}: {refusal}")
            transport.abort()
            return
        connection = self.make_connection(initiator=False)
        self._tickets[connection] = ticket  # given back when the connection closes (_on_close)
        protocol = self.protect(connection)
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        self._spawn(self._upgrade_inbound(connection))

    async def _upgrade_inbound(self, connection: Connection) -> None:
        ticket = self._tickets[connection]
        try:
            async with asyncio.timeout(self.options.dial_timeout):
                await connection.upgrade()
        except (TimeoutError, OSError, ProtocolError) as error:
            logger.debug(f"inbound connection from {connection.remote_addr} failed its upgrade: {error!r}")
            connection.abort(f"upgrade failed: {error!r}")
            return
        self._inbound.upgraded(ticket)
        self._register(connection)

    def _register(self, connection: Connection) -> None:
        peer, limit = connection.peer, self.options.max_connections_per_peer
        if connection.is_closed:
            return
        if not connection.initiator and len(self._connections.get(peer, ())) >= limit:
            self.refused(
                ("connections per peer", peer),
                f"closed a new connection from {peer} at "
                f"{connection.remote_addr}: it already has {limit} "
                f"(max_connections_per_peer)",
            )
            connection.abort("too many connections from this peer")
            return
        self._connections.setdefault(peer, []).append(connection)
        if connection.initiator and connection.remote_addr is not None:
            self.add_addrs(peer, [connection.remote_addr])
        if self.auth_gate is not None:
            self.auth_gate.connection_opened(connection)
        self._spawn(self.identify_service.run(connection))

    def _on_close(self, connection: Connection) -> None:
        ticket = self._tickets.pop(connection, None)
        if ticket is not None:
            self._inbound.release(ticket)
        if connection.remote_peer is None:  # it closed before its upgrade finished: never registered
            return
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
        return Connection(
            self.private_key,
            initiator=initiator,
            expected_peer=expected_peer,
            on_stream=self._on_stream,
            on_close=self._on_close,
            max_streams=self.options.max_streams_per_connection,
            noise_suites=tuple(noise.SUITES[name] for name in self.options.noise_ciphers),
            decrypt_buffers=self._decrypt_buffers,
            traffic=self.traffic,
        )

    def protect(self, connection: Connection) -> asyncio.BufferedProtocol:
        """What a transport must drive for `connection`: the connection itself, or in a private network
        (`swarm_key`) the layer that encrypts every byte with the key (plexus/p2p/pnet.py)."""
        if self.options.swarm_key is None:
            return connection
        return PrivateNetworkLayer(self.options.swarm_key, connection)

    def add_connection(self, connection: Connection) -> None:
        """Adopt an upgraded Connection made by another transport (identify runs on it)."""
        self._register(connection)

    def connections_to(self, peer_id: PeerID) -> list[Connection]:
        """Every live connection to the peer (direct and relayed)."""
        return [connection for connection in self._connections.get(peer_id, ()) if not connection.is_closed]

    def connected_peers(self) -> list[PeerID]:
        return [peer for peer, connections in self._connections.items() if connections]

    async def connect(self, target: Multiaddr | str | PeerID, timeout: float | None = None) -> Connection:
        """Return a live connection to a peer, dialing it if needed.

        `target` is a multiaddr ending in /p2p/<id> or a peer id whose addresses we know.
        Concurrent calls for the same peer share one dial.
        """
        peer_id: PeerID | None
        if isinstance(target, PeerID):
            peer_id, addrs = target, None
        else:
            addr = Multiaddr(target) if isinstance(target, str) else target
            peer_id = addr.peer_id
            if peer_id is None:
                raise DialError(
                    f"cannot dial {addr}: it has no /p2p/<peer id> part, so the peer cannot be authenticated"
                )
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
            dial = self._pending_dials[peer_id] = asyncio.get_running_loop().create_task(
                self._dial(peer_id, addrs)
            )
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
                failures.append(f"{addr}: {describe(error)}")
        raise DialError(f"could not connect to {peer_id} (tried {'; '.join(failures)})")

    async def _dial_addr(self, peer_id: PeerID, addr: Multiaddr) -> Connection:
        if addr.is_circuit:  # /…/p2p/<relay>/p2p-circuit: dialed by plexus/p2p/relay.py
            if self.circuit_dialer is None:
                raise DialError(f"{addr} is a relay address, but this host has no relay client")
            return await self.circuit_dialer(peer_id, addr)
        host, port, _ = parse_host_port(addr)
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.options.dial_timeout):
            optimistic = not self.peer_store_entry(peer_id).refuses_optimism
            while True:
                connection = self.make_connection(initiator=True, expected_peer=peer_id)
                try:
                    await loop.create_connection(lambda: self.protect(connection), host, port)
                    await connection.upgrade(optimistic=optimistic)
                    break
                except OptimismRefused:
                    # a peer that lacks our first cipher suite (a plain libp2p one): dial it again the
                    # slow way, and from now on at once
                    connection.abort("dial failed: the listener refused our first cipher suite")
                    self.peer_store_entry(peer_id).refuses_optimism = True
                    optimistic = False
                except BaseException as error:
                    connection.abort(f"dial failed: {error!r}")
                    raise
        self._register(connection)
        return connection

    async def disconnect(self, peer_id: PeerID) -> None:
        for connection in list(self._connections.get(peer_id, ())):
            await connection.close()

    async def _close_idle_connections(self) -> None:
        """Close connections on which nothing arrived for idle_timeout, open streams or not; ping the
        peer on those where a stream of ours waits, so that neither side closes them meanwhile."""
        idle_timeout = self.options.idle_timeout
        period = max(idle_timeout / 4, 0.05)
        while True:
            await asyncio.sleep(period)  # a periodic sweep, not synchronisation
            now = asyncio.get_running_loop().time()
            for connections in list(self._connections.values()):
                for connection in list(connections):
                    quiet = now - connection.last_activity
                    if quiet > idle_timeout:
                        logger.debug(
                            f"closing {connection}: nothing arrived for {quiet:.1f} s (idle_timeout)"
                        )
                        await connection.close()
                    elif quiet > idle_timeout / 2 and connection.has_outbound_streams():
                        connection.keepalive()

    # --- streams ------------------------------------------------------------------------------------

    def set_stream_handler(
        self, protocol: str, handler: StreamHandler, *, max_per_peer: int | None = None
    ) -> None:
        """Serve `protocol` with `handler(stream)`; with `max_per_peer`, at most that many of one peer's
        streams on it at once (more are reset). Every protocol shares `max_inbound_streams_per_peer`."""
        self._handlers[protocol] = handler
        if max_per_peer is None:
            self._max_per_peer.pop(protocol, None)
        else:
            self._max_per_peer[protocol] = max_per_peer

    def remove_stream_handler(self, protocol: str) -> None:
        self._handlers.pop(protocol, None)
        self._max_per_peer.pop(protocol, None)

    def refused(self, key: tuple, message: str) -> None:
        """Log a refusal or a limit hit, once a minute per `key` (its first item names the kind)."""
        self._refusals.warning(key, message)

    @property
    def protocols(self) -> list[str]:
        return list(self._handlers)

    async def new_stream(
        self,
        peer: PeerID | Multiaddr | str,
        protocols: list[str] | str,
        *,
        timeout: float | None = None,
        lazy: bool = False,
    ) -> Stream:
        """Open a stream to `peer` speaking the first of `protocols` the peer accepts.

        With `lazy=True` and a single protocol, the proposal travels with the first data and the
        answer is read with the first reply, saving a round trip (the peer's refusal then shows up
        as an error on the first read).
        """
        if isinstance(protocols, str):
            protocols = [protocols]
        async with asyncio.timeout(timeout):
            connection = await self.connect(peer)
            if self.auth_gate is not None:
                await self.auth_gate.check_outbound(connection)
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
                        raise StreamError(
                            f"{stream.remote_peer} closed the stream while negotiating {protocols}"
                        )
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
        peer, options = stream.remote_peer, self.options
        if not self._inbound_streams.acquire(peer, options.max_inbound_streams_per_peer):
            self.refused(
                ("streams per peer", peer),
                f"reset a new stream from {peer}: it holds "
                f"{options.max_inbound_streams_per_peer} "
                f"(max_inbound_streams_per_peer)",
            )
            stream.reset()
            return
        try:
            protocol = await self._negotiate_inbound(stream)
            if protocol is None:
                return
            if self.auth_gate is not None and protocol != AUTH_PROTOCOL:
                refusal = await self.auth_gate.admit(stream)
                if refusal is not None:
                    self.refused(
                        ("unauthorized stream", peer), f"refused a {protocol} stream from {peer}: {refusal}"
                    )
                    stream.reset()
                    return
            if not self._inbound_streams.acquire((peer, protocol), self._max_per_peer.get(protocol)):
                self.refused(
                    ("streams per protocol", peer, protocol),
                    f"reset a new {protocol} stream from {peer}: it holds "
                    f"{self._max_per_peer[protocol]} on this protocol already",
                )
                stream.reset()
                return
            try:
                await self._run_handler(stream, protocol)
            finally:
                self._inbound_streams.release((peer, protocol))
        finally:
            self._inbound_streams.release(peer)

    async def _negotiate_inbound(self, stream: Stream) -> str | None:
        listener = MultistreamListener(lambda protocol: protocol in self._handlers)
        try:
            async with asyncio.timeout(self.options.negotiate_timeout):
                await stream.write(listener.data_to_send())
                while listener.selected is None:
                    data = await stream.read(1024)
                    if not data:
                        return None
                    listener.receive_data(data)
                    if out := listener.data_to_send():
                        await stream.write(out)
        except TimeoutError:
            self.refused(
                ("negotiation timeout", stream.remote_peer),
                f"reset a stream from {stream.remote_peer}: no protocol picked within "
                f"{self.options.negotiate_timeout} s (negotiate_timeout)",
            )
            stream.reset()
            return None
        except (ProtocolError, StreamError, ConnectionError) as error:
            logger.debug(f"inbound stream from {stream.remote_peer} failed negotiation: {describe(error)}")
            stream.reset()
            return None
        stream.protocol = listener.selected
        stream._unread(listener.unused_data)
        return stream.protocol

    async def _run_handler(self, stream: Stream, protocol: str) -> None:
        """Run the protocol's handler; reset the stream if its first bytes do not come in time."""
        watchdog = None
        if not listener_left_data(stream):
            received = stream.bytes_received
            watchdog = asyncio.get_running_loop().call_later(
                self.options.request_timeout, self._check_first_bytes, stream, received
            )
        try:
            await self._handlers[protocol](stream)
        except (StreamError, ConnectionError, asyncio.IncompleteReadError) as error:
            logger.debug(f"{stream.protocol} stream from {stream.remote_peer} broke: {describe(error)}")
            stream.reset()
        except Exception as error:  # a handler's bug must not take the host down
            logger.warning(f"handler for {stream.protocol} raised {error!r}", exc_info=True)
            stream.reset()
        finally:
            if watchdog is not None:
                watchdog.cancel()

    def _check_first_bytes(self, stream: Stream, received_at_negotiation: int) -> None:
        if stream.bytes_received == received_at_negotiation and not stream.is_reset:
            self.refused(
                ("silent stream", stream.remote_peer),
                f"reset a {stream.protocol} stream from {stream.remote_peer}: it sent nothing "
                f"within {self.options.request_timeout} s of opening (request_timeout)",
            )
            stream.reset()

    # --- identify and ping (plexus/p2p/identify.py, plexus/p2p/ping.py) -----------------------------

    async def push_identify(self, timeout: float = 5.0) -> None:
        """Send our identify to every connected peer (`/ipfs/id/push/1.0.0`), e.g. once a relay
        reservation gave us new circuit addresses (called by plexus/p2p/relay.py)."""
        await self.identify_service.push(timeout)

    async def identify(self, peer: PeerID, timeout: float | None = None) -> PeerInfo:
        """Wait for the identify exchange with a connected peer and return what it told us."""
        await self.connect(peer, timeout=timeout)
        async with asyncio.timeout(timeout):
            await self.identify_service.wait(peer)
        return self._peers[peer]

    async def ping(self, peer: PeerID | Multiaddr | str, timeout: float | None = 10.0) -> float:
        """Round-trip time to the peer in seconds, over `/ipfs/ping/1.0.0`."""
        return await self.ping_service.ping(peer, timeout)

    def __repr__(self) -> str:
        return f"<Host {self.peer_id} listening={[str(a) for a in self._listen_addrs]}>"


class _Gate(asyncio.Protocol):
    """The first protocol of an accepted socket. It asks the host to admit the socket before any
    connection state exists (a refusal costs an accept and a close), and the host hands the socket
    over to a new Connection."""

    def __init__(self, host: Host):
        self.host = host

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # a TCP server's
        self.host._admit(transport)

    def data_received(self, data: bytes) -> None:  # the socket was refused: whatever comes is dropped
        pass


def listener_left_data(stream: Stream) -> bool:
    """Whether bytes past the protocol proposal are already buffered (a lazy proposal brings the request)."""
    return bool(stream._peek(1))


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
        infos = socket.getaddrinfo(
            socket.gethostname(), None, socket.AF_INET if family == "ip4" else socket.AF_INET6
        )
    except OSError:
        return ips
    for info in infos:
        ip = str(info[4][0]).split("%")[0]
        if ip not in ips and not ip.startswith("127."):
            ips.append(ip)
    return ips
