"""Interoperability of our Host with the Go libp2p daemon (p2pd): dialing both ways (falling back from
our AESGCM Noise suite to "/noise"), identify, ping, 1 MiB custom-protocol echo both ways, the dialer's peer-id check and an unsupported protocol.

The daemon runs Noise + yamux over 127.0.0.1 TCP (see tests/p2pd/daemon.py). Byte streams through
the daemon's control socket must not be half-closed: closing the unix socket for writing ends the
libp2p stream in both directions, so every echo here writes and reads concurrently, reads back exactly
the payload's length and compares it whole. Nothing here sleeps to synchronise or asserts on timing.
"""

import asyncio
import os

import pytest

from plexus.p2p.host import Host
from plexus.p2p.identity import PrivateKey
from plexus.p2p.multiaddr import Multiaddr
from plexus.p2p.protocols.errors import ProtocolError
from plexus.p2p.protocols.noise import CHACHAPOLY_SUITE
from plexus.p2p.stream import StreamResetError
from tests.p2pd import DaemonError

pytestmark = pytest.mark.interop

ECHO = "/plexus-test/echo/1.0.0"
PING = "/ipfs/ping/1.0.0"
IDENTIFY = "/ipfs/id/1.0.0"
PAYLOAD = os.urandom(1 << 20)
CHUNK = 1 << 16
TIMEOUT = 10.0  # per network operation; each test's whole budget is its pytest timeout


async def start_host() -> Host:
    return await Host(host_maddrs=("/ip4/127.0.0.1/tcp/0",)).start()


def plain_addrs(host: Host) -> list[str]:
    """Our dialable addresses without the /p2p part, as the daemon's CONNECT wants them."""
    return [str(addr.without_peer_id()) for addr in host.get_visible_maddrs()]


def daemon_echo(finished: asyncio.Event):
    """A ControlClient stream handler that echoes until the stream ends, then sets `finished`.

    Waiting for `finished` before `ControlClient.close()` keeps close from cancelling a live handler.
    """

    async def echo(info, reader, writer):
        try:
            while data := await reader.read(CHUNK):
                writer.write(data)
                await writer.drain()
        finally:
            finished.set()

    return echo


async def host_echo(stream):
    """Our stream handler: echo chunk by chunk (the daemon side never half-closes, see above)."""
    while data := await stream.read(CHUNK):
        await stream.write(data)
    await stream.close()


async def wait_for(predicate, what: str, timeout: float = TIMEOUT) -> None:
    """Poll `predicate` until true, bounded by a deadline (for state with no event to await)."""
    try:
        async with asyncio.timeout(timeout):
            while not predicate():
                await asyncio.sleep(0.01)  # poll interval; the deadline above bounds the wait
    except TimeoutError:
        raise AssertionError(f"gave up after {timeout} s waiting for {what}") from None


async def wait_until_daemon_lists(client, peer_id, timeout: float = TIMEOUT) -> None:
    """Poll the daemon's LIST_PEERS: its swarm registers an inbound connection a little after the
    handshake that completed our dial, so right after `connect` it may not list us yet."""
    try:
        async with asyncio.timeout(timeout):
            while peer_id not in {peer.peer_id for peer in await client.list_peers()}:
                await asyncio.sleep(0.01)  # poll interval; the deadline above bounds the wait
    except TimeoutError:
        raise AssertionError(f"the daemon did not list {peer_id} as a peer within {timeout} s") from None


