"""Circuit relay v2 against go-libp2p (the p2pd daemon): our client on a Go relay, and a Go dialer
through our relay service. Both ways the session inside the circuit is a full Noise + yamux session
between the two end peers, so these tests also check our framing of hop/stop messages byte for byte
against a real implementation."""

import asyncio
import os

import pytest

from plexus.p2p.host import Host
from plexus.p2p.protocols import relay as core
from plexus.p2p.relay import RelayClient, RelayService

pytestmark = pytest.mark.interop

ECHO = "/plexus-test/echo/1.0.0"
PING = "/ipfs/ping/1.0.0"
TIMEOUT = 10


async def echo(stream):
    while data := await stream.read(1 << 16):
        await stream.write(data)
    await stream.close()


@pytest.mark.timeout(60)
def test_our_private_peer_reserves_on_a_go_relay_and_is_dialed_through_it(p2pd_factory):
    async def main():
        daemon = await p2pd_factory.start(relay=True, relay_service=True)
        a = await Host(host_maddrs=()).start()
        b = await Host(host_maddrs=()).start()
        a.set_stream_handler(ECHO, echo)
        client_a, client_b = RelayClient(a).start(), RelayClient(b).start()
        try:
            reservation = await client_a.reserve(daemon.maddrs[0])
            voucher = core.open_voucher(reservation.voucher)  # go-libp2p signs it; we verify it
            assert (voucher.relay, voucher.peer, voucher.expiration) == (
                daemon.peer_id,
                a.peer_id,
                reservation.expire,
            )
            assert reservation.limit is not None  # go-libp2p relays are "limited" relays
            circuit = a.get_visible_maddrs()[0]
            assert str(circuit) == f"{daemon.maddrs[0]}/p2p-circuit/p2p/{a.peer_id}"

            stream = await b.new_stream(circuit, ECHO, timeout=TIMEOUT)
            payload = os.urandom(32 << 10)  # well under the Go relay's default 128 KiB data limit
            await stream.write(payload)
            await stream.close()
            assert await asyncio.wait_for(stream.read_until_eof(1 << 20), TIMEOUT) == payload
            assert b.get_connection(a.peer_id).relayed
        finally:
            for client in (client_a, client_b):
                await client.stop()
            await a.shutdown()
            await b.shutdown()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_go_peer_dials_our_private_peer_through_our_relay(p2pd_factory):
    async def main():
        relay = await Host(host_maddrs=("/ip4/127.0.0.1/tcp/0",)).start()
        service = RelayService(relay).start()
        a = await Host(host_maddrs=()).start()
        client_a = RelayClient(a).start()
        daemon = await p2pd_factory.start(relay=True)
        control = daemon.client()
        try:
            await client_a.reserve(relay.get_visible_maddrs()[0])
            circuit = str(relay.get_visible_maddrs()[0].encapsulate("/p2p-circuit"))
            await control.connect(a.peer_id, [circuit], timeout=TIMEOUT)
            # Noise inside the circuit told A who is calling: the daemon, by its own key.
            connection = a.get_connection(daemon.peer_id)
            assert connection is not None and connection.relayed
            assert service.circuits_served == 1

            # Streams both ways over the relayed connection.
            assert await a.ping(daemon.peer_id, timeout=TIMEOUT) >= 0
            _info, reader, writer = await control.stream_open(a.peer_id, [PING])
            payload = os.urandom(32)
            writer.write(payload)
            await writer.drain()
            assert await asyncio.wait_for(reader.readexactly(32), TIMEOUT) == payload
            writer.close()
        finally:
            await control.close()
            await client_a.stop()
            await service.stop()
            await a.shutdown()
            await relay.shutdown()

    asyncio.run(main())
