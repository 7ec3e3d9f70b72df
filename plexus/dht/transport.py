"""What the DHT node needs from the network: send request bytes to a peer, serve ours, close.

The libp2p host (`/plexus/dht/1.0.0` streams) and `plexus.testing.MemoryNetwork` both implement
it, so every DHT behaviour is testable without sockets. Messages cross it as bytes
(`plexus.dht.messages`); the transport authenticates the remote PeerID, which is why messages
carry no sender address.
"""

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from ..errors import PeerError
from ..p2p.identity import PeerID

RequestHandler = Callable[[PeerID, bytes], Awaitable[bytes]]


class DHTBootstrapError(PeerError, ConnectionError):
    """None of the initial peers could be reached or answered; the message names each one and why.

    Code written for hivemind catches it as `P2PDaemonError` (see plexus.compat)."""


class DHTTransport(Protocol):
    local_peer_id: PeerID

    async def call(self, peer: PeerID, request_bytes: bytes, timeout: float) -> bytes:
        """Send one request and return the response bytes. Raises TimeoutError, ConnectionError
        (or another OSError), or `plexus.dht.messages.DHTRPCError(message)` on failure."""

    def serve(self, handler: RequestHandler) -> None:
        """Route incoming requests to `handler(sender, request_bytes) -> response_bytes`.
        Never called for a client-mode node."""

    def known_addresses(self, peer: PeerID) -> Sequence[bytes]:
        """Binary multiaddrs we can share so that others can dial `peer` (may be empty)."""

    def remote_ip(self, peer: PeerID) -> str | None:
        """The IP address our connection to `peer` runs to (None: unknown, e.g. relayed), which
        the routing table's diversity bounds count the peer against."""

    def add_addresses(self, addresses: Sequence[tuple[PeerID, Sequence[bytes]]]) -> None:
        """Remember addresses that another peer shared, so that we can dial the peers it named."""

    async def close(self) -> None:
        """Stop serving and drop connections; later calls fail with ConnectionError."""
