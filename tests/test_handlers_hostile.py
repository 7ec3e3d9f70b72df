"""A hostile client against each server-side handler of the p2p layer: RPC, identify and identify-push,
DCUtR, AutoNAT and the relay. Each handler refuses what is past its bounds with a clear error (and
one log line naming the peer), never dials where a peer tells it to unless the peer was observed
there, and keeps serving honest peers.
"""

import asyncio
import logging

import pytest

from plexus.p2p import rpc
from plexus.p2p.autonat import AutoNAT, AutoNATService
from plexus.p2p.dcutr import HolePuncher
from plexus.p2p.host import Host
from plexus.p2p.identify import MAX_OBSERVED_ADDRS
from plexus.p2p.identity import PrivateKey
from plexus.p2p.multiaddr import Multiaddr
from plexus.p2p.protocols import autonat as autonat_core
from plexus.p2p.protocols import dcutr as dcutr_core
from plexus.p2p.protocols import identify as identify_core
from plexus.p2p.protocols import relay as relay_core
from plexus.p2p.protocols.autonat import ResponseStatus
from plexus.p2p.protocols.varint import encode_uvarint
from plexus.p2p.relay import RelayClient, RelayService, read_message
from plexus.p2p.stream import StreamError, write_delimited

pytestmark = pytest.mark.timeout(30)
LOCAL = ("/ip4/127.0.0.1/tcp/0",)


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 25))


async def until(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.02)  # polling with a deadline, not synchronisation


def logged(caplog, text: str) -> list[str]:
    return [record.getMessage() for record in caplog.records if text in record.getMessage()]


async def shutdown(*things) -> None:
    for thing in things:
        await (thing.stop() if hasattr(thing, "stop") else thing.shutdown())


# --- RPC ----------------------------------------------------------------------------------------------


def test_rpc_bounds_concurrent_requests_per_peer_and_says_so(caplog):
    async def main():
        server = await Host(host_maddrs=LOCAL).start()
        greedy, other = [await Host(host_maddrs=()).start() for _ in range(2)]
        release, entered = asyncio.Event(), []

        async def slow(request, context):
            entered.append(context.remote_peer)
            await release.wait()
            return request

        rpc.add_handler(server, "/test/slow/1.0.0", slow, max_concurrent_per_peer=2)
        addr = server.get_visible_maddrs()[0]
        for host in (greedy, other):
            await host.connect(addr)
        calls = [
            asyncio.ensure_future(rpc.call(greedy, server.peer_id, "/test/slow/1.0.0", b"x", timeout=10))
            for _ in range(2)
        ]
        await until(lambda: len(entered) == 2, what="two requests under way")
        with pytest.raises(rpc.RPCError, match="too many concurrent /test/slow/1.0.0 requests from you"):
            await rpc.call(greedy, server.peer_id, "/test/slow/1.0.0", b"x", timeout=10)
        honest = asyncio.ensure_future(rpc.call(other, server.peer_id, "/test/slow/1.0.0", b"y", timeout=10))
        await until(lambda: len(entered) == 3, what="another peer's request")
        release.set()
        assert await asyncio.gather(*calls, honest) == [b"x", b"x", b"y"]
        assert len(entered) == 3  # the refused request never reached the handler
        await shutdown(server, greedy, other)
        lines = logged(caplog, "(max_concurrent_per_peer)")
        assert len(lines) == 1 and str(greedy.peer_id) in lines[0]

    run(main())


def test_rpc_requests_must_arrive_in_time_and_fit_before_any_work(caplog):
    async def main():
        server = await Host(host_maddrs=LOCAL).start()
        client = await Host(host_maddrs=()).start()
        called = []

        async def unary(request, context):
            called.append(request)
            return b"ok"

        async def streaming(requests, context):
            async for request in requests:
                called.append(request)
                yield request

        rpc.add_handler(server, "/test/unary/1.0.0", unary, request_timeout=0.3, max_message_size=1000)
        rpc.add_handler(
            server,
            "/test/stream/1.0.0",
            streaming,
            stream_input=True,
            stream_output=True,
            request_timeout=0.3,
        )
        addr = server.get_visible_maddrs()[0]

        # A request cut short (the header promises 100 bytes, 10 come), then silence.
        stream = await client.new_stream(addr, "/test/unary/1.0.0")
        await stream.write(bytes([rpc.MESSAGE]) + encode_uvarint(100) + b"x" * 10)
        kind, text = await rpc.read_frame(stream, 1 << 16)
        assert kind == rpc.ERROR and b"no request arrived on /test/unary/1.0.0 within 0.3 s" in text
        # A complete request that never ends (no half-close).
        stream = await client.new_stream(addr, "/test/unary/1.0.0")
        await rpc.write_frame(stream, b"hello")
        kind, text = await rpc.read_frame(stream, 1 << 16)
        assert kind == rpc.ERROR and b"did not end within 0.3 s" in text
        # A streaming call whose first message never comes.
        stream = await client.new_stream(addr, "/test/stream/1.0.0")
        await stream.write(b"")
        kind, text = await rpc.read_frame(stream, 1 << 16)
        assert kind == rpc.ERROR and b"no request arrived on /test/stream/1.0.0" in text
        # Too large: refused from the frame header, at once, whatever follows.
        with pytest.raises(rpc.RPCError, match="a 5000-byte RPC message on /test/unary/1.0.0 exceeds"):
            await rpc.call(client, server.peer_id, "/test/unary/1.0.0", b"x" * 5000, timeout=5)
        assert called == []
        assert await rpc.call(client, server.peer_id, "/test/unary/1.0.0", b"fine", timeout=5) == b"ok"
        await shutdown(server, client)
        assert len(logged(caplog, f"request from {client.peer_id}")) == 2  # once per method, the rest counted

    run(main())


