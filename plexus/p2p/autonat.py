"""AutoNAT over a Host: serve dial-back requests, and ask others whether we are reachable.

`AutoNATService` answers `/libp2p/autonat/1.0.0` requests. It refuses relayed requests, dials only
addresses that plexus/p2p/dial_rule.py allows (on the requester's observed IP, never ours or another
peer's), runs at most `max_concurrent` dial-backs at once, one per peer per `peer_interval`
seconds and one request stream per peer at a time, and dials from a throwaway host (a fresh key, no
listener), so an existing connection can never make a dial-back look successful.

`AutoNAT.probe()` asks connected peers (never over relays) to dial our candidate addresses and feeds
their answers to a `ReachabilityTracker`; `mode` turns the verdict into "direct", "relay" or
"client" (see `protocols.autonat.choose_mode`).
"""

import asyncio
import time

from ..utils.logging import get_logger
from . import dial_rule
from .host import Host
from .identity import PeerID, PrivateKey
from .multiaddr import Multiaddr
from .protocols import autonat as core
from .protocols.autonat import DialResponse, Reachability, ReachabilityTracker, ResponseStatus
from .protocols.errors import ProtocolError, RemoteProtocolError
from .relay import read_message
from .stream import Stream, StreamError, write_delimited

logger = get_logger(__name__)

REQUEST_TIMEOUT = 15.0


class AutoNATService:
    def __init__(
        self, host: Host, *, dial_timeout: float = 5.0, max_concurrent: int = 4, peer_interval: float = 10.0
    ):
        self.host, self.dial_timeout = host, dial_timeout
        self.max_concurrent, self.peer_interval = max_concurrent, peer_interval
        self._busy = 0
        self._last_request: dict[PeerID, float] = {}

    def start(self) -> "AutoNATService":
        self.host.set_stream_handler(core.PROTOCOL, self._serve, max_per_peer=1)
        return self

    async def stop(self) -> None:
        self.host.remove_stream_handler(core.PROTOCOL)

    async def _serve(self, stream: Stream) -> None:
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT):
                data = await read_message(stream, core.MAX_MESSAGE_SIZE)
                if data is None:
                    return
                response = await self._answer(stream, data)
                await write_delimited(stream, core.encode_response(response))
                await stream.close()
        except (TimeoutError, RemoteProtocolError, asyncio.IncompleteReadError) as error:
            logger.debug(f"AutoNAT request from {stream.remote_peer} failed: {error!r}")
            stream.reset()

    async def _answer(self, stream: Stream, data: bytes) -> DialResponse:
        try:
            request = core.decode_request(data)
        except RemoteProtocolError as error:
            return DialResponse(ResponseStatus.E_BAD_REQUEST, str(error))
        peer, connection = stream.remote_peer, stream.connection
        if request.peer != peer:
            return DialResponse(
                ResponseStatus.E_BAD_REQUEST, "the request names another peer than the sender"
            )
        if getattr(connection, "relayed", False):
            return DialResponse(
                ResponseStatus.E_DIAL_REFUSED, "requests over relayed connections are refused"
            )
        addrs, refused = dial_rule.dialable(self.host, peer, request.addrs)
        if not addrs:
            self.host.refused(
                ("autonat addresses", peer),
                f"AutoNAT: not dialing {peer} back: {'; '.join(refused) or 'it named no address'}",
            )
            text = "no address we may dial you at (we dial only your observed IP): " + "; ".join(refused)
            return DialResponse(ResponseStatus.E_DIAL_REFUSED, text[:500])
        now = time.monotonic()
        if self._busy >= self.max_concurrent or now - self._last_request.get(peer, -1e9) < self.peer_interval:
            self.host.refused(
                ("autonat rate", peer),
                f"AutoNAT: refused a dial-back to {peer}: it asked "
                f"again within {self.peer_interval} s, or {self._busy} "
                f"are under way",
            )
            return DialResponse(ResponseStatus.E_DIAL_REFUSED, "too many requests; try again later")
        self._last_request[peer] = now
        if len(self._last_request) > 1024:
            self._last_request = {p: t for p, t in self._last_request.items() if now - t < self.peer_interval}
        self._busy += 1
        try:
            return await self._dial_back(peer, addrs)
        finally:
            self._busy -= 1

    async def _dial_back(self, peer: PeerID, addrs: list[Multiaddr]) -> DialResponse:
        prober = await Host(
            PrivateKey.generate(),
            host_maddrs=(),
            dial_timeout=self.dial_timeout,
            swarm_key=self.host.options.swarm_key,
        ).start()
        try:
            for addr in addrs:
                try:
                    await prober.connect(addr.with_peer_id(peer), timeout=self.dial_timeout)
                    return DialResponse(ResponseStatus.OK, addr=addr.to_bytes())
                except (OSError, TimeoutError, ProtocolError, ConnectionError) as error:
                    logger.debug(f"AutoNAT dial-back to {addr} failed: {error!r}")
            return DialResponse(
                ResponseStatus.E_DIAL_ERROR, f"could not reach any of {len(addrs)} address(es)"
            )
        finally:
            await prober.shutdown()


class AutoNAT:
    """Our own reachability, from what other peers manage to dial."""

    def __init__(self, host: Host, *, confidence: int = 3, request_timeout: float = REQUEST_TIMEOUT):
        self.host, self.request_timeout = host, request_timeout
        self.tracker = ReachabilityTracker(confidence)
        self.answers: dict[PeerID, DialResponse] = {}

    @property
    def reachability(self) -> Reachability:
        return self.tracker.status

    def mode(self, relays_available: bool) -> str:
        return core.choose_mode(self.reachability, relays_available)

    def candidate_addrs(self) -> list[bytes]:
        addrs = [addr.without_peer_id() for addr in self.host.get_visible_maddrs(include_observed=True)]
        return [addr.to_bytes() for addr in addrs if not addr.is_circuit][: core.MAX_ADDRS]

    async def ask(self, server: PeerID) -> DialResponse:
        """One dial-back request to `server` (recorded in the tracker unless the server refused)."""
        async with asyncio.timeout(self.request_timeout):
            stream = await self.host.new_stream(server, core.PROTOCOL)
            try:
                await write_delimited(stream, core.encode_request(self.host.peer_id, self.candidate_addrs()))
                data = await read_message(stream, core.MAX_MESSAGE_SIZE)
            finally:
                await stream.close()
        if data is None:
            raise StreamError(f"{server} closed the AutoNAT stream without answering")
        response = core.decode_response(data)
        self.answers[server] = response
        if response.status is ResponseStatus.OK:
            self.tracker.record(True)
        elif response.status is ResponseStatus.E_DIAL_ERROR:
            self.tracker.record(False)
        return response

    async def probe(self, servers: list[PeerID] | None = None, max_servers: int = 5) -> Reachability:
        """Ask up to `max_servers` directly connected peers at once; returns the verdict."""
        if servers is None:
            servers = [
                peer
                for peer in self.host.connected_peers()
                if not getattr(self.host.get_connection(peer), "relayed", False)
            ]
        results = await asyncio.gather(
            *(self.ask(peer) for peer in servers[:max_servers]), return_exceptions=True
        )
        for peer, result in zip(servers, results):
            if isinstance(result, BaseException):
                logger.debug(f"AutoNAT request to {peer} failed: {result!r}")
        return self.reachability
