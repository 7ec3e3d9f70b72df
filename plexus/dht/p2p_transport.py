"""The DHT's transport over a libp2p host: one `/plexus/dht/1.0.0` unary RPC per request.

The host authenticates the remote peer (Noise), so the handler learns the sender from the
connection, never from the message. Remote handler errors arrive as DHTRPCError, like the
in-memory network's, so the node treats both transports the same way.

`open_host_transport` is how a node gets a host of its own (hivemind's
`DHTNode.create(initial_peers=[maddrs])`): it starts one (or takes the caller's), and dials the
initial peers given as multiaddrs to learn their peer ids; a host it started closes with the node.
"""

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from ..p2p import rpc
from ..p2p.host import Host, HostOptions
from ..p2p.identity import PeerID, PrivateKey, load_or_create_identity
from ..p2p.multiaddr import Multiaddr, MultiaddrError, parse_host_port
from .messages import DHTRPCError
from .transport import DHTBootstrapError, RequestHandler

DHT_PROTOCOL = "/plexus/dht/1.0.0"
MAX_DHT_MESSAGE_SIZE = 8 << 20
MAX_SHARED_ADDRESSES = 8
MAX_CACHED_PEERS = 4096
MAX_CONCURRENT_REQUESTS_PER_PEER = 256  # a node sends at most DEFAULT_PARALLEL_RPC (256) requests at once


class HostDHTTransport:
    def __init__(self, host: Host, owns_host: bool = False):
        self.host, self.owns_host = host, owns_host
        self.local_peer_id: PeerID = host.peer_id
        # Every find response names ~20 peers with their addresses, both ways: keep each peer's
        # addresses in binary, valid while the host's list is unchanged (see `_binary_addresses`).
        self._binary: dict[PeerID, tuple] = {}

    async def call(self, peer: PeerID, request_bytes: bytes, timeout: float) -> bytes:
        try:
            return await rpc.call(
                self.host,
                peer,
                DHT_PROTOCOL,
                request_bytes,
                timeout=timeout,
                max_message_size=MAX_DHT_MESSAGE_SIZE,
            )
        except rpc.RPCError as error:
            raise DHTRPCError(str(error)) from None
        except rpc.RPCProtocolError as error:
            raise ConnectionError(f"{peer} broke the DHT protocol: {error}") from None

    def serve(self, handler: RequestHandler) -> None:
        async def serve(request: bytes, context: rpc.RPCContext) -> bytes:
            return await handler(context.remote_peer, request)

        rpc.add_handler(
            self.host,
            DHT_PROTOCOL,
            serve,
            max_message_size=MAX_DHT_MESSAGE_SIZE,
            max_concurrent_per_peer=MAX_CONCURRENT_REQUESTS_PER_PEER,
        )

    def _binary_addresses(self, peer: PeerID) -> tuple[bytes, ...]:
        """The host's addresses of `peer`, in binary, converted again only when the host's list
        changed (the list comparison is one identity check per address while it has not)."""
        info = self.host.peer_info(peer)
        if info is None or not info.addrs:
            return ()
        cached = self._binary.get(peer)
        if cached is not None and cached[0] is info and cached[1] == info.addrs:
            return cached[2]
        binary = tuple(addr.to_bytes() for addr in info.addrs)
        if cached is None and len(self._binary) >= MAX_CACHED_PEERS:
            self._binary.pop(next(iter(self._binary)))  # the oldest entry
        self._binary[peer] = (info, list(info.addrs), binary)
        return binary

    def known_addresses(self, peer: PeerID) -> tuple[bytes, ...]:
        return self._binary_addresses(peer)[:MAX_SHARED_ADDRESSES]

    def remote_ip(self, peer: PeerID) -> str | None:
        """The IP of the live direct connection to `peer`: the address it dialed us from, or the one
        we dialed (authenticated by the handshake, unlike the addresses a peer advertises)."""
        connection = self.host.get_connection(peer)
        addr = connection.remote_addr if connection is not None else None
        if addr is None or addr.is_circuit:
            return None
        try:
            return parse_host_port(addr)[0]
        except MultiaddrError:
            return None

    def add_addresses(self, addresses) -> None:
        for peer, raw_addrs in addresses:
            if peer == self.local_peer_id:
                continue
            known = self._binary_addresses(peer)
            if all(raw in known for raw in raw_addrs):
                continue  # nothing new: every find response names ~20 peers we mostly know already
            addrs = []
            for raw in raw_addrs:
                try:
                    addrs.append(Multiaddr.from_bytes(raw))
                except MultiaddrError:
                    continue  # one bad address from a peer does not spoil the others
            self.host.add_addrs(peer, addrs)

    async def close(self) -> None:
        self.host.remove_stream_handler(DHT_PROTOCOL)
        if self.owns_host:
            await self.host.shutdown()


Dial = Callable[[Multiaddr, float], Awaitable[PeerID]]


async def dial_initial_peers(
    host: Host, addrs: Sequence[Multiaddr], timeout: float, ensure_success: bool, dial: Dial | None = None
) -> list[PeerID]:
    """Dial every address at once; the peer ids that answered. With `ensure_success`, raise
    DHTBootstrapError naming each address and why, if none did."""
    if not addrs:
        return []

    async def connect(addr: Multiaddr, timeout: float) -> PeerID:
        return (await host.connect(addr, timeout=timeout)).peer

    dial = dial or connect
    results = await asyncio.gather(*(dial(addr, timeout) for addr in addrs), return_exceptions=True)
    connected = [result for result in results if isinstance(result, PeerID)]
    if not connected and ensure_success:
        reasons = "; ".join(f"{addr}: {result}" for addr, result in zip(addrs, results))
        raise DHTBootstrapError(
            f"failed to connect to bootstrap peers: could not reach any initial peer "
            f"(tried {reasons}). Are the addresses right and the ports open?"
        )
    return list(dict.fromkeys(connected))


async def open_host_transport(
    host: Host | None,
    initial_peers: Sequence,
    timeout: float,
    ensure_success: bool,
    host_maddrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
    announce_maddrs: Sequence[str] = (),
    identity_path: str | None = None,
) -> tuple[HostDHTTransport, list[PeerID]]:
    """A transport over `host` (or over a new one listening on `host_maddrs`, owned by the
    transport), and the peer ids of `initial_peers`, which may be PeerIDs or multiaddrs to dial."""
    owns_host = host is None
    if host is None:
        key = load_or_create_identity(identity_path) if identity_path else PrivateKey.generate()
        options = HostOptions(host_maddrs=tuple(host_maddrs), announce_maddrs=tuple(announce_maddrs))
        host = await Host(key, options).start()
    try:
        peer_ids = [peer for peer in initial_peers if isinstance(peer, PeerID)]
        addrs = [Multiaddr(peer) for peer in initial_peers if not isinstance(peer, PeerID)]
        peer_ids += await dial_initial_peers(host, addrs, timeout, ensure_success and not peer_ids)
    except BaseException:
        if owns_host:
            await host.shutdown()
        raise
    return HostDHTTransport(host, owns_host), list(dict.fromkeys(peer_ids))
