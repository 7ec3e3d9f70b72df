"""Self-test of the p2pd fixture: proves the control client works before our own host exists."""

import asyncio
import os

import pytest

from tests.p2pd import DaemonError, decode_multiaddr, encode_multiaddr

ECHO = "/plexus-test/echo/1.0.0"
PAYLOAD = os.urandom(1 << 20)


@pytest.mark.parametrize(
    "text, hex_bytes",
    [
        ("/ip4/127.0.0.1/tcp/4001", "047f000001060fa1"),
        ("/ip4/127.0.0.1/udp/4001/quic-v1", "047f00000191020fa1cd03"),
        ("/unix/tmp/p2pd.sock", "90030e" + b"/tmp/p2pd.sock".hex()),
    ],
)
def test_multiaddr_codec_round_trips(text, hex_bytes):
    assert encode_multiaddr(text).hex() == hex_bytes
    assert decode_multiaddr(bytes.fromhex(hex_bytes)) == text


async def echo(info, reader, writer):
    while data := await reader.read(1 << 16):
        writer.write(data)
        await writer.drain()


@pytest.mark.interop
@pytest.mark.timeout(30)
def test_two_daemons_connect_and_echo_one_mebibyte(p2pd_factory):
    async def main():
        a, b = await p2pd_factory.start_many(2)
        client_a, client_b = a.client(), b.client()
        try:
            await client_a.connect(b.peer_id, b.addrs)
            assert b.peer_id in {peer.peer_id for peer in await client_a.list_peers()}
            assert a.peer_id in {peer.peer_id for peer in await client_b.list_peers()}

            await client_b.stream_handler(ECHO, echo)
            info, reader, writer = await client_a.stream_open(b.peer_id, [ECHO])
            assert (info.peer_id, info.protocol) == (b.peer_id, ECHO)

            # Write and read concurrently: a half-close would end the whole proxied stream.
            async def send():
                for offset in range(0, len(PAYLOAD), 1 << 16):
                    writer.write(PAYLOAD[offset : offset + (1 << 16)])
                    await writer.drain()

            sender = asyncio.create_task(send())
            echoed = await reader.readexactly(len(PAYLOAD))
            await sender
            assert echoed == PAYLOAD
            writer.close()

            with pytest.raises(DaemonError, match="protocols not supported"):
                await client_a.stream_open(b.peer_id, ["/plexus-test/nobody-serves-this/1.0.0"])
        finally:
            await client_b.close()

    asyncio.run(main())
