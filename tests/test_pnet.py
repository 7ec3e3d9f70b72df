"""Private networks (libp2p PSK v1): the swarm key file, the XSalsa20 keystream, and hosts that only
let in peers holding the key (directly and through a relay).

The go-libp2p daemon used for interop tests (tests/p2pd) has no flag for a swarm key, so interop is
checked at the level below: our keystream is libsodium's XSalsa20 (checked against its secretbox,
which is XSalsa20 plus a MAC) and the framing (a 24-byte nonce each way, then the XORed stream) is
the spec's.
"""

import asyncio
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plexus.dht.dht import DHT
from plexus.p2p.host import DialError, Host
from plexus.p2p.pnet import (
    SwarmKeyError,
    XSalsa20,
    decode_swarm_key,
    encode_swarm_key,
    fingerprint,
    generate_swarm_key,
    load_swarm_key,
)
from plexus.p2p.relay import RelayClient, RelayService
from plexus.utils.timing import get_dht_time

nacl = pytest.importorskip("nacl.bindings", reason="private networks need PyNaCl (a dependency of plexus)")
pytestmark = pytest.mark.timeout(60)
LOCAL = ("/ip4/127.0.0.1/tcp/0",)
GO_KEY_FILE = (
    "/key/swarm/psk/1.0.0/\n/base16/\ndffb7e3135399a8b1612b2aaca1c36a3a8ac2cd0cca51ceeb2ced87d308cac6d\n"
)


def test_swarm_key_files_in_every_encoding(tmp_path):
    key = decode_swarm_key(GO_KEY_FILE)
    assert key.hex() == "dffb7e3135399a8b1612b2aaca1c36a3a8ac2cd0cca51ceeb2ced87d308cac6d"
    assert decode_swarm_key(encode_swarm_key(key)) == key
    assert decode_swarm_key(b"/key/swarm/psk/1.0.0/\n/base64/\n" + __import__("base64").b64encode(key)) == key
    assert decode_swarm_key(b"/key/swarm/psk/1.0.0/\r\n/bin/\n" + key) == key
    path = tmp_path / "swarm.key"
    path.write_text(GO_KEY_FILE)
    assert load_swarm_key(path) == key and len(fingerprint(key)) == 16
    for bad, reason in (
        (b"hello\n/base16/\n00", "first line"),
        (GO_KEY_FILE.replace("base16", "base99"), "encoding"),
        (GO_KEY_FILE[:-11], "32 bytes"),
        (GO_KEY_FILE.replace("dffb", "zzzz"), "decode"),
    ):
        with pytest.raises(SwarmKeyError, match=reason):
            decode_swarm_key(bad)
    with pytest.raises(SwarmKeyError, match="cannot read"):
        load_swarm_key(tmp_path / "missing.key")
    with pytest.raises(ValueError, match="32 bytes"):
        Host(swarm_key=b"short")


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=12))
def test_keystream_is_libsodium_xsalsa20_however_the_stream_is_cut(cuts):
    key, nonce, message = os.urandom(32), os.urandom(24), os.urandom(sum(cuts))
    # secretbox = XSalsa20 (its first 32 keystream bytes key the MAC) + Poly1305: the rest is our stream
    expected = nacl.crypto_secretbox(message, nonce, key)[16:]
    stream, out, position = XSalsa20(key, nonce), bytearray(), 0
    stream.apply(bytearray(32))
    for cut in cuts:
        chunk = bytearray(message[position : position + cut])
        stream.apply(chunk)
        out += chunk
        position += cut
    assert bytes(out) == expected


def test_only_peers_with_the_key_connect_and_others_are_served_on():
    async def main():
        key = generate_swarm_key()
        server = await Host(host_maddrs=LOCAL, swarm_key=key).start()
        member = await Host(host_maddrs=(), swarm_key=key).start()
        addr = server.get_visible_maddrs()[0]
        assert await member.ping(addr) < 5
        payload = os.urandom(3 << 20)

        async def echo(stream):
            while data := await stream.read():
                await stream.write(data)
            await stream.close()

        server.set_stream_handler("/test/echo/1.0.0", echo)
        stream = await member.new_stream(addr, "/test/echo/1.0.0")
        sender = asyncio.ensure_future(stream.write(payload))
        received = bytearray()
        while len(received) < len(payload):
            received += await stream.read()
        await sender
        assert bytes(received) == payload
        for stranger_key in (None, generate_swarm_key()):  # no key, or another network's key
            stranger = await Host(host_maddrs=(), swarm_key=stranger_key).start()
            # Refused, or left waiting on noise that never parses: either way no connection.
            with pytest.raises((DialError, TimeoutError)):
                await stranger.connect(addr, timeout=5)
            await stranger.shutdown()
        # A plain TCP client sees only noise: whatever it sends, nothing readable comes back.
        port = int(server.get_listen_maddrs()[0].value_for_protocol("tcp"))
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"\x13/multistream/1.0.0\n")
        answer = await asyncio.wait_for(reader.read(100), 5)
        assert b"multistream" not in answer
        writer.close()
        assert await member.ping(addr) < 5
        await member.shutdown()
        await server.shutdown()

    asyncio.run(asyncio.wait_for(main(), 50))


def test_relayed_connections_are_protected_inside_the_circuit():
    async def main():
        key = generate_swarm_key()
        relay = await Host(host_maddrs=LOCAL, swarm_key=key).start()
        service = RelayService(relay).start()
        a, b = [await Host(host_maddrs=(), swarm_key=key).start() for _ in range(2)]
        clients = [RelayClient(host).start() for host in (a, b)]
        await clients[1].reserve(relay.get_visible_maddrs()[0])
        circuit = relay.get_visible_maddrs()[0].encapsulate(f"/p2p-circuit/p2p/{b.peer_id}")
        connection = await a.connect(circuit, timeout=10)
        assert connection.relayed
        assert await a.ping(b.peer_id, timeout=10) >= 0
        for client in clients:
            await client.stop()
        await service.stop()
        for host in (relay, a, b):
            await host.shutdown()

    asyncio.run(asyncio.wait_for(main(), 50))


def test_a_private_dht_swarm_stores_and_gets_and_keeps_strangers_out():
    key = generate_swarm_key()
    first = DHT(start=True, host_maddrs=list(LOCAL), swarm_key=key)
    second = DHT(initial_peers=first.get_visible_maddrs(), start=True, host_maddrs=list(LOCAL), swarm_key=key)
    try:
        assert second.store("secret", "value", get_dht_time() + 60)
        assert first.get("secret", latest=True).value == "value"
        with pytest.raises(Exception, match="could not reach any initial peer"):
            DHT(
                initial_peers=first.get_visible_maddrs(),
                start=True,
                host_maddrs=list(LOCAL),
                startup_timeout=15,
            )
    finally:
        second.shutdown()
        first.shutdown()
