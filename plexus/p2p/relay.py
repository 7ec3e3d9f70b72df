"""Circuit relay v2 over a Host: the relay service (hop) and the client side (reserve, dial, stop).

`RelayService` runs on a public peer. It answers RESERVE (bounded by `RelayLimits`, bookkept by
`protocols.relay.RelayResources`) and CONNECT: it opens a stop stream to the target, then pipes
bytes between the two streams until either side ends, the circuit's data or time limit runs out, or
the service shuts down. It never reads or alters the relayed bytes.

`RelayClient` runs on every peer. It dials `/…/p2p/<relay>/p2p-circuit/p2p/<peer>` addresses for
the host (`host.circuit_dialer`), keeps reservations on the relays it is given, renews them before
they expire or when the connection to the relay drops, advertises `/…/p2p/<relay>/p2p-circuit`
addresses through `host.address_sources`, and serves stop streams: each accepted circuit becomes a
`Connection` driven through `StreamTransport`, upgraded with Noise *inside* the circuit, so the
peer at the other end is authenticated by its own key, whatever the relay claims.

Relayed connections are marked `connection.relayed = True` (the host prefers direct ones), carry
the relay's `Limit` as `connection.relay_limit`, and the addresses the relay saw the other peer
connect from as `connection.relay_observed_addrs` (empty when the relay did not say).
"""

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ..errors import PeerError
from ..utils.logging import get_logger
from .connection import Connection
from .host import DialError, Host
from .identity import PeerID
from .multiaddr import Multiaddr, MultiaddrError, parse_host_port
from .protocols import relay as core
from .protocols.errors import ProtocolError, RemoteProtocolError
from .protocols.relay import HopMessage, HopType, Limit, RelayLimits, Status, StopMessage, StopType
from .protocols.varint import MAX_VARINT_BYTES
from .stream import Stream, StreamError, write_delimited
from .stream_transport import StreamTransport

logger = get_logger(__name__)

PIPE_CHUNK = 64 << 10
MESSAGE_TIMEOUT = 10.0
MAX_ADVERTISED_PER_RELAY = 4


class RelayError(PeerError, ConnectionError):
    """A relay refused or failed a reservation or a circuit; `status` is the relay's code."""

    def __init__(self, message: str, status: Status | None = None):
        super().__init__(message)
        self.status = status


async def read_message(stream: Stream, max_size: int = core.MAX_MESSAGE_SIZE) -> bytes | None:
    """One varint-prefixed message; None at EOF. Oversized: RemoteProtocolError (stream left open
    so the caller can answer MALFORMED_MESSAGE before resetting it)."""
    length = shift = 0
    for index in range(MAX_VARINT_BYTES):
        byte = await stream.read(1)
        if not byte:
            if index == 0:
                return None
            raise RemoteProtocolError("stream ended inside a length prefix")
        length |= (byte[0] & 0x7F) << shift
        shift += 7
        if byte[0] < 0x80:
            break
    else:
        raise RemoteProtocolError("length prefix is longer than a varint may be")
    if length > max_size:
        raise RemoteProtocolError(f"{length}-byte message exceeds the {max_size}-byte limit")
    return await stream.readexactly(length) if length else b""


def _observed(connection: Connection) -> tuple[bytes, ...]:
    """Where a direct connection comes from, as the relay tells the other end of a circuit."""
    return (connection.remote_addr.to_bytes(),) if connection.remote_addr is not None else ()


def _ip_of(connection: Connection) -> str | None:
    try:
        return parse_host_port(connection.remote_addr)[0] if connection.remote_addr else None
    except MultiaddrError:
        return None