# --- identify and identify-push ----------------------------------------------------------------------


def test_identify_push_garbage_oversize_and_silence_are_refused(caplog):
    async def main():
        server = await Host(host_maddrs=LOCAL, request_timeout=0.3).start()
        client = await Host(host_maddrs=()).start()
        addr = server.get_visible_maddrs()[0]
        await client.identify((await client.connect(addr)).remote_peer, timeout=5)
        before = list(server.peer_info(client.peer_id).protocols)
        for payload in (
            b"\x05\xff\xff\xff\xff\xff",  # a varint-framed message that is not protobuf
            encode_uvarint(identify_core.MAX_IDENTIFY_SIZE + 1),  # too long: refused at once
            b"\x20" + b"\x0a",
        ):  # 32 bytes promised, 1 sent, then silence
            stream = await client.new_stream(addr, identify_core.IDENTIFY_PUSH_PROTOCOL)
            await stream.write(payload)
            with pytest.raises(StreamError):
                await stream.read()
        assert server.peer_info(client.peer_id).protocols == before  # nothing of it was applied
        assert await client.ping(addr) < 5
        await shutdown(server, client)
        assert len(logged(caplog, f"bad identify push from {client.peer_id}")) == 1  # once, for all three

    run(main())


def test_identify_claims_are_bounded_and_no_peer_can_fill_our_observed_addresses():
    async def main():
        server = await Host(host_maddrs=LOCAL).start()
        addr = server.get_visible_maddrs()[0]
        sybils = [await Host(host_maddrs=()).start() for _ in range(2 * MAX_OBSERVED_ADDRS)]
        for i, sybil in enumerate(sybils):
            connection = await sybil.connect(addr)
            stream = await sybil.new_stream(server.peer_id, identify_core.IDENTIFY_PUSH_PROTOCOL)
            await write_delimited(
                stream,
                identify_core.encode_identify(
                    {
                        "listen_addrs": [
                            Multiaddr(f"/ip4/10.1.{j // 250}.{j % 250}/tcp/1").to_bytes() for j in range(500)
                        ],
                        "observed_addr": Multiaddr(
                            f"/ip4/203.0.113.{i}/tcp/4001"
                        ).to_bytes(),  # each claims another
                        "protocols": ["/x"] * 100,
                    }
                ),
            )
            await stream.close()
            await until(lambda: len(server.peer_info(sybil.peer_id).addrs) > 0, what="the push applied")
            assert connection is not None
        observed = server.identify_service.observed_addrs
        assert len(observed) <= MAX_OBSERVED_ADDRS
        assert all(len(server.peer_info(s.peer_id).addrs) <= 16 for s in sybils)
        # An address that two peers saw outranks any number of addresses one peer each claims.
        honest = Multiaddr("/ip4/198.51.100.7/tcp/4001")
        for sybil in sybils[:2]:
            server.identify_service.apply(
                sybil.peer_id, {"observed_addr": honest.to_bytes()}, server.get_connection(sybil.peer_id)
            )
        for i in range(100, 140):
            server.identify_service.apply(
                sybils[-1].peer_id,
                {"observed_addr": Multiaddr(f"/ip4/203.0.113.{i}/tcp/4001").to_bytes()},
                server.get_connection(sybils[-1].peer_id),
            )
        assert honest in server.identify_service.observed_addrs
        await shutdown(server, *sybils)

    run(main())


