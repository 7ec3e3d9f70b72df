"""Hole punching (DCUtR) over a Host: turn a relayed connection into a direct TCP one when NATs allow.

The peer that received a relayed connection starts the exchange (`RelayClient(on_inbound_circuit=
puncher.on_inbound_circuit)` wires that up); the other serves `/libp2p/dcutr`. Each side offers the
addresses peers observed it at (identify's observed address, with our listening port: masquerading
NATs usually keep the source port), and both dial each other at the moment the core
(`protocols.dcutr.HolePunch`) says, from their listening port, so the two SYNs cross in flight: a
TCP simultaneous open through both NATs. The outgoing sockets share the listening port through
SO_REUSEPORT, which the host must set on its listeners (`HostOptions.reuse_port`; `plexus.DHT` does
when hole punching is on); without it punching dials come from other ports, which only
endpoint-independent NATs let through.

The exchange's initiator is the Noise initiator on the punched connection, the other side the
responder (both sides called connect(), so the roles must be agreed). A punched connection is added
to the host, which prefers it to the relayed one from then on. Outcomes are kept in `outcomes`
(peer -> text) for `plexus doctor` and tests.

Whatever addresses a peer names (in its CONNECT, or in identify for the unilateral dial), we dial
only those plexus/p2p/dial_rule.py allows: on an IP the relay saw the peer connect from, never ours
or another peer's. The exchange runs only over relayed connections, one stream per peer at a time,
each message within EXCHANGE_TIMEOUT, at most MAX_ATTEMPTS rounds.
"""

import asyncio
import socket
import time

from ..utils.logging import get_logger
from . import dial_rule
from .connection import Connection
from .host import Host, PeerInfo
from .identity import PeerID
from .multiaddr import Multiaddr, MultiaddrError, parse_host_port
from .protocols import dcutr as core
from .protocols.errors import ProtocolError, RemoteProtocolError
from .relay import read_message
from .stream import Stream, StreamError, write_delimited

logger = get_logger(__name__)

EXCHANGE_TIMEOUT = 10.0