def split_circuit(addr: Multiaddr) -> tuple[Multiaddr, PeerID]:
    """`/…/p2p/<relay>/p2p-circuit[/p2p/<peer>]` -> (address of the relay ending in /p2p/<relay>, relay id)."""
    components = addr.components()
    names = [name for name, _ in components]
    if names.count("p2p-circuit") != 1:
        raise DialError(f"{addr}: expected exactly one /p2p-circuit (nested circuits are not supported)")
    index = names.index("p2p-circuit")
    relay_part = "".join(
        f"/{name}" + (f"/{value}" if value is not None else "") for name, value in components[:index]
    )
    relay_addr = Multiaddr(relay_part) if relay_part else None
    if relay_addr is None or relay_addr.peer_id is None:
        raise DialError(f"{addr}: the part before /p2p-circuit must end in /p2p/<relay id>")
    return relay_addr, relay_addr.peer_id


# --- the service -----------------------------------------------------------------------------------


class RelayService:
    """Serve `/libp2p/circuit/relay/0.2.0/hop` on a (public) host, within `limits`."""

    def __init__(
        self, host: Host, limits: RelayLimits | None = None, *, clock: Callable[[], float] = time.time
    ):
        self.host, self.limits, self._clock = host, limits or RelayLimits(), clock
        self.resources = core.RelayResources(self.limits)
        self.bytes_relayed = 0
        self.circuits_served = 0
        self._pipes: set[asyncio.Task] = set()

    def start(self) -> "RelayService":
        # a peer's hop streams: one per circuit it has open (the circuit runs on it), a reservation, a spare
        self.host.set_stream_handler(
            core.HOP_PROTOCOL, self._serve_hop, max_per_peer=self.limits.max_circuits_per_peer + 2
        )
        return self

    async def stop(self) -> None:
        self.host.remove_stream_handler(core.HOP_PROTOCOL)
        for task in list(self._pipes):
            task.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    async def _answer(self, stream: Stream, status: Status, **fields) -> None:
        await write_delimited(stream, core.encode_hop(HopMessage(HopType.STATUS, status=status, **fields)))

    async def _serve_hop(self, stream: Stream) -> None:
        try:
            async with asyncio.timeout(MESSAGE_TIMEOUT):
                data = await read_message(stream)
            if data is None:
                return
            message = core.decode_hop(data)
        except RemoteProtocolError as error:
            logger.debug(f"relay: malformed hop message from {stream.remote_peer}: {error}")
            await self._refuse(stream, Status.MALFORMED_MESSAGE)
            return
        except (TimeoutError, asyncio.IncompleteReadError):
            stream.reset()
            return
        if message.type is HopType.RESERVE:
            await self._reserve(stream)
        elif message.type is HopType.CONNECT and message.peer is not None:  # (decode_hop checks it has one)
            await self._connect(stream, message.peer)
        else:
            await self._refuse(stream, Status.UNEXPECTED_MESSAGE)

    async def _refuse(self, stream: Stream, status: Status) -> None:
        try:
            async with asyncio.timeout(MESSAGE_TIMEOUT):
                await self._answer(stream, status)
                await stream.close()
        except (TimeoutError, StreamError, ConnectionError):
            stream.reset()

    async def _reserve(self, stream: Stream) -> None:
        peer, connection = stream.remote_peer, stream.connection
        if getattr(connection, "relayed", False):
            return await self._refuse(stream, Status.PERMISSION_DENIED)  # a reservation needs a direct link
        for reserved in list(self.resources.reservations):  # a reservation ends with its connection
            if self.host.get_connection(reserved) is None:
                self.resources.drop_reservation(reserved)
        status, expire = self.resources.reserve(peer, _ip_of(connection), self._clock())
        if status is not Status.OK:
            logger.debug(f"relay: refused a reservation to {peer}: {status.name}")
            return await self._refuse(stream, status)
        addrs = tuple(addr.to_bytes() for addr in self.host.get_visible_maddrs() if not addr.is_circuit)
        voucher = core.make_voucher(self.host.private_key, peer, int(expire))
        reservation = core.Reservation(int(expire), addrs[: core.MAX_ADDRS], voucher)
        async with asyncio.timeout(MESSAGE_TIMEOUT):
            await self._answer(stream, Status.OK, reservation=reservation, limit=self.limits.limit)
            await stream.close()
        logger.debug(f"relay: {peer} reserved a slot until {expire:.0f}")

    async def _connect(self, hop: Stream, target: PeerID) -> None:
        source, now = hop.remote_peer, self._clock()
        if getattr(hop.connection, "relayed", False):
            return await self._refuse(hop, Status.PERMISSION_DENIED)  # no circuits over circuits
        target_connection = self.host.get_connection(target)
        if target_connection is None or getattr(target_connection, "relayed", False):
            self.resources.drop_reservation(target)
            return await self._refuse(hop, Status.NO_RESERVATION)
        status = self.resources.open_circuit(source, target, now)
        if status is not Status.OK:
            logger.debug(f"relay: refused a circuit {source} -> {target}: {status.name}")
            return await self._refuse(hop, status)
        try:
            stop = await self._open_stop(source, target, _observed(hop.connection))
            if stop is None:
                return await self._refuse(hop, Status.CONNECTION_FAILED)
            try:
                async with asyncio.timeout(MESSAGE_TIMEOUT):
                    await self._answer(
                        hop,
                        Status.OK,
                        limit=self.limits.limit,
                        peer=target,
                        peer_addrs=_observed(target_connection),
                    )
            except BaseException:
                stop.reset()
                raise
            self.circuits_served += 1
            task = asyncio.current_task()
            assert task is not None  # a coroutine run by the host
            self._pipes.add(task)
            try:
                await self._bridge(hop, stop)
            finally:
                self._pipes.discard(task)
        finally:
            self.resources.close_circuit(source, target)

    async def _open_stop(
        self, source: PeerID, target: PeerID, source_addrs: tuple[bytes, ...]
    ) -> Stream | None:
        stream = None
        try:
            async with asyncio.timeout(MESSAGE_TIMEOUT):
                stream = await self.host.new_stream(target, core.STOP_PROTOCOL)
                await write_delimited(
                    stream,
                    core.encode_stop(
                        StopMessage(
                            StopType.CONNECT, peer=source, limit=self.limits.limit, peer_addrs=source_addrs
                        )
                    ),
                )
                data = await read_message(stream)
                answer = core.decode_stop(data) if data is not None else None
        except (TimeoutError, ProtocolError, StreamError, ConnectionError) as error:
            logger.debug(f"relay: stop stream to {target} failed: {error!r}")
            if stream is not None:
                stream.reset()
            return None
        if answer is None or answer.type is not StopType.STATUS or answer.status is not Status.OK:
            logger.debug(f"relay: {target} declined a circuit from {source}: {answer}")
            stream.reset()
            return None
        return stream

    async def _bridge(self, a: Stream, b: Stream) -> None:
        """Pipe bytes both ways until both directions end; cut at the data or time limit."""
        limit = self.limits

        async def pipe(source: Stream, sink: Stream) -> None:
            sent = 0
            while data := await source.read(PIPE_CHUNK):
                sent += len(data)
                if limit.circuit_data and sent > limit.circuit_data:
                    raise RelayError(f"circuit passed its {limit.circuit_data}-byte data limit")
                await sink.write(data)
                self.bytes_relayed += len(data)
            await sink.close()

        try:
            async with asyncio.timeout(limit.circuit_duration or None):
                await asyncio.gather(pipe(a, b), pipe(b, a))
        except (TimeoutError, RelayError, StreamError, ConnectionError) as error:
            logger.debug(f"relay: circuit {a.remote_peer} -> {b.remote_peer} cut: {error!r}")
            a.reset()
            b.reset()
        except BaseException:
            a.reset()
            b.reset()
            raise


