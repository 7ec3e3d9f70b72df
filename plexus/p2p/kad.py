"""A libp2p Kademlia DHT peer (`/ipfs/kad/1.0.0`) over a Host, for peer routing: `use_ipfs`.

`KademliaClient.bootstrap()` dials the bootstrap peers (by default the public IPFS ones), keeps
those that serve the protocol in its table and looks up its own id, which fills the table with
the servers closest to us. Serving the protocol (`serve=True`, for listening peers) makes us a DHT
server in their eyes: go-libp2p adds a peer to its routing table when identify lists the
protocol and the peer answers a FIND_NODE, and then names us, with our addresses, to anyone who
looks our id up. `find_peer(peer_id)` runs that lookup (protocols.kad.PeerLookup) and hands the
addresses it finds to the host, so `host.connect(peer_id)` can dial a peer known only by its id.

Every request has a deadline, every inbound stream an idle timeout and a cap on its requests, and
a lookup asks at most `max_queries` peers. Candidates without a known address are never dialed
(the host would ask its peer router, which may be us). `/dnsaddr/` bootstrap entries need a DNS
TXT lookup, which is left out: they are skipped, and the literal IP entries are used.
"""

import asyncio

from ..errors import PeerError
from ..utils.logging import get_logger
from .host import DialError, Host
from .identity import PeerID
from .multiaddr import Multiaddr, MultiaddrError
from .protocols import kad as core
from .protocols.errors import ProtocolError, RemoteProtocolError
from .protocols.kad import KadMessage, KadPeer, KadTable, MessageType, PeerLookup
from .stream import Stream, StreamError, read_delimited, write_delimited

logger = get_logger(__name__)

IPFS_BOOTSTRAP_PEERS = (
    "/dnsaddr/bootstrap.libp2p.io/p2p/QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN",
    "/dnsaddr/bootstrap.libp2p.io/p2p/QmQCU2EcMqAqQPR2i9bChDtGNJchTbq5TbXJJ16u19uLTa",
    "/dnsaddr/bootstrap.libp2p.io/p2p/QmbLHAnMoJPWSCR5Zhtx6BHJX9KiKNN6tpvbUcqanj75Nb",
    "/dnsaddr/bootstrap.libp2p.io/p2p/QmcZf59bWwK5XFi76CZX8cbJ4BhTzzA3gU1ZjYZcYW3dwt",
    "/ip4/104.131.131.82/tcp/4001/p2p/QmaCpDMGvV2BGHeYERUEnRQAwe3N8SzbUtfsmvsqQLuvuJ",
)
REQUEST_TIMEOUT = 5.0
STREAM_IDLE_TIMEOUT = 30.0
MAX_REQUESTS_PER_STREAM = 64
MAX_CONCURRENT_STREAMS = 64


class KademliaError(PeerError, ConnectionError):
    """The Kademlia DHT could not be joined or did not find a peer; the message says what was tried."""