@pytest.mark.timeout(60)
def test_host_dials_daemon_identifies_and_pings(p2pd_factory):
    async def main():
        # Two listen addresses: we dial the first, so the second can only have come from identify.
        daemon = await p2pd_factory.start(host_addrs=("/ip4/127.0.0.1/tcp/0", "/ip4/127.0.0.1/tcp/0"))
        assert len(daemon.addrs) == 2, daemon.addrs
        client = daemon.client()
        host = await start_host()
        try:
            await host.connect(daemon.maddrs[0], timeout=TIMEOUT)
            assert daemon.peer_id in host.connected_peers()
            # We offered Plexus's AESGCM suite first; the daemon said "na" and we fell back to "/noise".
            assert host._connections[daemon.peer_id][0].noise_suite is CHACHAPOLY_SUITE
            await wait_until_daemon_lists(client, host.peer_id)

            info = await host.identify(daemon.peer_id, timeout=TIMEOUT)
            assert info.peer_id == daemon.peer_id
            assert {str(addr) for addr in info.addrs} >= set(daemon.addrs), (info.addrs, daemon.addrs)
            assert IDENTIFY in info.protocols and PING in info.protocols, info.protocols
            assert info.agent_version, "the daemon's identify carried no agent version"
            assert info.observed_addr is not None
            assert info.observed_addr.value_for_protocol("ip4") == "127.0.0.1"

            # The daemon serves ping by default (go-libp2p's host enables it); it is in its identify list.
            rtt = await host.ping(daemon.peer_id, timeout=TIMEOUT)
            assert rtt >= 0
        finally:
            await host.shutdown()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_daemon_dials_host_identifies_us_and_pings(p2pd_factory):
    advertised = "/plexus-test/advertised-then-removed/1.0.0"

    async def main():
        daemon = await p2pd_factory.start()
        client = daemon.client()
        host = await start_host()

        async def unused(stream):
            await stream.close()

        host.set_stream_handler(advertised, unused)
        try:
            await client.connect(host.peer_id, plain_addrs(host), timeout=TIMEOUT)
            await wait_for(lambda: daemon.peer_id in host.connected_peers(), "our side to list the daemon")
            assert host.peer_id in {peer.peer_id for peer in await client.list_peers()}

            # A daemon-initiated stream to our ping handler echoes 32 bytes.
            info, reader, writer = await client.stream_open(host.peer_id, [PING])
            assert (info.peer_id, info.protocol) == (host.peer_id, PING)
            payload = os.urandom(32)
            writer.write(payload)
            await writer.drain()
            assert await asyncio.wait_for(reader.readexactly(32), TIMEOUT) == payload
            writer.close()

            # The daemon took our identify: go-libp2p's Connect waits for identify, and NewStream picks a
            # protocol the peerstore says we support without negotiating it (lazy multistream). So a
            # protocol we advertised, then stopped serving, still opens "OK" on the daemon side, while
            # one we never advertised is refused at once. Without our identify both would be refused.
            host.remove_stream_handler(advertised)
            _, _, writer = await client.stream_open(host.peer_id, [advertised])
            writer.close()
            with pytest.raises(DaemonError, match="protocols not supported"):
                await client.stream_open(host.peer_id, ["/plexus-test/never-advertised/1.0.0"])

            # The connection survives both refusals, and we identify the daemon over it too.
            info = await host.identify(daemon.peer_id, timeout=TIMEOUT)
            assert PING in info.protocols
        finally:
            await client.close()
            await host.shutdown()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_host_streams_one_mebibyte_through_daemon_echo(p2pd_factory):
    async def main():
        daemon = await p2pd_factory.start()
        client = daemon.client()
        host = await start_host()
        try:
            handler_finished = asyncio.Event()
            await client.stream_handler(ECHO, daemon_echo(handler_finished))
            stream = await host.new_stream(Multiaddr(daemon.maddrs[0]), [ECHO], timeout=TIMEOUT)
            assert stream.protocol == ECHO

            async def send():
                for offset in range(0, len(PAYLOAD), CHUNK):
                    await stream.write(PAYLOAD[offset : offset + CHUNK])

            sender = asyncio.create_task(send())
            async with asyncio.timeout(30):
                echoed = await stream.readexactly(len(PAYLOAD))
                await sender
            assert len(echoed) == len(PAYLOAD) and echoed == PAYLOAD
            # Our half-close (a yamux FIN) reaches the daemon's handler as EOF. p2pd answers the FIN with
            # a RST rather than a FIN of its own (it cannot proxy a half-close), so accept either end.
            await stream.close()
            try:
                assert await asyncio.wait_for(stream.read(), TIMEOUT) == b""
            except StreamResetError:
                pass
            await asyncio.wait_for(handler_finished.wait(), TIMEOUT)
        finally:
            await client.close()
            await host.shutdown()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_daemon_streams_one_mebibyte_through_host_echo(p2pd_factory):
    async def main():
        daemon = await p2pd_factory.start()
        client = daemon.client()
        host = await start_host()
        host.set_stream_handler(ECHO, host_echo)
        try:
            await client.connect(host.peer_id, plain_addrs(host), timeout=TIMEOUT)
            info, reader, writer = await client.stream_open(host.peer_id, [ECHO])
            assert (info.peer_id, info.protocol) == (host.peer_id, ECHO)

            async def send():
                for offset in range(0, len(PAYLOAD), CHUNK):
                    writer.write(PAYLOAD[offset : offset + CHUNK])
                    await writer.drain()

            sender = asyncio.create_task(send())
            async with asyncio.timeout(30):
                echoed = await reader.readexactly(len(PAYLOAD))
                await sender
            assert len(echoed) == len(PAYLOAD) and echoed == PAYLOAD
            writer.close()
        finally:
            await host.shutdown()

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_dialing_daemon_under_another_peer_id_fails_with_mismatch(p2pd_factory):
    async def main():
        daemon = await p2pd_factory.start()
        host = await start_host()
        impostor = PrivateKey.generate().peer_id
        wrong = Multiaddr(daemon.addrs[0]).with_peer_id(impostor)
        try:
            with pytest.raises(ConnectionError, match="peer id mismatch") as raised:
                await host.connect(wrong, timeout=TIMEOUT)
            assert str(daemon.peer_id) in str(raised.value)
            assert impostor not in host.connected_peers()
            assert daemon.peer_id not in host.connected_peers()
            # The right id still works afterwards: the failure left nothing half-open behind.
            await host.connect(daemon.maddrs[0], timeout=TIMEOUT)
            assert daemon.peer_id in host.connected_peers()
        finally:
            await host.shutdown()

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_unsupported_protocol_to_daemon_fails_fast(p2pd_factory):
    async def main():
        daemon = await p2pd_factory.start()
        host = await start_host()
        unknown = "/plexus-test/nobody-serves-this/1.0.0"
        try:
            await host.connect(daemon.maddrs[0], timeout=TIMEOUT)
            with pytest.raises(ProtocolError, match="supports none of the protocols") as raised:
                await host.new_stream(daemon.peer_id, [unknown], timeout=TIMEOUT)
            assert unknown in str(raised.value)

            # Lazy negotiation reports the refusal on the first read instead.
            stream = await host.new_stream(daemon.peer_id, [unknown], timeout=TIMEOUT, lazy=True)
            await stream.write(b"hello")
            with pytest.raises(ProtocolError, match="supports none of the protocols"):
                await asyncio.wait_for(stream.read(), TIMEOUT)
            stream.reset()

            # The connection is still usable.
            assert await host.ping(daemon.peer_id, timeout=TIMEOUT) >= 0
        finally:
            await host.shutdown()

    asyncio.run(main())
