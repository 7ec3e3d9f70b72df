"""An in-memory network of DHT transports: many nodes, one event loop, no sockets.

Each `MemoryTransport` implements the DHT's transport interface (`local_peer_id`, `call`, `serve`,
`close`). A call hands the request bytes straight to the callee's handler as a task, so callee
work really interleaves with everything else on the loop, and returns the response bytes. Failure
modes for tests:
- `kill(peer)`: calls to it fail with ConnectionError at once (as a refused connection would);
- `make_unresponsive(peer)`: calls to it hang until the caller's timeout (TimeoutError);
- `latency`: each call waits that long before delivery (a scheduled delay, not synchronisation).
A handler that raises becomes `DHTRPCError` at the caller, as a remote error would. A transport
may be given a simulated IP (`create_transport(ip=...)`), which others see as `remote_ip`, so the
routing table's per-network bounds can be tested without sockets.
"""

import asyncio
from collections.abc import Awaitable, Callable

from ..dht.messages import DHTRPCError
from ..p2p.identity import PeerID, PrivateKey

Handler = Callable[[PeerID, bytes], Awaitable[bytes]]


class MemoryNetwork:
    def __init__(self, latency: float = 0.0):
        self.latency = latency
        self._handlers: dict[PeerID, Handler] = {}
        self._dead: set[PeerID] = set()
        self._unresponsive: set[PeerID] = set()
        self._ips: dict[PeerID, str] = {}
        self.calls = 0

    def create_transport(
        self, private_key: PrivateKey | None = None, ip: str | None = None
    ) -> "MemoryTransport":
        peer_id = (private_key or PrivateKey.generate()).peer_id
        if ip is not None:
            self._ips[peer_id] = ip
        return MemoryTransport(self, peer_id)

    def kill(self, peer_id: PeerID) -> None:
        self._dead.add(peer_id)
        self._handlers.pop(peer_id, None)

    def make_unresponsive(self, peer_id: PeerID, unresponsive: bool = True) -> None:
        (self._unresponsive.add if unresponsive else self._unresponsive.discard)(peer_id)

    def is_alive(self, peer_id: PeerID) -> bool:
        return peer_id in self._handlers

    async def _deliver(self, sender: PeerID, target: PeerID, request: bytes, timeout: float) -> bytes:
        self.calls += 1
        if sender in self._dead:
            raise ConnectionError(f"{sender} is dead and cannot call anyone")
        if self.latency:
            await asyncio.sleep(self.latency)
        else:
            await asyncio.sleep(0)  # a real transport always yields at least once
        handler = self._handlers.get(target)
        if handler is None:
            reason = "was killed" if target in self._dead else "is not serving (unknown or client-mode peer)"
            raise ConnectionError(f"connection to {target} refused: it {reason}")
        if target in self._unresponsive:
            await asyncio.sleep(timeout)
            raise TimeoutError(f"{target} did not answer within {timeout} s")
        try:
            return await asyncio.wait_for(handler(sender, bytes(request)), timeout)
        except TimeoutError:
            raise TimeoutError(f"{target} did not answer within {timeout} s") from None
        except (asyncio.CancelledError, DHTRPCError):
            raise
        except Exception as error:
            raise DHTRPCError(f"{target} failed to handle the request: {error!r}") from error


class MemoryTransport:
    """One node's end of a `MemoryNetwork`."""

    def __init__(self, network: MemoryNetwork, local_peer_id: PeerID):
        self.network, self.local_peer_id = network, local_peer_id
        self.closed = False

    async def call(self, peer: PeerID, request_bytes: bytes, timeout: float) -> bytes:
        if self.closed:
            raise ConnectionError(f"transport of {self.local_peer_id} is closed")
        return await self.network._deliver(self.local_peer_id, peer, request_bytes, timeout)

    def serve(self, handler: Handler) -> None:
        if self.local_peer_id in self.network._dead:
            raise ConnectionError(f"{self.local_peer_id} was killed and cannot serve")
        self.network._handlers[self.local_peer_id] = handler

    def known_addresses(self, peer: PeerID) -> tuple[bytes, ...]:
        return ()  # every peer is reachable by id alone on this network

    def remote_ip(self, peer: PeerID) -> str | None:
        return self.network._ips.get(peer)

    def add_addresses(self, addresses) -> None:
        pass

    async def close(self) -> None:
        self.closed = True
        self.network._handlers.pop(self.local_peer_id, None)

    def __repr__(self) -> str:
        return f"MemoryTransport({self.local_peer_id.short()}, closed={self.closed})"
