"""Circuit relay v2 between in-process hosts on 127.0.0.1: reserve, dial through the relay, limits,
malformed messages and impersonation attempts. Private peers here simply do not listen at all, so
the relay is their only way in."""

import asyncio
import os
import time

import pytest

from plexus.p2p.host import DialError, Host
from plexus.p2p.identity import PrivateKey
from plexus.p2p.multiaddr import Multiaddr
from plexus.p2p.protocols import relay as core
from plexus.p2p.protocols.errors import ProtocolError
from plexus.p2p.protocols.relay import HopMessage, HopType, RelayLimits, Status, StopMessage, StopType
from plexus.p2p.relay import RelayClient, RelayError, RelayService, read_message
from plexus.p2p.stream import write_delimited
from plexus.p2p.stream_transport import StreamTransport

ECHO = "/plexus-test/echo/1.0.0"
TIMEOUT = 10


async def echo(stream):
    while data := await stream.read(1 << 16):
        await stream.write(data)
    await stream.close()


async def echo_roundtrip(stream, payload: bytes) -> bytes:
    async def send():
        for offset in range(0, len(payload), 1 << 16):
            await stream.write(payload[offset : offset + (1 << 16)])
        await stream.close()

    sender = asyncio.ensure_future(send())
    received = bytearray()
    while data := await stream.read():
        received += data
    await sender
    return bytes(received)


class Swarm:
    """A relay R and private peers that do not listen; each private peer can reserve on R."""

    def __init__(self, limits: RelayLimits | None = None):
        self.limits = limits
        self.hosts: list[Host] = []
        self.clients: list[RelayClient] = []

    async def __aenter__(self):
        self.relay = await self.host(("/ip4/127.0.0.1/tcp/0",))
        self.service = RelayService(self.relay, self.limits).start()
        self.relay_addr = self.relay.get_visible_maddrs()[0]
        return self

    async def host(self, maddrs=(), key=None) -> Host:
        host = await Host(key, host_maddrs=maddrs, dial_timeout=5).start()
        host.set_stream_handler(ECHO, echo)
        self.hosts.append(host)
        return host

    async def private(self, reserve: bool = True, **options) -> tuple[Host, RelayClient]:
        host = await self.host()
        client = RelayClient(host, **options).start()
        self.clients.append(client)
        if reserve:
            await client.reserve(self.relay_addr)
        return host, client

    def circuit(self, target: Host) -> Multiaddr:
        return self.relay_addr.encapsulate(f"/p2p-circuit/p2p/{target.peer_id}")

    async def __aexit__(self, *exc):
        for client in self.clients:
            await client.stop()
        await self.service.stop()
        for host in self.hosts:
            await host.shutdown()


