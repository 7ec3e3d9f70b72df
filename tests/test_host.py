"""The Host over real TCP on 127.0.0.1: dial, reuse, streams, identify, ping, limits, bad peers, shutdown."""

import asyncio
import hashlib
import os
import socket

import pytest

from plexus.p2p.connection import MAX_PLAINTEXT_BUFFERS, Connection
from plexus.p2p.host import DialError, Host, HostOptions
from plexus.p2p.identity import PrivateKey, load_or_create_identity
from plexus.p2p.multiaddr import Multiaddr
from plexus.p2p.protocols.multistream import HEADER, NegotiationError, encode_message
from plexus.p2p.protocols.noise import AESGCM_SUITE, CHACHAPOLY_SUITE
from plexus.p2p.stream import StreamError, StreamResetError

pytestmark = pytest.mark.timeout(30)
LOCAL = ("/ip4/127.0.0.1/tcp/0",)


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 25))


async def hosts(n: int, **options) -> list[Host]:
    return [await Host(host_maddrs=LOCAL, **options).start() for _ in range(n)]


async def shutdown(*all_hosts: Host) -> None:
    for host in all_hosts:
        await host.shutdown()


async def echo(stream) -> None:
    while data := await stream.read():
        await stream.write(data)
    await stream.close()


def test_ping_identify_and_visible_addresses():
    async def main():
        a, b = await hosts(2)
        (addr,) = b.get_visible_maddrs()
        assert addr.peer_id == b.peer_id and str(addr).startswith("/ip4/127.0.0.1/tcp/")
        assert await a.ping(addr) < 5
        info = await a.identify(b.peer_id, timeout=5)
        assert "/ipfs/ping/1.0.0" in info.protocols and "/ipfs/id/1.0.0" in info.protocols
        assert info.addrs == [addr.without_peer_id()]
        assert info.observed_addr.value_for_protocol("ip4") == "127.0.0.1"
        await shutdown(a, b)

    run(main())


def test_wildcard_listener_announces_loopback_and_announce_maddrs_win():
    async def main():
        (a,) = [await Host(host_maddrs=("/ip4/0.0.0.0/tcp/0",)).start()]
        port = a.get_listen_maddrs()[0].value_for_protocol("tcp")
        assert Multiaddr(f"/ip4/127.0.0.1/tcp/{port}").with_peer_id(a.peer_id) in a.get_visible_maddrs()
        b = await Host(host_maddrs=LOCAL, announce_maddrs=("/ip4/203.0.113.7/tcp/4001",)).start()
        assert [str(m) for m in b.get_visible_maddrs()] == [f"/ip4/203.0.113.7/tcp/4001/p2p/{b.peer_id}"]
        await shutdown(a, b)

    run(main())


def test_one_connection_per_peer_pair_and_concurrent_dials_share():
    async def main():
        a, b = await hosts(2)
        addr = b.get_visible_maddrs()[0]
        connections = await asyncio.gather(*(a.connect(addr) for _ in range(10)))
        assert len(set(map(id, connections))) == 1
        await a.ping(b.peer_id)
        await b.ping(a.peer_id)  # b reuses the inbound connection instead of dialing back
        assert len(a._connections[b.peer_id]) == 1 and len(b._connections[a.peer_id]) == 1
        await shutdown(a, b)

    run(main())


def test_streams_carry_data_both_ways_with_half_close():
    async def main():
        a, b = await hosts(2)
        b.set_stream_handler("/test/echo/1.0.0", echo)
        payload = os.urandom(3 << 20)
        stream = await a.new_stream(b.get_visible_maddrs()[0], ["/test/missing/1.0.0", "/test/echo/1.0.0"])
        assert stream.protocol == "/test/echo/1.0.0"

        async def send():
            await stream.write(payload)
            await stream.close()

        sender = asyncio.create_task(send())
        received = await stream.read_until_eof(limit=4 << 20)
        await sender
        assert hashlib.sha256(received).digest() == hashlib.sha256(payload).digest()
        await shutdown(a, b)

    run(main())


