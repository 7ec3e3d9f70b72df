"""DCUtR: the exchange core on virtual time, malformed messages, and an upgrade between hosts on 127.0.0.1
(no NAT here: the inbound side reaches the other directly, the spec's unilateral upgrade; when neither
listens the exchange runs and fails cleanly. tests/test_nat.py punches through real NATs)."""

import asyncio

import pytest

from plexus.p2p.dcutr import HolePuncher
from plexus.p2p.host import Host
from plexus.p2p.protocols import dcutr as core
from plexus.p2p.protocols.errors import RemoteProtocolError
from plexus.p2p.relay import RelayClient, RelayService, read_message
from plexus.p2p.stream import write_delimited

ADDR_A, ADDR_B = b"\x04\x0a\x00\x00\x01\x06\x00\x01", b"\x04\x0a\x00\x00\x02\x06\x00\x02"


def test_exchange_on_virtual_time():
    initiator, responder = core.HolePunch(True, [ADDR_B]), core.HolePunch(False, [ADDR_A])
    initiator.start(now=10.0)
    (connect,) = initiator.data_to_send()
    assert core.decode(connect) == (core.CONNECT, (ADDR_B,))
    assert responder.receive(connect, now=10.05) is None
    (answer,) = responder.data_to_send()
    dial_b = initiator.receive(answer, now=10.2)  # rtt 0.2 s: B dials at 10.3
    assert (
        dial_b.when == pytest.approx(10.3)
        and dial_b.addrs == (ADDR_A,)
        and initiator.rtt == pytest.approx(0.2)
    )
    (sync,) = initiator.data_to_send()
    assert responder.receive(sync, now=10.3) == core.DialAt(10.3, (ADDR_B,))  # A dials on SYNC
    # Two retries are allowed, then the initiator gives up.
    for attempt in (2, 3):
        assert initiator.retry()
        initiator.start(now=20.0 + attempt)
        assert responder.receive(initiator.data_to_send()[0], now=20.0 + attempt) is None
        assert initiator.receive(responder.data_to_send()[0], now=20.1 + attempt) is not None
        assert responder.receive(initiator.data_to_send()[0], now=20.2 + attempt) is not None
    assert not initiator.retry()


@pytest.mark.parametrize("data", [b"", b"\x08\x05", b"\x08\xac\x02" * 2000, b"\x12\x02\x00", b"\xff"])
def test_malformed_messages_are_remote_errors(data):
    with pytest.raises(RemoteProtocolError):
        core.HolePunch(False, []).receive(data, now=0.0)


def test_out_of_order_messages_end_the_exchange():
    responder = core.HolePunch(False, [ADDR_A])
    with pytest.raises(RemoteProtocolError, match="unexpected"):
        responder.receive(core.encode(core.SYNC), now=0.0)
    with pytest.raises(RemoteProtocolError):
        responder.receive(core.encode(core.CONNECT, [ADDR_B]), now=0.0)  # ERROR is terminal


@pytest.mark.timeout(30)
def test_relayed_connection_is_upgraded_to_a_direct_one():
    async def main():
        hosts = [await Host(host_maddrs=("/ip4/127.0.0.1/tcp/0",), reuse_port=True).start() for _ in range(3)]
        relay, a, b = hosts
        service = RelayService(relay).start()
        punchers = [HolePuncher(host).start() for host in (a, b)]
        clients = [
            RelayClient(host, on_inbound_circuit=puncher.on_inbound_circuit).start()
            for host, puncher in zip((a, b), punchers)
        ]
        try:
            await clients[1].reserve(relay.get_visible_maddrs()[0])
            circuit = relay.get_visible_maddrs()[0].encapsulate(f"/p2p-circuit/p2p/{b.peer_id}")
            relayed = await a.connect(circuit, timeout=10)
            assert relayed.relayed
            outcome = await punchers[1].wait_outcome(a.peer_id, timeout=20)  # B, the inbound side, starts
            assert outcome == "direct (dialed its public address)", outcome
            for host, other in ((a, b), (b, a)):
                assert not getattr(host.get_connection(other.peer_id), "relayed", False)
            assert await a.ping(b.peer_id, timeout=10) >= 0
            # An exchange over the direct connection (nothing to punch) is refused without harming the host.
            stream = await a.new_stream(b.peer_id, core.PROTOCOL, timeout=10)
            with pytest.raises(ConnectionError):
                await write_delimited(stream, b"\x08\x07")
                await read_message(stream)
            assert await a.ping(b.peer_id, timeout=10) >= 0
        finally:
            for thing in clients + punchers + [service]:
                await thing.stop()
            for host in hosts:
                await host.shutdown()

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_failed_exchange_leaves_the_relayed_connection_working():
    async def main():
        relay = await Host(host_maddrs=("/ip4/127.0.0.1/tcp/0",)).start()
        a, b = [await Host(host_maddrs=()).start() for _ in range(2)]  # nobody to dial directly
        service = RelayService(relay).start()
        punchers = [HolePuncher(host, dial_timeout=0.5).start() for host in (a, b)]
        clients = [
            RelayClient(host, on_inbound_circuit=puncher.on_inbound_circuit).start()
            for host, puncher in zip((a, b), punchers)
        ]
        try:
            await clients[1].reserve(relay.get_visible_maddrs()[0])
            await a.connect(
                relay.get_visible_maddrs()[0].encapsulate(f"/p2p-circuit/p2p/{b.peer_id}"), timeout=10
            )
            outcome = await punchers[1].wait_outcome(a.peer_id, timeout=20)
            assert outcome is not None and outcome.startswith("failed"), outcome
            assert b.get_connection(a.peer_id).relayed
            assert await b.ping(a.peer_id, timeout=10) >= 0
        finally:
            for thing in clients + punchers + [service]:
                await thing.stop()
            for host in (relay, a, b):
                await host.shutdown()

    asyncio.run(main())