async def wait_until(predicate, what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        await asyncio.sleep(0.01)  # poll with a deadline


def run(coroutine):
    asyncio.run(asyncio.wait_for(coroutine, 30))


@pytest.mark.timeout(30)
def test_private_peers_reach_each_other_through_the_relay():
    async def main():
        async with Swarm() as swarm:
            a, _client_a = await swarm.private()
            b, _ = await swarm.private(reserve=False)
            # A advertises a circuit address through R, and identify carries it.
            assert a.get_visible_maddrs() == [swarm.circuit(a)]
            # The reservation is pushed to connected peers (identify push), so the relay's peer store,
            # and through it the DHT, learns A's circuit address.
            await wait_until(
                lambda: swarm.circuit(a).without_peer_id() in swarm.relay.peer_info(a.peer_id).addrs,
                "the relay to learn A's circuit address",
            )
            stream = await b.new_stream(swarm.circuit(a), ECHO, timeout=TIMEOUT)
            payload = os.urandom(600_000)
            assert await echo_roundtrip(stream, payload) == payload
            connection = b.get_connection(a.peer_id)
            assert connection.relayed and connection.remote_peer == a.peer_id
            assert connection.relay_limit == RelayLimits().limit
            assert swarm.service.circuits_served == 1 and swarm.service.bytes_relayed >= 2 * len(payload)
            # ...and A can open streams back to B over the same relayed connection.
            back = await a.new_stream(b.peer_id, ECHO, timeout=TIMEOUT)
            assert await echo_roundtrip(back, b"pong") == b"pong"
            info = await b.identify(a.peer_id, timeout=TIMEOUT)
            assert swarm.circuit(a).without_peer_id() in info.addrs

    run(main())


@pytest.mark.timeout(30)
def test_voucher_is_signed_by_the_relay_for_the_reserving_peer():
    async def main():
        async with Swarm() as swarm:
            a, client = await swarm.private()
            reservation = client.reservations[swarm.relay.peer_id]
            voucher = core.open_voucher(reservation.voucher)
            assert (voucher.relay, voucher.peer, voucher.expiration) == (
                swarm.relay.peer_id,
                a.peer_id,
                reservation.expire,
            )
            tampered = bytearray(reservation.voucher)
            tampered[-1] ^= 1
            with pytest.raises(core.RemoteProtocolError):
                core.open_voucher(bytes(tampered))

    run(main())


@pytest.mark.timeout(30)
def test_dial_without_reservation_is_refused_cleanly():
    async def main():
        async with Swarm() as swarm:
            a, _ = await swarm.private(reserve=False)
            b, _ = await swarm.private(reserve=False)
            await a.connect(swarm.relay_addr)  # connected, but no reservation
            with pytest.raises(DialError, match="NO_RESERVATION"):
                await b.connect(swarm.circuit(a), timeout=TIMEOUT)

    run(main())


@pytest.mark.timeout(30)
def test_reservation_limits_hold():
    async def main():
        limits = RelayLimits(max_reservations=3, max_reservations_per_ip=2)
        async with Swarm(limits) as swarm:
            await swarm.private()
            await swarm.private()
            _, third = await swarm.private(reserve=False)
            with pytest.raises(RelayError) as error:  # every peer here comes from 127.0.0.1
                await third.reserve(swarm.relay_addr)
            assert error.value.status is Status.RESERVATION_REFUSED
            # Renewing an existing reservation is always allowed.
            await swarm.clients[0].reserve(swarm.relay_addr, keep=False)
            assert len(swarm.service.resources.reservations) == 2

    run(main())


@pytest.mark.timeout(30)
def test_circuit_limits_hold_and_data_limit_cuts_the_circuit():
    async def main():
        limits = RelayLimits(max_circuits_per_peer=1, circuit_data=200_000)
        async with Swarm(limits) as swarm:
            a, _ = await swarm.private()
            b, _ = await swarm.private(reserve=False)
            c, _ = await swarm.private(reserve=False)
            await b.connect(swarm.circuit(a), timeout=TIMEOUT)
            with pytest.raises(DialError, match="RESOURCE_LIMIT_EXCEEDED"):  # A already has its one circuit
                await c.connect(swarm.circuit(a), timeout=TIMEOUT)
            stream = await b.new_stream(a.peer_id, ECHO, timeout=TIMEOUT)
            connection = b.get_connection(a.peer_id)
            with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
                await echo_roundtrip(stream, os.urandom(400_000))
            await asyncio.wait_for(connection.closed.wait(), TIMEOUT)
            # The circuit is released: C gets its turn.
            await c.connect(swarm.circuit(a), timeout=TIMEOUT)

    run(main())


@pytest.mark.timeout(30)
def test_duration_limit_cuts_the_circuit():
    async def main():
        async with Swarm(RelayLimits(circuit_duration=1)) as swarm:
            a, _ = await swarm.private()
            b, _ = await swarm.private(reserve=False)
            connection = await b.connect(swarm.circuit(a), timeout=TIMEOUT)
            await asyncio.wait_for(connection.closed.wait(), TIMEOUT)
            assert swarm.service.resources.open_circuits == 0

    run(main())


@pytest.mark.timeout(30)
def test_malformed_hop_messages_get_a_clean_refusal():
    async def main():
        async with Swarm() as swarm:
            b, _ = await swarm.private(reserve=False)
            cases = [
                (b"\xff\xff\xff", Status.MALFORMED_MESSAGE),  # garbage protobuf
                (core.encode_hop(HopMessage(HopType.STATUS, status=Status.OK)), Status.UNEXPECTED_MESSAGE),
                (bytes([0x08, 0x01]), Status.MALFORMED_MESSAGE),  # CONNECT without a peer
                (bytes([0x08, 0x07]), Status.MALFORMED_MESSAGE),  # unknown type
                (b"\x12\x03\x0a\x01\x00" + b"\x08\x01", Status.MALFORMED_MESSAGE),  # invalid peer id
            ]
            for payload, expected in cases:
                stream = await b.new_stream(swarm.relay_addr, core.HOP_PROTOCOL, timeout=TIMEOUT)
                await write_delimited(stream, payload)
                answer = core.decode_hop(await read_message(stream))
                assert (answer.type, answer.status) == (HopType.STATUS, expected), payload
            # An oversized message is refused before it is read.
            stream = await b.new_stream(swarm.relay_addr, core.HOP_PROTOCOL, timeout=TIMEOUT)
            await stream.write(b"\x80\x80\x04")  # 65536
            answer = core.decode_hop(await read_message(stream))
            assert answer.status is Status.MALFORMED_MESSAGE
            # The relay still serves everyone.
            await swarm.private()

    run(main())


@pytest.mark.timeout(30)
def test_stop_handler_refuses_strangers_and_garbage():
    async def main():
        async with Swarm() as swarm:
            a, _ = await swarm.private()
            stranger, _ = await swarm.private(reserve=False)
            # A stranger (not a relay A reserved on) opens a stop stream straight to A: refused.
            await stranger.connect(swarm.circuit(a), timeout=TIMEOUT)
            stream = await stranger.new_stream(a.peer_id, core.STOP_PROTOCOL, timeout=TIMEOUT)
            await write_delimited(
                stream, core.encode_stop(StopMessage(StopType.CONNECT, peer=stranger.peer_id))
            )
            assert core.decode_stop(await read_message(stream)).status is Status.PERMISSION_DENIED
            # Garbage from the relay itself gets MALFORMED_MESSAGE.
            stream = await swarm.relay.new_stream(a.peer_id, core.STOP_PROTOCOL, timeout=TIMEOUT)
            await write_delimited(stream, b"\x08\x05")
            assert core.decode_stop(await read_message(stream)).status is Status.MALFORMED_MESSAGE

    run(main())


@pytest.mark.timeout(30)
def test_a_relay_cannot_pass_one_peer_off_as_another():
    """A malicious relay claims the caller is V while it is really M: Noise inside the circuit refuses."""

    async def main():
        async with Swarm() as swarm:
            a, _ = await swarm.private()
            victim = PrivateKey.generate().peer_id
            mallory = await swarm.host()
            # Mallory plays a relay that A trusts: it is the relay itself, misbehaving.
            stream = await swarm.relay.new_stream(a.peer_id, core.STOP_PROTOCOL, timeout=TIMEOUT)
            await write_delimited(stream, core.encode_stop(StopMessage(StopType.CONNECT, peer=victim)))
            assert core.decode_stop(await read_message(stream)).status is Status.OK
            # The relay now pipes in a handshake made with Mallory's key, pretending to be the victim.
            fake = mallory.make_connection(initiator=True, expected_peer=a.peer_id)
            StreamTransport(stream, fake)
            with pytest.raises((ConnectionError, ProtocolError)):
                await asyncio.wait_for(fake.upgrade(), TIMEOUT)
            assert a.get_connection(victim) is None and a.get_connection(mallory.peer_id) is None

    run(main())


@pytest.mark.timeout(30)
def test_reservation_is_renewed_after_the_relay_connection_drops():
    async def main():
        async with Swarm() as swarm:
            a, _client = await swarm.private(renew_period=0.2)
            await swarm.relay.disconnect(a.peer_id)
            deadline = asyncio.get_running_loop().time() + TIMEOUT
            while swarm.relay.get_connection(
                a.peer_id
            ) is None or not swarm.service.resources.has_reservation(a.peer_id, time.time()):
                assert asyncio.get_running_loop().time() < deadline, "reservation was not renewed"
                await asyncio.sleep(0.02)  # poll with a deadline
            b, _ = await swarm.private(reserve=False)
            stream = await b.new_stream(swarm.circuit(a), ECHO, timeout=TIMEOUT)
            assert await echo_roundtrip(stream, b"hello") == b"hello"

    run(main())