def test_identify_streams_per_peer_are_bounded(caplog):
    async def main():
        server = await Host(host_maddrs=LOCAL).start()
        client = await Host(host_maddrs=()).start()
        addr = server.get_visible_maddrs()[0]
        held = []
        for _ in range(4):  # pushes that never finish hold the peer's four identify slots
            stream = await client.new_stream(addr, identify_core.IDENTIFY_PUSH_PROTOCOL, lazy=True)
            await stream.write(b"\x10")
            held.append(stream)
        extra = await client.new_stream(addr, identify_core.IDENTIFY_PUSH_PROTOCOL, lazy=True)
        await extra.write(b"\x10")
        with pytest.raises(StreamError):
            await extra.read()
        other = await Host(host_maddrs=()).start()
        info = await other.identify((await other.connect(addr)).remote_peer, timeout=5)
        assert info.peer_id == server.peer_id
        await shutdown(server, client, other)
        assert len(logged(caplog, f"/ipfs/id/push/1.0.0 stream from {client.peer_id}: it holds 4")) == 1

    run(main())


# --- DCUtR and AutoNAT: dial only where the peer was observed ----------------------------------------


class Recorder:
    """Counts the inbound connections a host gets (the third host a hostile peer wants us to dial)."""

    def __init__(self, host: Host):
        self.count = 0
        admit = host._admit

        def counting(transport):
            self.count += 1
            admit(transport)

        host._admit = counting


def test_dcutr_never_dials_a_third_host_or_an_unobserved_ip(caplog):
    async def main():
        relay = await Host(host_maddrs=LOCAL).start()
        service = RelayService(relay).start()
        victim, third = [await Host(host_maddrs=LOCAL, reuse_port=True).start() for _ in range(2)]
        hostile = await Host(host_maddrs=()).start()  # listens nowhere: any address it names is another's
        puncher = HolePuncher(victim, dial_timeout=1).start()
        client = RelayClient(victim).start()  # the victim does not start exchanges itself here
        hostile_client = RelayClient(hostile).start()
        third_addr = third.get_listen_maddrs()[0]
        await third.connect(victim.get_visible_maddrs()[0])  # the victim knows the third host
        recorder = Recorder(third)
        try:
            await client.reserve(relay.get_visible_maddrs()[0])
            circuit = relay.get_visible_maddrs()[0].encapsulate(f"/p2p-circuit/p2p/{victim.peer_id}")
            relayed = await hostile.connect(circuit, timeout=10)
            assert relayed.relayed
            await until(lambda: victim.get_connection(hostile.peer_id) is not None, what="the circuit")
            observed = victim.get_connection(hostile.peer_id).relay_observed_addrs
            assert str(observed[0]).startswith("/ip4/127.0.0.1/tcp/")  # where the relay saw the hostile peer
            evil = [
                third_addr.to_bytes(),
                Multiaddr("/ip4/192.0.2.1/tcp/80").to_bytes(),
                victim.get_listen_maddrs()[0].to_bytes(),
                Multiaddr("/ip4/0.0.0.0/tcp/1").to_bytes(),
            ]
            stream = await hostile.new_stream(victim.peer_id, dcutr_core.PROTOCOL, timeout=5)
            await write_delimited(stream, dcutr_core.encode(dcutr_core.CONNECT, evil))
            kind, _ = dcutr_core.decode(await read_message(stream))
            assert kind == dcutr_core.CONNECT
            await write_delimited(stream, dcutr_core.encode(dcutr_core.SYNC))
            await stream.close()
            outcome = await puncher.wait_outcome(hostile.peer_id, timeout=10)
            assert outcome is not None and not outcome.startswith("direct"), outcome
            # The unilateral upgrade dials the addresses a peer claims in identify: the same rule holds.
            victim.add_addrs(hostile.peer_id, [third_addr, Multiaddr("/ip4/192.0.2.1/tcp/80")])
            assert not (await puncher.upgrade(hostile.peer_id)).startswith("direct")
            assert recorder.count == 0  # the third host never saw a connection
            assert victim.get_connection(hostile.peer_id).relayed
            # Garbage on a relayed exchange ends it, and the victim serves on.
            stream = await hostile.new_stream(victim.peer_id, dcutr_core.PROTOCOL, timeout=5)
            await write_delimited(stream, b"\x08\x07")
            with pytest.raises((StreamError, ConnectionError)):
                await read_message(stream)
            assert await hostile.ping(victim.peer_id, timeout=5) >= 0
        finally:
            await shutdown(puncher, client, hostile_client, service, relay, victim, hostile, third)
        lines = logged(caplog, f"hole punching with {hostile.peer_id}: not dialing")
        assert lines and "it belongs to us or to another peer" in lines[0] and "not on an IP" in lines[0]
        assert "not a unicast address" in lines[0]

    run(main())