class KademliaClient:
    def __init__(
        self,
        host: Host,
        *,
        serve: bool = True,
        request_timeout: float = REQUEST_TIMEOUT,
        max_queries: int = 64,
    ):
        self.host, self.serve, self.request_timeout, self.max_queries = (
            host,
            serve,
            request_timeout,
            max_queries,
        )
        self.table = KadTable(host.peer_id)
        self._serving = 0

    def start(self) -> "KademliaClient":
        if self.serve:
            self.host.set_stream_handler(core.PROTOCOL, self._serve)
        return self

    async def stop(self) -> None:
        self.host.remove_stream_handler(core.PROTOCOL)

    # --- joining ----------------------------------------------------------------------------------

    async def bootstrap(self, addrs: list[Multiaddr], timeout: float = 20.0) -> int:
        """Dial the bootstrap peers, then look ourselves up; returns how many DHT servers we know.
        Raises KademliaError, naming every address and why, when no bootstrap peer answered."""
        usable = [addr for addr in addrs if addr.peer_id is not None and "dnsaddr" not in addr.protocols()]
        if len(usable) < len(addrs):
            logger.debug(
                f"skipping {len(addrs) - len(usable)} bootstrap address(es) without a peer id or "
                f"needing a dnsaddr lookup"
            )
        results = await asyncio.gather(
            *(self._join(addr, timeout) for addr in usable), return_exceptions=True
        )
        if not len(self.table):
            reasons = (
                "; ".join(f"{addr}: {result}" for addr, result in zip(usable, results)) or "no usable address"
            )
            raise KademliaError(f"could not join the Kademlia DHT (tried {reasons})")
        await self.lookup(self.host.peer_id)
        logger.debug(f"joined the Kademlia DHT: {len(self.table)} servers known")
        return len(self.table)

    async def _join(self, addr: Multiaddr, timeout: float) -> None:
        info = await self.host.identify(
            (await self.host.connect(addr, timeout=timeout)).peer, timeout=timeout
        )
        if core.PROTOCOL not in info.protocols:
            raise KademliaError(f"{addr.peer_id} does not serve {core.PROTOCOL}")
        self.table.add(info.peer_id, [a.to_bytes() for a in info.addrs])

    # --- lookups ----------------------------------------------------------------------------------

    async def find_peer(self, peer_id: PeerID) -> list[Multiaddr]:
        """Addresses of `peer_id` from the DHT (also given to the host); empty if it was not found."""
        lookup = await self.lookup(peer_id)
        if lookup.found is None:
            logger.debug(f"the Kademlia DHT does not know {peer_id} ({lookup.queries} peers asked)")
            return []
        addrs = []
        for raw in lookup.found.addrs:
            try:
                addrs.append(Multiaddr.from_bytes(raw))
            except MultiaddrError:
                continue
        self.host.add_addrs(peer_id, addrs)
        return addrs

    async def lookup(self, target: PeerID) -> PeerLookup:
        seeds = [KadPeer(peer, self._addrs_of(peer)) for peer in self.table.closest(target.to_bytes())]
        lookup = PeerLookup(target, seeds, self.host.peer_id, max_queries=self.max_queries)
        running: dict[asyncio.Task, PeerID] = {}
        try:
            while not lookup.done:
                for peer in lookup.next_queries():
                    task = asyncio.ensure_future(self._find_node(peer, target))
                    running[task] = peer.peer_id
                if not running:
                    break
                finished, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in finished:
                    peer_id = running.pop(task)
                    if task.exception() is None:
                        lookup.on_answer(peer_id, task.result())
                        self.table.add(peer_id)
                    else:
                        logger.debug(f"Kademlia FIND_NODE to {peer_id} failed: {task.exception()!r}")
                        lookup.on_failure(peer_id)
                        self.table.remove(peer_id)
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
        return lookup

    async def _find_node(self, peer: KadPeer, target: PeerID) -> KadMessage:
        addrs = []
        for raw in peer.addrs:
            try:
                addrs.append(Multiaddr.from_bytes(raw))
            except MultiaddrError:
                continue
        if self.host.get_connection(peer.peer_id) is None:
            if not addrs and not self._addrs_of(peer.peer_id):
                raise DialError(f"no address known for {peer.peer_id}")
            self.host.add_addrs(peer.peer_id, addrs)
        return await self.request(peer.peer_id, KadMessage(MessageType.FIND_NODE, target.to_bytes()))

    async def request(self, peer: PeerID, message: KadMessage) -> KadMessage:
        """One request, one answer of the same type, within request_timeout."""
        async with asyncio.timeout(self.request_timeout):
            stream = await self.host.new_stream(peer, core.PROTOCOL)
            try:
                await write_delimited(stream, core.encode(message))
                data = await read_delimited(stream, core.MAX_MESSAGE_SIZE)
                if data is None:
                    raise StreamError(f"{peer} closed the Kademlia stream without answering")
                answer = core.decode(data)
                if answer.type is not message.type:
                    raise RemoteProtocolError(
                        f"{peer} answered a {message.type.name} with a {answer.type.name}"
                    )
            except BaseException:
                stream.reset()
                raise
            await stream.close()
        return answer

    def _addrs_of(self, peer: PeerID) -> tuple[bytes, ...]:
        info = self.host.peer_info(peer)
        return tuple(addr.to_bytes() for addr in info.addrs if not addr.is_circuit) if info else ()

    # --- serving ----------------------------------------------------------------------------------

    async def _serve(self, stream: Stream) -> None:
        if self._serving >= MAX_CONCURRENT_STREAMS:
            stream.reset()
            return
        self._serving += 1
        requester = stream.remote_peer
        local = KadPeer(
            self.host.peer_id,
            tuple(a.without_peer_id().to_bytes() for a in self.host.get_visible_maddrs()),
            core.Connectedness.CONNECTED,
        )
        try:
            for _ in range(MAX_REQUESTS_PER_STREAM):
                async with asyncio.timeout(STREAM_IDLE_TIMEOUT):
                    data = await read_delimited(stream, core.MAX_MESSAGE_SIZE)
                if data is None:
                    break
                request = core.decode(data)
                reply = core.answer(request, self.table, self._addrs_of, local, requester)
                if reply is None:  # PUT_VALUE, ADD_PROVIDER: we keep no records
                    logger.debug(f"ignoring a Kademlia {request.type.name} from {requester}")
                    break
                await write_delimited(stream, core.encode(reply))
            await stream.close()
        except (
            TimeoutError,
            ProtocolError,
            StreamError,
            ConnectionError,
            asyncio.IncompleteReadError,
        ) as error:
            logger.debug(f"Kademlia stream from {requester} ended: {error!r}")
            stream.reset()
        finally:
            self._serving -= 1
