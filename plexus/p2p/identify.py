"""Identify over a Host: each peer tells the other its key, addresses, protocols and what it sees of us.

Every new connection runs identify once (`/ipfs/id/1.0.0`): we open a stream, the peer writes one
identify message and closes. A peer whose addresses change pushes a fresh one to every connected
peer (`/ipfs/id/push/1.0.0`, e.g. once a relay reservation gave it circuit addresses). What a peer
says goes into the host's peer store; the address it observed us at is remembered too, for AutoNAT
and hole punching.

What a peer tells us is a claim, and bounded as one: a message is at most MAX_IDENTIFY_SIZE and
must arrive within the host's `request_timeout`; a peer may run at most MAX_STREAMS_PER_PEER
identify or push streams at once; of its addresses only the first MAX_LISTEN_ADDRS are read and
only parseable, specified ones kept (the host keeps the newest few); and our observed addresses
are at most MAX_OBSERVED_ADDRS, counted by distinct observers, so that no single peer can fill the
list or make one address outrank another.
"""

import asyncio

from ..utils.logging import get_logger
from ..version import __version__
from .connection import Connection
from .identity import PeerID
from .multiaddr import Multiaddr, MultiaddrError, parse_host_port
from .protocols import identify as core
from .protocols.errors import ProtocolError
from .protocols.multistream import MultistreamDialer
from .stream import Stream, StreamError, read_delimited, write_delimited

logger = get_logger(__name__)

AGENT_VERSION = f"plexus/{__version__}"
MAX_STREAMS_PER_PEER = 4
MAX_LISTEN_ADDRS = 64
MAX_OBSERVED_ADDRS = 16
MAX_OBSERVERS_PER_ADDR = 64


class IdentifyService:
    """Serves and runs identify and identify-push for one host (`host.identify_service`)."""

    def __init__(self, host):
        self.host = host
        self.identified: dict[PeerID, asyncio.Event] = {}
        self.observed_addrs: dict[Multiaddr, set[PeerID]] = {}  # our address -> the peers that saw us there
        host.set_stream_handler(core.IDENTIFY_PROTOCOL, self._serve, max_per_peer=MAX_STREAMS_PER_PEER)
        host.set_stream_handler(
            core.IDENTIFY_PUSH_PROTOCOL, self._serve_push, max_per_peer=MAX_STREAMS_PER_PEER
        )

    def message(self, connection: Connection) -> bytes:
        return core.encode_identify(
            {
                "public_key": self.host.private_key.public_key.to_protobuf(),
                "listen_addrs": [
                    addr.without_peer_id().to_bytes() for addr in self.host.get_visible_maddrs()
                ],
                "protocols": self.host.protocols,
                "observed_addr": connection.remote_addr.to_bytes() if connection.remote_addr else None,
                "protocol_version": core.PROTOCOL_VERSION,
                "agent_version": AGENT_VERSION,
            }
        )

    async def _serve(self, stream: Stream) -> None:
        await write_delimited(stream, self.message(stream.connection))
        await stream.close()

    async def push(self, timeout: float = 5.0) -> None:
        """Send our identify to every connected peer."""

        async def push(peer: PeerID) -> None:
            try:
                async with asyncio.timeout(timeout):
                    stream = await self.host.new_stream(peer, core.IDENTIFY_PUSH_PROTOCOL)
                    await write_delimited(stream, self.message(stream.connection))
                    await stream.close()
            except (TimeoutError, ProtocolError, StreamError, ConnectionError) as error:
                logger.debug(f"identify push to {peer} failed: {describe(error)}")

        await asyncio.gather(*(push(peer) for peer in self.host.connected_peers()))

    async def _serve_push(self, stream: Stream) -> None:
        try:
            async with asyncio.timeout(self.host.options.request_timeout):
                data = await read_delimited(stream, core.MAX_IDENTIFY_SIZE)
            if data is not None:
                self.apply(stream.remote_peer, core.decode_identify(data), stream.connection)
        except (TimeoutError, ProtocolError, StreamError) as error:
            self.host.refused(
                ("identify push", stream.remote_peer),
                f"bad identify push from {stream.remote_peer}: {describe(error)}",
            )
            stream.reset()

    async def run(self, connection: Connection) -> None:
        """Ask the peer of a new connection who it is (the host calls this once per connection)."""
        peer = connection.peer
        event = self.identified.setdefault(peer, asyncio.Event())
        stream = None
        try:
            stream = connection.open_stream()
            dialer = MultistreamDialer([core.IDENTIFY_PROTOCOL])
            await stream.write(dialer.data_to_send())
            stream._negotiation = dialer
            async with asyncio.timeout(self.host.options.negotiate_timeout):
                data = await read_delimited(stream, core.MAX_IDENTIFY_SIZE)
            await stream.close()
            if data is not None:
                self.apply(peer, core.decode_identify(data), connection)
        except (
            TimeoutError,
            ProtocolError,
            StreamError,
            ConnectionError,
            asyncio.IncompleteReadError,
        ) as error:
            logger.debug(f"identify with {peer} failed: {describe(error)}")
            if stream is not None:
                stream.reset()  # an unanswered stream of ours would keep the connection alive (keepalive)
        finally:
            event.set()

    def apply(self, peer: PeerID, fields: dict, connection: Connection) -> None:
        info = self.host.peer_store_entry(peer)
        addrs = []
        for raw in fields.get("listen_addrs", [])[:MAX_LISTEN_ADDRS]:
            try:
                addrs.append(Multiaddr.from_bytes(raw))
            except MultiaddrError:
                continue
        self.host.add_addrs(peer, [addr for addr in addrs if not is_unspecified(addr)])
        info.protocols = list(fields.get("protocols", []))
        info.agent_version = fields.get("agent_version")
        if observed := fields.get("observed_addr"):
            try:
                info.observed_addr = Multiaddr.from_bytes(observed)
            except MultiaddrError:
                return
            if not getattr(connection, "relayed", False):
                self._observed(info.observed_addr, peer)

    def _observed(self, addr: Multiaddr, observer: PeerID) -> None:
        observers = self.observed_addrs.get(addr)
        if observers is None:
            if len(self.observed_addrs) >= MAX_OBSERVED_ADDRS:  # forget the least observed one
                least = min(self.observed_addrs, key=lambda known: len(self.observed_addrs[known]))
                if len(self.observed_addrs[least]) > 1:
                    return  # every address we know was seen by several peers: keep them
                del self.observed_addrs[least]
            observers = self.observed_addrs[addr] = set()
        if len(observers) < MAX_OBSERVERS_PER_ADDR:
            observers.add(observer)

    def forget(self, peer: PeerID) -> None:
        self.identified.pop(peer, None)

    async def wait(self, peer: PeerID) -> None:
        await self.identified.setdefault(peer, asyncio.Event()).wait()


def describe(error: BaseException) -> str:
    if isinstance(error, TimeoutError):
        return "timed out"
    if isinstance(error, ConnectionRefusedError):
        return "connection refused"
    return str(error) or type(error).__name__


def is_unspecified(addr: Multiaddr) -> bool:
    try:
        return parse_host_port(addr)[0] in ("0.0.0.0", "::")
    except MultiaddrError:
        return False