@pytest.mark.parametrize(
    "dialer, listener, agreed",
    [
        (("AESGCM", "ChaChaPoly"), ("AESGCM", "ChaChaPoly"), AESGCM_SUITE),
        (
            ("AESGCM", "ChaChaPoly"),
            ("ChaChaPoly",),
            CHACHAPOLY_SUITE,
        ),  # a plain libp2p listener answers "na" first
        (("ChaChaPoly",), ("AESGCM", "ChaChaPoly"), CHACHAPOLY_SUITE),  # a plain libp2p dialer
        (("ChaChaPoly", "AESGCM"), ("AESGCM", "ChaChaPoly"), CHACHAPOLY_SUITE),  # the dialer's order wins
    ],
)
def test_noise_cipher_suites_are_negotiated(dialer, listener, agreed):
    async def main():
        a = await Host(host_maddrs=LOCAL, noise_ciphers=dialer).start()
        b = await Host(host_maddrs=LOCAL, noise_ciphers=listener).start()
        b.set_stream_handler("/test/echo/1.0.0", echo)
        payload = os.urandom(300_000)
        stream = await a.new_stream(b.get_visible_maddrs()[0], ["/test/echo/1.0.0"])
        await stream.write(payload)
        assert await stream.readexactly(len(payload)) == payload
        assert a._connections[b.peer_id][0].noise_suite is b._connections[a.peer_id][0].noise_suite is agreed
        await shutdown(a, b)

    run(main())


def test_a_peer_without_a_common_cipher_suite_is_refused():
    async def main():
        a = await Host(host_maddrs=LOCAL, noise_ciphers=("AESGCM",)).start()
        b = await Host(host_maddrs=LOCAL, noise_ciphers=("ChaChaPoly",)).start()
        with pytest.raises(DialError, match="none of the protocols we proposed: /plexus/noise-aesgcm/1.0.0"):
            await a.connect(b.get_visible_maddrs()[0])
        (c,) = await hosts(1)
        assert await c.ping(b.get_visible_maddrs()[0]) < 5  # still serving
        await shutdown(a, b, c)

    run(main())


def test_the_first_noise_message_travels_with_the_cipher_proposal():
    """A dialer does not wait a round trip for the listener's yes to its cipher suite: a listener
    that never answers still receives the proposal and the first Noise message."""

    async def main():
        first_bytes = asyncio.get_running_loop().create_future()
        wanted = encode_message(HEADER) + encode_message(AESGCM_SUITE.protocol_id)

        async def silent(reader, writer):
            data = b""
            while len(data) < len(wanted) + 2 + 32:  # Noise frame: 2-byte length, 32-byte ephemeral key
                data += await reader.read(4096)
            first_bytes.set_result(data)
            await reader.read()  # the dialer gives up and closes
            writer.close()

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        (a,) = await hosts(1, dial_timeout=20)
        b = PrivateKey.generate().peer_id
        dial = asyncio.ensure_future(a.connect(f"/ip4/127.0.0.1/tcp/{port}/p2p/{b}"))
        data = await asyncio.wait_for(first_bytes, 10)
        assert data.startswith(wanted) and data[len(wanted) : len(wanted) + 2] == b"\x00\x20"
        dial.cancel()
        await shutdown(a)
        server.close()
        await server.wait_closed()

    run(main())


def test_a_listener_without_our_first_cipher_suite_is_dialed_again_without_optimism():
    async def main():
        a = await Host(host_maddrs=LOCAL).start()
        b = await Host(host_maddrs=LOCAL, noise_ciphers=("ChaChaPoly",)).start()
        b.set_stream_handler("/test/echo/1.0.0", echo)
        for _ in range(2):  # the second dial knows at once to propose the suites one at a time
            stream = await a.new_stream(b.get_visible_maddrs()[0], ["/test/echo/1.0.0"])
            await stream.write(b"hello")
            assert await stream.readexactly(5) == b"hello"
            assert a.peer_info(b.peer_id).refuses_optimism
            assert a._connections[b.peer_id][0].noise_suite is CHACHAPOLY_SUITE
            await a.disconnect(b.peer_id)
        (c,) = await hosts(1)
        assert await c.ping(b.get_visible_maddrs()[0]) < 5  # the refused attempt left b serving
        await shutdown(a, b, c)

    run(main())


@pytest.mark.parametrize("ciphers", [(), ("AESGCM", "DES")])
def test_unknown_noise_ciphers_are_refused_clearly(ciphers):
    with pytest.raises(ValueError, match="noise_ciphers must name one or more of .'AESGCM', 'ChaChaPoly'."):
        HostOptions(noise_ciphers=ciphers)