class HolePuncher:
    """Runs DCUtR exchanges for a host and records how each ended."""

    def __init__(self, host: Host, *, dial_timeout: float = 5.0):
        self.host, self.dial_timeout = host, dial_timeout
        self.outcomes: dict[PeerID, str] = {}
        self._finished: dict[PeerID, asyncio.Event] = {}
        self._tasks: set[asyncio.Task] = set()

    def start(self) -> "HolePuncher":
        self.host.set_stream_handler(core.PROTOCOL, self._serve, max_per_peer=1)
        if not self.host.options.reuse_port and self.host.get_listen_maddrs():
            logger.debug(
                "the host's listeners do not share their ports (HostOptions.reuse_port): "
                "hole punching will dial from other ports"
            )
        return self

    async def stop(self) -> None:
        self.host.remove_stream_handler(core.PROTOCOL)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def on_inbound_circuit(self, connection: Connection) -> None:
        """A relayed connection arrived: try to upgrade it (we are the spec's inbound peer B)."""
        task = asyncio.get_running_loop().create_task(self.upgrade(connection.peer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait_outcome(self, peer: PeerID, timeout: float) -> str | None:
        """The outcome of an exchange with `peer`, whichever side started it (None if none ended in time)."""
        try:
            async with asyncio.timeout(timeout):
                await self._event(peer).wait()
        except TimeoutError:
            return None
        return self.outcomes.get(peer)

    def _event(self, peer: PeerID) -> asyncio.Event:
        return self._finished.setdefault(peer, asyncio.Event())

    def _record(self, peer: PeerID, outcome: str) -> str:
        self.outcomes[peer] = outcome
        self._event(peer).set()
        logger.info(f"hole punching with {peer}: {outcome}")
        return outcome

    def our_addrs(self) -> list[bytes]:
        """Where others may reach us: each observed IP with each listening port, and the listen addresses."""
        ports, addrs = [], []
        for addr in self.host.get_listen_maddrs():
            try:
                ip, port, family = parse_host_port(addr)
            except MultiaddrError:
                continue
            ports.append((family, port))
            if ip not in ("0.0.0.0", "::") and not ip.startswith("127."):
                addrs.append(Multiaddr(f"/{family}/{ip}/tcp/{port}"))
        for peer in self.host.connected_peers():
            info = self.host.peer_info(peer)
            observed = info.observed_addr if info else None
            if observed is None or observed.is_circuit:
                continue
            try:
                ip, _, family = parse_host_port(observed)
            except MultiaddrError:
                continue
            addrs.extend(Multiaddr(f"/{family}/{ip}/tcp/{port}") for f, port in ports if f == family)
        return [addr.to_bytes() for addr in dict.fromkeys(addrs)][: core.MAX_ADDRS]

    # --- the initiator ----------------------------------------------------------------------------

    async def upgrade(self, peer: PeerID) -> str:
        """Run the exchange as initiator over our relayed connection to `peer`; returns the outcome."""
        connection = self.host.get_connection(peer)
        if connection is not None and not getattr(connection, "relayed", False):
            return self._record(peer, "direct (already)")
        if connection is None:
            return self._record(peer, "failed: no relayed connection to upgrade")
        # The spec's unilateral upgrade first: if the peer listens somewhere we can reach, just dial it.
        info: PeerInfo | None
        try:  # its addresses arrive with identify, which runs on the new connection
            info = await self.host.identify(peer, timeout=EXCHANGE_TIMEOUT)
        except (TimeoutError, ConnectionError):
            info = self.host.peer_info(peer)
        direct = [addr.to_bytes() for addr in (info.addrs if info else []) if not addr.is_circuit]
        if direct and await self._dial(peer, direct, noise_initiator=True) is not None:
            return self._record(peer, "direct (dialed its public address)")
        punch = core.HolePunch(True, self.our_addrs())
        stream = None
        try:
            async with asyncio.timeout(EXCHANGE_TIMEOUT * core.MAX_ATTEMPTS):
                stream = await self.host.new_stream(peer, core.PROTOCOL)
                while True:
                    punch.start(time.monotonic())
                    await self._flush(stream, punch)
                    data = await read_message(stream, core.MAX_MESSAGE_SIZE)
                    if data is None:
                        return self._record(peer, "failed: the peer ended the exchange")
                    dial = punch.receive(data, time.monotonic())
                    if dial is None:  # never, as the initiator: an answer is a time to dial or an error
                        raise RemoteProtocolError("the DCUtR answer did not say when to dial")
                    await self._flush(stream, punch)
                    await asyncio.sleep(max(0.0, dial.when - time.monotonic()))  # the spec's half-RTT timer
                    punched = await self._dial(peer, dial.addrs, noise_initiator=True)
                    if punched is not None or self._has_direct(peer):  # or its SYN reached our listener
                        await stream.close()
                        return self._record(
                            peer,
                            f"direct after {punch.attempts} attempt(s), relay rtt {(punch.rtt or 0.0) * 1000:.1f} ms",
                        )
                    if not punch.retry():
                        await stream.close()
                        return self._record(
                            peer, f"failed after {punch.attempts} attempts; staying on the relay"
                        )
        except (
            TimeoutError,
            ProtocolError,
            StreamError,
            ConnectionError,
            asyncio.IncompleteReadError,
        ) as error:
            if stream is not None:
                stream.reset()
            return self._record(peer, f"failed: {error!r}; staying on the relay")

    def _has_direct(self, peer: PeerID) -> bool:
        connection = self.host.get_connection(peer)
        return connection is not None and not getattr(connection, "relayed", False)

    async def _flush(self, stream: Stream, punch: core.HolePunch) -> None:
        for message in punch.data_to_send():
            await write_delimited(stream, message)

    # --- the responder ----------------------------------------------------------------------------

    async def _serve(self, stream: Stream) -> None:
        peer = stream.remote_peer
        if not getattr(stream.connection, "relayed", False):
            self.host.refused(
                ("dcutr direct", peer), f"refused hole punching with {peer} over a direct connection"
            )
            stream.reset()
            return
        punch = core.HolePunch(False, self.our_addrs())
        try:
            while True:
                async with asyncio.timeout(EXCHANGE_TIMEOUT):
                    data = await read_message(stream, core.MAX_MESSAGE_SIZE)
                if data is None:
                    if peer not in self.outcomes or not self._event(peer).is_set():
                        self._record(peer, f"failed after {punch.attempts} attempt(s); staying on the relay")
                    return
                dial = punch.receive(data, time.monotonic())
                await self._flush(stream, punch)
                if dial is not None:
                    punched = await self._dial(peer, dial.addrs, noise_initiator=False)
                    if punched is not None or self._has_direct(peer):
                        self._record(peer, f"direct after {punch.attempts} attempt(s)")
        except (TimeoutError, ProtocolError, asyncio.IncompleteReadError) as error:
            logger.debug(f"DCUtR exchange with {peer} failed: {error!r}")
            self._record(peer, f"failed: {error!r}")
            stream.reset()

    # --- the simultaneous dial --------------------------------------------------------------------

    async def _dial(self, peer: PeerID, raw_addrs, *, noise_initiator: bool) -> Connection | None:
        allowed, refused = dial_rule.dialable(self.host, peer, raw_addrs)
        if refused:
            self.host.refused(
                ("dcutr addresses", peer), f"hole punching with {peer}: not dialing {'; '.join(refused)}"
            )
        targets = [parse_host_port(addr) for addr in allowed]
        if not targets:
            return None
        attempts = [
            asyncio.ensure_future(self._dial_one(peer, target, noise_initiator)) for target in targets
        ]
        try:
            for next_done in asyncio.as_completed(attempts):
                connection = await next_done
                if connection is not None:
                    return connection
            return None
        finally:
            for attempt in attempts:
                attempt.cancel()

    async def _dial_one(self, peer: PeerID, target, noise_initiator: bool) -> Connection | None:
        host, port, family = target
        if family not in ("ip4", "ip6"):
            return None
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET6 if family == "ip6" else socket.AF_INET, socket.SOCK_STREAM)
        connection = None
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if hasattr(socket, "SO_REUSEPORT"):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            local = self._local_endpoint(family)
            if local is not None:
                sock.bind(local)
            async with asyncio.timeout(self.dial_timeout):
                await loop.sock_connect(sock, (host, port))
                connection = self.host.make_connection(initiator=noise_initiator, expected_peer=peer)
                await loop.create_connection(lambda: self.host.protect(connection), sock=sock)
                await connection.upgrade()
        except (OSError, TimeoutError, ProtocolError, ConnectionError) as error:
            logger.debug(f"hole-punching dial to {host}:{port} failed: {error!r}")
            if connection is not None:
                connection.abort(f"punched upgrade failed: {error!r}")
            else:
                sock.close()
            return None
        except BaseException:
            if connection is not None:
                connection.abort("hole punching cancelled")
            else:
                sock.close()
            raise
        self.host.add_connection(connection)
        return connection

    def _local_endpoint(self, family: str):
        if not self.host.options.reuse_port:
            return None  # binding a listening port would fail: let the OS pick one
        for addr in self.host.get_listen_maddrs():
            try:
                ip, port, addr_family = parse_host_port(addr)
            except MultiaddrError:
                continue
            if addr_family == family:
                return (ip, port)
        return None


async def try_direct_upgrade(puncher: HolePuncher | None, peer: PeerID, timeout: float = 30.0) -> str:
    """The outcome of hole punching with `peer`: waits for an exchange the peer started, or starts one."""
    if puncher is None:
        return "not enabled"
    outcome = await puncher.wait_outcome(peer, timeout / 2)
    if outcome is None:
        outcome = await puncher.upgrade(peer)
    return outcome
