"""The DHT's transport over a libp2p host: one `/plexus/dht/1.0.0` unary RPC per request.

The host authenticates the remote peer (Noise), so the handler learns the sender from the
connection, never from the message. Remote handler errors arrive as DHTRPCError, like the
in-memory network's, so the node treats both transports the same way.
"""

from ..p2p import rpc
from ..p2p.host import Host
from ..p2p.identity import PeerID
from ..p2p.multiaddr import Multiaddr, MultiaddrError
from .messages import DHTRPCError
from .transport import RequestHandler

DHT_PROTOCOL = "/plexus/dht/1.0.0"
MAX_DHT_MESSAGE_SIZE = 8 << 20
MAX_SHARED_ADDRESSES = 8
MAX_CACHED_PEERS = 4096
MAX_CONCURRENT_REQUESTS_PER_PEER = 256  # a node sends at most DEFAULT_PARALLEL_RPC (256) requests at once


class HostDHTTransport:
    def __init__(self, host: Host):
        self.host = host
        self.local_peer_id: PeerID = host.peer_id
        # Every find response names ~20 peers with their addresses, both ways: keep each peer's
        # addresses in binary, valid while the host's list is unchanged (see `_binary_addresses`).
        self._binary: dict[PeerID, tuple] = {}

    async def call(self, peer: PeerID, request_bytes: bytes, timeout: float) -> bytes:
        try:
            return await rpc.call(self.host, peer, DHT_PROTOCOL, request_bytes, timeout=timeout,
                                  max_message_size=MAX_DHT_MESSAGE_SIZE)
        except rpc.RPCError as error:
            raise DHTRPCError(str(error)) from None
        except rpc.RPCProtocolError as error:
            raise ConnectionError(f"{peer} broke the DHT protocol: {error}") from None

    def serve(self, handler: RequestHandler) -> None:
        async def serve(request: bytes, context: rpc.RPCContext) -> bytes:
            return await handler(context.remote_peer, request)

        rpc.add_handler(self.host, DHT_PROTOCOL, serve, max_message_size=MAX_DHT_MESSAGE_SIZE,
                        max_concurrent_per_peer=MAX_CONCURRENT_REQUESTS_PER_PEER)

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
