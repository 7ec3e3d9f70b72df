"""Hostile peers against the host's bounds: connection floods, silent streams, ping floods, stream hoarding.

Each test plays the attacker for real over TCP on the loopback interface and checks two things:
the host refuses (and logs, once) what is past its bound, and it keeps serving honest peers.
"""

import asyncio
import logging
import socket

import pytest

from plexus.dht.node import DHTNode
from plexus.dht.p2p_transport import HostDHTTransport
from plexus.p2p.host import Host
from plexus.p2p.limits import InboundConnections, TokenBucket, address_keys
from plexus.p2p.multiaddr import Multiaddr
from plexus.p2p.ping import PING_PROTOCOL, PING_SIZE
from plexus.p2p.stream import StreamError
from plexus.testing.flood import ConnectionFlood
from plexus.utils.logging import RateLimitedLog
from plexus.utils.timing import get_dht_time

pytestmark = pytest.mark.timeout(60)
LOCAL = ("/ip4/127.0.0.1/tcp/0",)


def run(coroutine, timeout: float = 50):
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


async def until(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    """Poll `predicate` on the running loop until it holds (TimeoutError naming `what` otherwise)."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.02)  # polling with a deadline, not synchronisation


def refusals(caplog, text: str) -> list[str]:
    return [record.getMessage() for record in caplog.records if text in record.getMessage()]


# --- the bookkeeping, without sockets ---------------------------------------------------------------


def test_inbound_connections_are_bounded_per_ip_subnet_and_in_total():
    limits = InboundConnections(
        max_total=10, max_pending=10, per_ip=2, per_subnet=3, exempt_networks=("127.0.0.0/8",)
    )
    assert address_keys("10.0.0.7") == ("10.0.0.7/32", "10.0.0.0/24")
    assert address_keys("2001:db8::1") == ("2001:db8::/64", "2001:db8::/48")
    assert address_keys("::ffff:10.0.0.7") == ("10.0.0.7/32", "10.0.0.0/24")
    first, second = limits.admit("10.0.0.7")[0], limits.admit("10.0.0.7")[0]
    ticket, reason = limits.admit("10.0.0.7")
    assert ticket is None and "10.0.0.7/32 holds 2 connections" in reason
    assert "max_connections_per_ip" in reason
    assert limits.admit("10.0.0.8")[0] is not None
    ticket, reason = limits.admit("10.0.0.9")
    assert ticket is None and "subnet 10.0.0.0/24" in reason
    for _ in range(2):  # one IPv6 host owns its /64: two addresses in it count as one IP
        assert limits.admit("2001:db8::1")[0] if _ == 0 else limits.admit("2001:db8::2")[0]
    assert "2001:db8::/64" in limits.admit("2001:db8::3")[1]
    limits.release(first)
    assert limits.admit("10.0.0.9")[0] is not None  # room in the subnet again
    for _ in range(5):  # loopback is exempt from per-IP bounds, not from the total (10)
        assert limits.admit("127.0.0.1")[0] is not None
    ticket, reason = limits.admit("127.0.0.1")
    assert ticket is None and "max_connections" in reason
    limits.release(second)
    assert limits.total == 9 and limits.pending == 9


def test_pending_handshakes_and_rates_are_bounded():
    limits = InboundConnections(max_total=10, max_pending=1, per_ip=10, per_subnet=10)
    ticket = limits.admit("10.0.0.1")[0]
    assert "max_pending_connections" in limits.admit("10.0.0.2")[1]
    limits.upgraded(ticket)
    assert limits.admit("10.0.0.2")[0] is not None
    bucket = TokenBucket(rate=2, burst=3)
    assert [bucket.allow("p", 0.0) for _ in range(4)] == [True, True, True, False]
    assert bucket.allow("p", 0.5) and not bucket.allow("p", 0.5)  # 2 per second refill
    assert bucket.allow("q", 0.5)  # another key has its own bucket


def test_rate_limited_log_says_each_thing_once_and_counts_the_rest(caplog):
    now = [0.0]
    log = RateLimitedLog(logging.getLogger("plexus.test"), interval=60, per_kind=2, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="plexus.test"):
        assert log.warning(("flood", "peer-a"), "peer-a floods")
        assert not log.warning(("flood", "peer-a"), "peer-a floods")
        assert log.warning(("flood", "peer-b"), "peer-b floods")
        assert not log.warning(("flood", "peer-c"), "peer-c floods")  # the kind's budget is spent
        now[0] = 61
        assert log.warning(("flood", "peer-a"), "peer-a floods again")
    assert [r.getMessage() for r in caplog.records] == [
        "peer-a floods",
        "peer-b floods (1 more like it not logged)",
        "peer-a floods again (1 more like it not logged)",
    ]


# --- floods against a live node --------------------------------------------------------------------


async def dht_peer(bootstrap: list | None = None, **options) -> tuple[Host, DHTNode]:
    host = await Host(**{"host_maddrs": LOCAL, **options}).start()
    for other, addrs in bootstrap or ():
        host.add_addrs(other.peer_id, addrs)
    node = await DHTNode.create(
        initial_peers=[other.peer_id for other, _ in bootstrap or ()],
        rpc=HostDHTTransport(host),
        wait_timeout=5,
    )
    return host, node


async def close(*peers) -> None:
    for host, node in peers:
        await node.shutdown()
        await host.shutdown()


async def join_and_get_during(flood: ConnectionFlood, attempts: int, victim, keys: dict):
    """Run the flood; when it has made all but its last few connections (those it kept are held open, each
    with a silent stream), a newcomer joins through the victim and gets every key."""
    attack = asyncio.ensure_future(flood.run(attempts))
    try:
        await until(lambda: flood.opened + flood.refused >= attempts - 50, 120, "the flood getting under way")
        newcomer = await dht_peer([(victim[0], [victim_addr(victim)])])
        try:
            for key, value in keys.items():
                found = await newcomer[1].get(key)
                assert found is not None and found.value == value, key
            assert not attack.done() or flood.opened + flood.refused >= attempts
        finally:
            await close(newcomer)
        await attack
    finally:
        attack.cancel()
    assert flood.opened + flood.refused == attempts


def victim_addr(victim) -> Multiaddr:
    return [addr for addr in victim[0].get_listen_maddrs() if addr.protocols()[0] == "ip4"][0]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_thousand_silent_connections_from_one_peer_leave_room_for_a_newcomer(caplog):
    async def main():
        victim = await dht_peer()
        others = [await dht_peer([(victim[0], victim[0].get_listen_maddrs())]) for _ in range(2)]
        keys = {f"key-{i}": f"value-{i}" for i in range(5)}
        for i, (key, value) in enumerate(keys.items()):
            assert await others[i % 2][1].store(key, value, get_dht_time() + 600)
        flood = ConnectionFlood(victim[0].get_visible_maddrs()[0], identities=1)
        try:
            await join_and_get_during(flood, 1100, victim, keys)
            assert flood.alive <= victim[0].options.max_connections_per_peer
            limit = victim[0].options.max_connections_per_peer
            assert len(victim[0].connections_to(flood.keys[0].peer_id)) <= limit
        finally:
            await flood.stop()
            await close(victim, *others)
        lines = refusals(caplog, "(max_connections_per_peer)")
        assert 1 <= len(lines) <= 2 and str(flood.keys[0].peer_id) in lines[0]  # once, naming the peer

    run(main(), 170)


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.skipif(not ipv6_loopback(), reason="needs the IPv6 loopback address ::1 as a second source IP")
def test_a_thousand_connections_from_one_ip_under_many_peer_ids_leave_room_for_a_newcomer(caplog):
    # The attacker comes from ::1 under a fresh peer id for every connection; honest peers from 127.0.0.1.
    # Loopback is exempt from the per-IP bound by default, so the victim takes the exemption away.
    async def main():
        victim = await dht_peer(
            host_maddrs=("/ip4/127.0.0.1/tcp/0", "/ip6/::1/tcp/0"), limit_exempt_networks=()
        )
        other = await dht_peer([(victim[0], [victim_addr(victim)])])
        assert await other[1].store("key", "value", get_dht_time() + 600)
        ip6 = [addr for addr in victim[0].get_listen_maddrs() if addr.protocols()[0] == "ip6"][0]
        flood = ConnectionFlood(ip6.with_peer_id(victim[0].peer_id), identities=1100)
        try:
            await join_and_get_during(flood, 1100, victim, {"key": "value"})
            limit = victim[0].options.max_connections_per_ip
            assert flood.alive <= limit and victim[0]._inbound.by_ip[address_keys("::1")[0]] <= limit
        finally:
            await flood.stop()
            await close(victim, other)
        lines = refusals(caplog, "(max_connections_per_ip)")
        assert 1 <= len(lines) <= 2 and "::1" in lines[0]

    run(main(), 170)


def test_silent_streams_are_reset_and_idle_connections_closed_with_streams_open(caplog):
    async def main():
        server = await Host(
            host_maddrs=LOCAL, negotiate_timeout=0.3, request_timeout=0.3, idle_timeout=0.8
        ).start()
        flood = ConnectionFlood(server.get_visible_maddrs()[0])  # one connection, a ping stream, then silence
        await flood.run(1)
        (connection,) = flood.held
        (stream,) = [stream for stream_id, stream in connection.streams.items() if stream_id % 2]  # ours: odd
        await until(lambda: stream.is_reset, 5, "the silent ping stream being reset")
        mute = connection.open_stream()  # a stream that never even proposes a protocol
        await until(lambda: mute.is_reset, 5, "the mute stream being reset")
        await asyncio.wait_for(connection.closed.wait(), 5)  # then the idle sweep closes the connection
        honest = await Host(host_maddrs=()).start()
        assert await honest.ping(server.get_visible_maddrs()[0]) < 5
        await honest.shutdown()
        await server.shutdown()
        peer = str(flood.keys[0].peer_id)
        assert any(peer in line for line in refusals(caplog, "it sent nothing within 0.3 s"))
        assert any(peer in line for line in refusals(caplog, "no protocol picked within 0.3 s"))

    run(main())


def test_a_long_request_keeps_its_connection_alive_on_both_sides():
    async def main():
        server, client = [await Host(host_maddrs=LOCAL, idle_timeout=0.4).start() for _ in range(2)]
        answer = asyncio.Event()

        async def slow(stream):
            await stream.read(1)
            await answer.wait()
            await stream.write(b"done")
            await stream.close()

        server.set_stream_handler("/test/slow/1.0.0", slow)
        stream = await client.new_stream(server.get_visible_maddrs()[0], "/test/slow/1.0.0")
        await stream.write(b"?")
        await stream.close()  # the request is sent; the answer is awaited
        await asyncio.sleep(1.6)  # the scenario: the answer takes four idle timeouts
        connection = client.get_connection(server.peer_id)
        assert connection is not None and not connection.is_closed
        answer.set()
        assert await stream.read_until_eof(100) == b"done"
        await asyncio.wait_for(connection.closed.wait(), 5)  # idle once the request is over
        await client.shutdown()
        await server.shutdown()

    run(main())


def test_ping_floods_are_cut_at_the_rate_limit_and_logged_once(caplog):
    async def main():
        server, client = [await Host(host_maddrs=LOCAL, ping_rate=5, ping_burst=10).start() for _ in range(2)]
        stream = await client.new_stream(server.get_visible_maddrs()[0], PING_PROTOCOL)
        echoed = 0
        with pytest.raises((StreamError, asyncio.IncompleteReadError)):
            for _ in range(1000):
                await stream.write(b"x" * PING_SIZE)
                await stream.readexactly(PING_SIZE)
                echoed += 1
        assert 10 <= echoed < 20
        for _ in range(3):  # a second flood on a new stream is cut at once, and not logged again
            flood = await client.new_stream(server.peer_id, PING_PROTOCOL)
            with pytest.raises((StreamError, asyncio.IncompleteReadError)):
                for _ in range(100):
                    await flood.write(b"x" * PING_SIZE)
                    await flood.readexactly(PING_SIZE)
        other = await Host(host_maddrs=()).start()
        assert await other.ping(server.get_visible_maddrs()[0]) < 5  # others ping as before
        for host in (server, client, other):
            await host.shutdown()
        lines = refusals(caplog, "pings faster than ping_rate=5")
        assert len(lines) == 1 and str(client.peer_id) in lines[0]

    run(main())


def test_streams_are_bounded_per_peer_and_per_protocol(caplog):
    async def main():
        server = await Host(host_maddrs=LOCAL, max_inbound_streams_per_peer=4).start()
        client = await Host(host_maddrs=()).start()
        release = asyncio.Event()

        async def hold(stream):
            await stream.read(1)
            await release.wait()
            await stream.write(b"ok")
            await stream.close()

        server.set_stream_handler("/test/two/1.0.0", hold, max_per_peer=2)
        server.set_stream_handler("/test/many/1.0.0", hold)
        addr = server.get_visible_maddrs()[0]

        async def open_on(protocol):  # the proposal travels with the first byte; a refusal shows on reading
            stream = await client.new_stream(addr, protocol, lazy=True)
            await stream.write(b"?")
            return stream

        two = [await open_on("/test/two/1.0.0") for _ in range(3)]
        with pytest.raises(StreamError):
            await two[2].read()  # the third on a protocol that takes two per peer
        many = [await open_on("/test/many/1.0.0") for _ in range(3)]
        with pytest.raises(StreamError):
            await many[2].read()  # two + two: the peer's four streams are taken
        other = await Host(host_maddrs=()).start()
        stream = await other.new_stream(addr, "/test/two/1.0.0")  # another peer is not affected
        await stream.write(b"?")
        release.set()
        for held in two[:2] + many[:2] + [stream]:
            assert await held.read_until_eof(10) == b"ok"
        for host in (server, client, other):
            await host.shutdown()
        assert len(refusals(caplog, "it holds 2 on this protocol already")) == 1
        assert len(refusals(caplog, "(max_inbound_streams_per_peer)")) == 1

    run(main())


def test_handshakes_at_once_are_bounded(caplog):
    async def main():
        server = await Host(host_maddrs=LOCAL, max_pending_connections=2, dial_timeout=20).start()
        port = int(server.get_listen_maddrs()[0].value_for_protocol("tcp"))
        # handshakes that never go on
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        await until(lambda: server._inbound.pending == 2, 5, "two pending handshakes")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            assert await asyncio.wait_for(reader.read(), 5) == b""  # refused at once, not after dial_timeout
        except ConnectionResetError:
            pass
        for _, held_writer in held:
            held_writer.close()
        await until(lambda: server._inbound.pending == 0, 5, "the handshakes given up")
        honest = await Host(host_maddrs=()).start()
        assert await honest.ping(server.get_visible_maddrs()[0]) < 5
        writer.close()
        await honest.shutdown()
        await server.shutdown()
        assert refusals(caplog, "(max_pending_connections)")

    run(main())


def test_a_flood_needs_to_know_whom_it_floods():
    with pytest.raises(ValueError, match="must end in /p2p/<peer id>"):
        ConnectionFlood("/ip4/127.0.0.1/tcp/4001")