def test_many_concurrent_streams():
    async def main():
        a, b = await hosts(2)
        b.set_stream_handler("/test/echo/1.0.0", echo)
        addr = b.get_visible_maddrs()[0]

        async def one(i: int):
            stream = await a.new_stream(addr, "/test/echo/1.0.0", lazy=True)
            message = f"message {i}".encode() * 100
            await stream.write(message)
            await stream.close()
            assert await stream.read_until_eof(limit=1 << 20) == message

        await asyncio.gather(*(one(i) for i in range(200)))
        assert not a.get_connection(b.peer_id).streams
        await shutdown(a, b)

    run(main())


def test_coalesced_small_writes_keep_their_bytes_and_order_with_large_ones():
    """Small writes are queued until the end of the loop iteration: a caller that reuses its buffer
    at once must not change what was sent, and a large (zero-copy, flushed at once) write must
    not overtake the small writes queued before it."""

    async def main():
        a, b = await hosts(2)
        b.set_stream_handler("/test/echo/1.0.0", echo)
        stream = await a.new_stream(b.get_visible_maddrs()[0], "/test/echo/1.0.0", lazy=True)
        buffer, expected = bytearray(100), []
        for i in range(50):
            buffer[:] = bytes([i]) * 100  # the same bytearray, overwritten right after each write
            await stream.write(buffer)
            expected.append(bytes(buffer))
            if i % 10 == 9:
                large = os.urandom(200 << 10)
                await stream.write(memoryview(large))
                expected.append(large)
        await stream.close()
        received = await stream.read_until_eof(limit=4 << 20)
        assert received == b"".join(expected)
        await shutdown(a, b)

    run(main())


def test_received_data_survives_buffer_reuse_while_readers_hold_it():
    """Streams keep views of decrypted batches until read. Twenty streams from two peers, whose
    reader waits, let their windows of data pile up and hold every buffer of the pool that the two
    connections share, so later batches of both go through the one scratch buffer; once read, each
    stream's bytes must still be exactly the bytes sent."""

    async def main():
        a, b, c = await hosts(3)
        release, received = asyncio.Event(), {}

        async def slow_sink(stream):
            tag = await stream.readexactly(8)
            await release.wait()
            received[tag] = hashlib.sha256(await stream.read_until_eof(limit=16 << 20)).digest()
            await stream.close()

        b.set_stream_handler("/test/sink/1.0.0", slow_sink)
        addr, sent = b.get_visible_maddrs()[0], {}

        async def send(sender: Host, i: int):
            tag, data = i.to_bytes(8, "big"), os.urandom(2 << 20)
            sent[tag] = hashlib.sha256(data).digest()
            stream = await sender.new_stream(addr, "/test/sink/1.0.0", lazy=True)
            await stream.write(tag + data)
            await stream.close()
            await stream.read_until_eof(limit=0)

        senders = [asyncio.create_task(send((a, c)[i % 2], i)) for i in range(20)]

        def buffered() -> int:
            connections = [b.get_connection(a.peer_id), b.get_connection(c.peer_id)]
            return sum(
                stream._buffered
                for connection in connections
                if connection
                for stream in connection.streams.values()
            )

        while buffered() < 16 << 20:  # every stream's window is full (the test's timeout bounds this)
            await asyncio.sleep(0.01)
        assert len(b._decrypt_buffers.pool) == MAX_PLAINTEXT_BUFFERS
        assert b._decrypt_buffers.scratch is not None  # the pool ran out on the way
        release.set()
        await asyncio.gather(*senders)
        assert received == sent
        await shutdown(a, b, c)

    run(main())


def test_unknown_protocol_is_refused_clearly():
    async def main():
        a, b = await hosts(2)
        with pytest.raises(NegotiationError, match="/test/nothing"):
            await a.new_stream(b.get_visible_maddrs()[0], "/test/nothing/1.0.0")
        lazy = await a.new_stream(b.get_visible_maddrs()[0], "/test/nothing/1.0.0", lazy=True)
        with pytest.raises(NegotiationError):
            await lazy.read()
        assert await a.ping(b.peer_id) < 5  # the connection is still fine
        await shutdown(a, b)

    run(main())


def test_peer_id_mismatch_is_refused():
    async def main():
        a, b = await hosts(2)
        impostor = PrivateKey.generate().peer_id
        wrong = b.get_visible_maddrs()[0].without_peer_id().with_peer_id(impostor)
        with pytest.raises(DialError, match="peer id mismatch"):
            await a.connect(wrong)
        with pytest.raises(DialError, match="no /p2p/"):
            await a.connect(b.get_visible_maddrs()[0].without_peer_id())
        await shutdown(a, b)

    run(main())