def test_autonat_never_dials_a_third_host_or_an_unobserved_ip(caplog):
    async def main():
        server = await Host(host_maddrs=LOCAL).start()
        service = AutoNATService(server, dial_timeout=1, peer_interval=0).start()
        hostile, third = [await Host(host_maddrs=LOCAL).start() for _ in range(2)]
        for host in (hostile, third):
            await host.connect(server.get_visible_maddrs()[0])
        recorder = Recorder(third)
        autonat = AutoNAT(hostile, confidence=1)
        for evil in (
            [third.get_listen_maddrs()[0]],
            [Multiaddr("/ip4/192.0.2.1/tcp/80")],
            [server.get_listen_maddrs()[0]],
            [Multiaddr("/dns4/example.com/tcp/80")],
        ):
            autonat.candidate_addrs = lambda evil=evil: [addr.to_bytes() for addr in evil]
            answer = await autonat.ask(server.peer_id)
            assert answer.status is ResponseStatus.E_DIAL_REFUSED, evil
            assert "no address we may dial you at" in answer.text
        assert recorder.count == 0
        # Two requests at once from one peer: the second stream is refused.
        streams = [
            await hostile.new_stream(server.peer_id, autonat_core.PROTOCOL, lazy=True) for _ in range(2)
        ]
        for stream in streams:
            await stream.write(b"\x01")  # a length prefix, then nothing: the first one holds its slot
        with pytest.raises(StreamError):
            await streams[1].read()
        # Honest requests are still answered.
        autonat = AutoNAT(third, confidence=1)
        assert (await autonat.ask(server.peer_id)).status is ResponseStatus.OK
        await shutdown(service, server, hostile, third)
        lines = logged(caplog, f"AutoNAT: not dialing {hostile.peer_id} back")
        assert len(lines) == 1 and "it belongs to us or to another peer" in lines[0]

    run(main())


# --- the relay ------------------------------------------------------------------------------------------


def test_relay_bounds_hop_streams_per_peer_and_silent_ones(caplog):
    async def main():
        relay = await Host(host_maddrs=LOCAL, request_timeout=0.5).start()
        service = RelayService(relay, relay_core.RelayLimits(max_circuits_per_peer=2)).start()
        hostile, honest = [await Host(host_maddrs=()).start() for _ in range(2)]
        addr = relay.get_visible_maddrs()[0]
        held = []
        for _ in range(4):  # circuits per peer + 2 hop streams, each silent after its proposal
            stream = await hostile.new_stream(addr, relay_core.HOP_PROTOCOL, lazy=True)
            await stream.write(b"\x02")  # a length prefix promising 2 bytes that never come
            held.append(stream)
        extra = await hostile.new_stream(addr, relay_core.HOP_PROTOCOL, lazy=True)
        await extra.write(b"\x02")
        with pytest.raises(StreamError):
            await extra.read()
        client = RelayClient(honest).start()
        assert (await client.reserve(addr, keep=False)).relay == relay.peer_id  # honest peers are served
        for stream in held:  # give the slots back; a stream that then says nothing at all is cut
            stream.reset()
        await until(lambda: relay._inbound_streams[hostile.peer_id] == 0, what="the slots given back")
        silent = await hostile.new_stream(addr, relay_core.HOP_PROTOCOL)
        with pytest.raises(StreamError):
            await silent.read()
        await shutdown(client, service, relay, hostile, honest)
        assert logged(caplog, f"/libp2p/circuit/relay/0.2.0/hop stream from {hostile.peer_id}: it holds 4")

    run(main())


def test_a_stranger_key_cannot_reach_a_handler_before_its_handshake():
    async def main():  # the cheapest hostile client: a TCP socket that sends a multistream header and waits
        server = await Host(host_maddrs=LOCAL, dial_timeout=0.5).start()
        port = int(server.get_listen_maddrs()[0].value_for_protocol("tcp"))
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"\x13/multistream/1.0.0\n")
        data = await asyncio.wait_for(reader.read(1000), 5)  # the host answers its side of the header
        assert data.startswith(b"\x13/multistream/1.0.0\n")
        assert await asyncio.wait_for(reader.read(), 5) == b""  # and closes when the handshake stalls
        writer.close()
        other = await Host(host_maddrs=(), private_key=PrivateKey.generate()).start()
        assert await other.ping(server.get_visible_maddrs()[0]) < 5
        await shutdown(server, other)

    run(main())


@pytest.fixture(autouse=True)
def _warnings(caplog):
    caplog.set_level(logging.WARNING)