# --- the client ------------------------------------------------------------------------------------


@dataclass
class ActiveReservation:
    relay: PeerID
    relay_addr: Multiaddr  # how we reached it, ending in /p2p/<relay>
    expire: int
    addrs: list[Multiaddr]  # the relay's own addresses, each ending in /p2p/<relay>
    limit: Limit | None
    voucher: bytes | None


class RelayClient:
    """Dial through relays, reserve slots on relays, accept circuits from them."""

    def __init__(
        self,
        host: Host,
        *,
        accept_any_relay: bool = False,
        renew_period: float = 30.0,
        dial_timeout: float | None = None,
        on_inbound_circuit: Callable[[Connection], None] | None = None,
    ):
        """
        Args:
            accept_any_relay: serve stop streams from relays we hold no reservation on.
            renew_period: seconds between renewals (also the keep-alive of the relay connection);
                shortened to half the reservation's remaining time when that is less.
            on_inbound_circuit: called with each accepted relayed Connection (hole punching hooks here).
        """
        self.host = host
        self.accept_any_relay, self.renew_period = accept_any_relay, renew_period
        self.dial_timeout = dial_timeout or host.options.dial_timeout
        self.on_inbound_circuit = on_inbound_circuit
        self.reservations: dict[PeerID, ActiveReservation] = {}
        self._keepers: dict[PeerID, asyncio.Task] = {}
        self._upgrades: set[asyncio.Task] = set()

    def start(self) -> "RelayClient":
        self.host.set_stream_handler(core.STOP_PROTOCOL, self._serve_stop)
        self.host.circuit_dialer = self.dial
        self.host.address_sources.append(self.relay_addrs)
        return self

    async def stop(self) -> None:
        self.host.remove_stream_handler(core.STOP_PROTOCOL)
        if self.host.circuit_dialer == self.dial:
            self.host.circuit_dialer = None
        if self.relay_addrs in self.host.address_sources:
            self.host.address_sources.remove(self.relay_addrs)
        tasks = list(self._keepers.values()) + list(self._upgrades)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._keepers.clear()
        self.reservations.clear()

    # --- reservations ---------------------------------------------------------------------------

    def relay_addrs(self) -> list[Multiaddr]:
        """Our circuit addresses (without our /p2p part): the dialed relay address first."""
        addrs = []
        for reservation in self.reservations.values():
            candidates = [reservation.relay_addr] + [
                addr
                for addr in reservation.addrs
                if not _is_loopback(addr) and addr.peer_id == reservation.relay
            ]
            for addr in list(dict.fromkeys(candidates))[:MAX_ADVERTISED_PER_RELAY]:
                addrs.append(addr.encapsulate("/p2p-circuit"))
        return addrs

    async def reserve(self, relay_addr: Multiaddr | str, *, keep: bool = True) -> ActiveReservation:
        """Reserve a slot on the relay at `relay_addr` (…/p2p/<relay>); with `keep`, renew it forever.

        Raises RelayError when the relay refuses, DialError when it cannot be reached.
        """
        relay_addr = Multiaddr(relay_addr)
        if relay_addr.peer_id is None or relay_addr.is_circuit:
            raise ValueError(f"{relay_addr}: a relay address must be direct and end in /p2p/<relay id>")
        reservation = await self._reserve_once(relay_addr)
        if keep and reservation.relay not in self._keepers:
            task = asyncio.get_running_loop().create_task(self._keep(relay_addr, reservation.relay))
            self._keepers[reservation.relay] = task
        return reservation

    async def _reserve_once(self, relay_addr: Multiaddr) -> ActiveReservation:
        relay = relay_addr.peer_id
        if relay is None:
            raise ValueError(f"{relay_addr}: a relay address must end in /p2p/<relay id>")
        async with asyncio.timeout(self.dial_timeout):
            stream = await self.host.new_stream(relay_addr, core.HOP_PROTOCOL)
            try:
                await write_delimited(stream, core.encode_hop(HopMessage(HopType.RESERVE)))
                data = await read_message(stream)
            finally:
                await stream.close()
        if data is None:
            raise RelayError(f"relay {relay} closed the stream without answering our reservation")
        answer = core.decode_hop(data)
        if answer.type is not HopType.STATUS or answer.status is not Status.OK:
            raise RelayError(
                f"relay {relay} refused a reservation: {answer.status.name if answer.status else answer}",
                answer.status,
            )
        if answer.reservation is None:
            raise RelayError(f"relay {relay} accepted a reservation but sent no reservation details")
        addrs = []
        for raw in answer.reservation.addrs:
            try:
                addr = Multiaddr.from_bytes(raw)
            except MultiaddrError:
                continue
            if addr.peer_id is None:
                addr = addr.with_peer_id(relay)
            if addr.peer_id == relay and not addr.is_circuit:
                addrs.append(addr)
        reservation = ActiveReservation(
            relay, relay_addr, answer.reservation.expire, addrs, answer.limit, answer.reservation.voucher
        )
        is_new = relay not in self.reservations
        self.reservations[relay] = reservation
        logger.debug(f"reserved a slot on relay {relay} until {reservation.expire}")
        if is_new:  # our addresses changed: tell the peers we are connected to (the relay among them)
            await self.host.push_identify()
        return reservation

    async def _keep(self, relay_addr: Multiaddr, relay: PeerID) -> None:
        """Renew the reservation before it expires, and again at once if the relay connection drops."""
        failures = 0
        while True:
            reservation = self.reservations.get(relay)
            wait = self.renew_period if failures == 0 else min(self.renew_period, 0.5 * 2**failures)
            if reservation is not None and failures == 0:
                wait = min(wait, max(0.1, (reservation.expire - time.time()) / 2))
            connection = self.host.get_connection(relay)
            if connection is not None and reservation is not None:
                try:  # wake early when the connection to the relay closes
                    await asyncio.wait_for(connection.closed.wait(), wait)
                    self.reservations.pop(relay, None)
                except TimeoutError:
                    pass
            else:
                await asyncio.sleep(wait)  # backoff before retrying an unreachable relay
            try:
                await self._reserve_once(relay_addr)
                failures = 0
            except (
                RelayError,
                ProtocolError,
                DialError,
                StreamError,
                ConnectionError,
                TimeoutError,
            ) as error:
                failures += 1
                self.reservations.pop(relay, None)
                logger.warning(f"could not renew our reservation on relay {relay}: {error}; retrying")

    # --- dialing through a relay -------------------------------------------------------------------

    async def dial(self, peer_id: PeerID, addr: Multiaddr) -> Connection:
        """Open a relayed connection to `peer_id` through the relay named in `addr` (host.circuit_dialer)."""
        relay_addr, relay = split_circuit(addr)
        if relay == peer_id:
            raise DialError(f"{addr}: a peer cannot be its own relay")
        target = addr.peer_id
        if target is not None and target != peer_id:
            raise DialError(f"{addr} leads to {target}, not to {peer_id}")
        async with asyncio.timeout(self.dial_timeout):
            hop = await self.host.new_stream(relay_addr, core.HOP_PROTOCOL)
            try:
                await write_delimited(hop, core.encode_hop(HopMessage(HopType.CONNECT, peer=peer_id)))
                data = await read_message(hop)
                if data is None:
                    raise RelayError(f"relay {relay} closed the stream without answering our CONNECT")
                answer = core.decode_hop(data)
                if answer.type is not HopType.STATUS or answer.status is not Status.OK:
                    status = answer.status.name if answer.status else answer.type.name
                    raise RelayError(
                        f"relay {relay} could not connect us to {peer_id}: {status}", answer.status
                    )
            except BaseException:
                hop.reset()
                raise
            connection = self._start_connection(
                hop,
                initiator=True,
                peer=peer_id,
                relay_addr=relay_addr,
                limit=answer.limit,
                observed=answer.peer_addrs if answer.peer == peer_id else (),
            )
            try:
                await connection.upgrade()
            except BaseException as error:
                connection.abort(f"relayed upgrade failed: {error!r}")
                raise
        self.host.add_connection(connection)
        logger.debug(f"connected to {peer_id} through relay {relay}")
        return connection

    def _start_connection(
        self,
        stream: Stream,
        *,
        initiator: bool,
        peer: PeerID,
        relay_addr: Multiaddr,
        limit: Limit | None,
        observed: tuple[bytes, ...],
    ) -> Connection:
        connection = self.host.make_connection(initiator=initiator, expected_peer=peer)
        connection.relayed, connection.relay_limit = True, limit
        connection.relay_observed_addrs = _parse_addrs(observed)  # where the relay saw the peer
        StreamTransport(stream, self.host.protect(connection))
        connection.remote_addr = relay_addr.encapsulate("/p2p-circuit")
        return connection

    # --- accepting circuits ----------------------------------------------------------------------------

    async def _serve_stop(self, stream: Stream) -> None:
        relay = stream.remote_peer
        try:
            async with asyncio.timeout(MESSAGE_TIMEOUT):
                data = await read_message(stream)
                if data is None:
                    return
                try:
                    message = core.decode_stop(data)
                except RemoteProtocolError as error:
                    logger.debug(f"malformed stop message from relay {relay}: {error}")
                    return await self._answer_stop(stream, Status.MALFORMED_MESSAGE)
                if message.type is not StopType.CONNECT or message.peer is None:  # (decode_stop checks it)
                    return await self._answer_stop(stream, Status.UNEXPECTED_MESSAGE)
                if relay not in self.reservations and not self.accept_any_relay:
                    return await self._answer_stop(stream, Status.PERMISSION_DENIED)
                if message.peer in (self.host.peer_id, relay):
                    return await self._answer_stop(stream, Status.PERMISSION_DENIED)
                await write_delimited(
                    stream, core.encode_stop(StopMessage(StopType.STATUS, status=Status.OK))
                )
        except RemoteProtocolError as error:
            logger.debug(f"bad stop stream from {relay}: {error}")
            return await self._answer_stop(stream, Status.MALFORMED_MESSAGE)
        except (TimeoutError, asyncio.IncompleteReadError):
            stream.reset()
            return
        relay_addr = stream.connection.remote_addr
        relay_addr = relay_addr.with_peer_id(relay) if relay_addr is not None else Multiaddr(f"/p2p/{relay}")
        # The relay says who is calling; Noise inside the circuit checks it (expected_peer).
        connection = self._start_connection(
            stream,
            initiator=False,
            peer=message.peer,
            relay_addr=relay_addr,
            limit=message.limit,
            observed=message.peer_addrs,
        )
        task = asyncio.get_running_loop().create_task(self._finish_inbound(connection, relay))
        self._upgrades.add(task)
        task.add_done_callback(self._upgrades.discard)

    async def _answer_stop(self, stream: Stream, status: Status) -> None:
        try:
            async with asyncio.timeout(MESSAGE_TIMEOUT):
                await write_delimited(stream, core.encode_stop(StopMessage(StopType.STATUS, status=status)))
                await stream.close()
        except (TimeoutError, StreamError, ConnectionError):
            stream.reset()

    async def _finish_inbound(self, connection: Connection, relay: PeerID) -> None:
        try:
            async with asyncio.timeout(self.dial_timeout):
                await connection.upgrade()
        except (TimeoutError, ProtocolError, OSError) as error:
            logger.warning(f"relayed connection through {relay} failed its handshake: {error!r}")
            connection.abort(f"upgrade failed: {error!r}")
            return
        self.host.add_connection(connection)
        logger.debug(f"accepted a relayed connection from {connection.remote_peer} through {relay}")
        if self.on_inbound_circuit is not None:
            self.on_inbound_circuit(connection)


def _parse_addrs(raw_addrs: Iterable[bytes]) -> list[Multiaddr]:
    addrs = []
    for raw in raw_addrs:
        try:
            addrs.append(Multiaddr.from_bytes(raw))
        except MultiaddrError:
            continue
    return addrs


def _is_loopback(addr: Multiaddr) -> bool:
    value = addr.value_for_protocol("ip4") or addr.value_for_protocol("ip6") or ""
    return value.startswith("127.") or value == "::1"


def relay_addrs_from(values: Iterable[str] | None) -> Sequence[Multiaddr]:
    """Parse `--relays` command-line values."""
    return [Multiaddr(value) for value in values or ()]