def test_dial_error_names_each_address():
    async def main():
        (a,) = await hosts(1)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        target = PrivateKey.generate().peer_id
        with pytest.raises(DialError, match=f"127.0.0.1/tcp/{port}: connection refused"):
            await a.connect(Multiaddr(f"/ip4/127.0.0.1/tcp/{port}").with_peer_id(target))
        await shutdown(a)

    run(main())


def test_handler_errors_and_garbage_do_not_take_the_host_down():
    async def main():
        a, b = await hosts(2)

        async def broken(stream):
            raise RuntimeError("handler bug")

        b.set_stream_handler("/test/broken/1.0.0", broken)
        stream = await a.new_stream(b.get_visible_maddrs()[0], "/test/broken/1.0.0")
        with pytest.raises(StreamResetError):
            await stream.read()
        port = int(b.get_listen_maddrs()[0].value_for_protocol("tcp"))
        for garbage in (
            b"\x00" * 100,
            os.urandom(5000),
            b"\x13/multistream/1.0.0\n\x07/noise\n" + os.urandom(300),
        ):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(garbage)
            writer.write_eof()  # a peer that sends garbage and stops: the host must close, not wait
            await reader.read()
            writer.close()
        assert await a.ping(b.peer_id) < 5
        c = await Host(host_maddrs=()).start()
        assert await c.ping(b.get_visible_maddrs()[0]) < 5
        await shutdown(a, b, c)

    run(main())


def test_connection_limit_and_idle_timeout():
    async def main():
        (server,) = await hosts(1, max_connections=2, idle_timeout=0.3)
        addr = server.get_visible_maddrs()[0]
        clients = [await Host(host_maddrs=()).start() for _ in range(3)]
        first = await clients[0].connect(addr)
        await clients[1].connect(addr)
        with pytest.raises((DialError, ConnectionError)):
            await clients[2].connect(addr)
        await asyncio.wait_for(first.closed.wait(), 5)  # closed by the server's idle sweep
        assert await clients[2].ping(addr) < 5  # room again once idle connections are gone
        await shutdown(server, *clients)

    run(main())


def test_shutdown_leaves_no_tasks_or_sockets():
    async def main():
        before = {task for task in asyncio.all_tasks()}
        a, b = await hosts(2)
        b.set_stream_handler("/test/echo/1.0.0", echo)
        stream = await a.new_stream(b.get_visible_maddrs()[0], "/test/echo/1.0.0")
        await stream.write(b"open stream during shutdown")
        await shutdown(a, b)
        await asyncio.sleep(0)  # let cancelled callbacks run once
        assert {task for task in asyncio.all_tasks()} - before == set()
        assert not a._connections and not b._connections
        with pytest.raises(StreamError):
            await stream.write(b"more")

    run(main())


def test_identity_file_keeps_the_peer_id(tmp_path):
    path = tmp_path / "keys" / "identity.key"
    first = load_or_create_identity(path)
    assert (path.stat().st_mode & 0o777) == 0o600
    assert load_or_create_identity(path).peer_id == first.peer_id

    async def main():
        host = await Host(first, host_maddrs=LOCAL).start()
        assert host.peer_id == first.peer_id
        await host.shutdown()

    run(main())


def test_connection_repr_shows_state():
    connection = Connection(PrivateKey.generate(), initiator=True)
    assert "upgrading" in repr(connection)


def test_traffic_counters_see_every_byte_on_the_wire():
    """What one host sends the other receives (framing and encryption included), and a payload
    costs at least its own size: the counters that DiLoCo reports per round."""

    async def main():
        a, b = await hosts(2)
        b.set_stream_handler("/test/echo/1.0.0", echo)
        stream = await a.new_stream(b.get_visible_maddrs()[0], ["/test/echo/1.0.0"])
        sent_before, _ = a.traffic.snapshot()
        payload = os.urandom(200_000)
        await stream.write(payload)
        assert await stream.readexactly(len(payload)) == payload
        await stream.close()
        sent, received = a.traffic.snapshot()
        assert len(payload) <= sent - sent_before < 1.1 * len(payload)
        assert len(payload) <= received < 1.2 * len(payload)
        for _ in range(200):  # b counts a's bytes as they arrive: poll for the last ones (2 s at most)
            if b.traffic.bytes_received >= sent:
                break
            await asyncio.sleep(0.01)
        assert b.traffic.bytes_received >= sent
        await shutdown(a, b)

    run(main())
