"""AutoNAT v1: the verdict core, and dial-backs between hosts on 127.0.0.1 (public, unreachable,
refused and malformed requests)."""

import asyncio
import socket

import pytest

from plexus.p2p.autonat import AutoNAT, AutoNATService
from plexus.p2p.host import Host
from plexus.p2p.identity import PrivateKey
from plexus.p2p.multiaddr import Multiaddr
from plexus.p2p.protocols import autonat as core
from plexus.p2p.protocols.autonat import Reachability, ReachabilityTracker, ResponseStatus
from plexus.p2p.protocols.errors import RemoteProtocolError
from plexus.p2p.relay import read_message
from plexus.p2p.stream import write_delimited

LOCAL = ("/ip4/127.0.0.1/tcp/0",)


def test_tracker_and_mode():
    tracker = ReachabilityTracker(confidence=2)
    assert tracker.record(True) is Reachability.UNKNOWN
    assert tracker.record(True) is Reachability.PUBLIC
    assert tracker.record(False) is Reachability.PUBLIC
    assert tracker.record(False) is Reachability.UNKNOWN  # 2 against 2
    assert tracker.record(False) is Reachability.PRIVATE
    assert core.choose_mode(Reachability.PRIVATE, relays_available=True) == "relay"
    assert core.choose_mode(Reachability.PRIVATE, relays_available=False) == "client"
    assert core.choose_mode(Reachability.PUBLIC, relays_available=True) == "direct"


def test_codec_roundtrip_and_address_filter():
    peer = PrivateKey.generate().peer_id
    addrs = [Multiaddr("/ip4/1.2.3.4/tcp/5").to_bytes(), Multiaddr("/ip4/6.6.6.6/tcp/5").to_bytes(), b"\xff"]
    request = core.decode_request(core.encode_request(peer, addrs))
    assert request.peer == peer and request.addrs == tuple(addrs)
    response = core.DialResponse(ResponseStatus.E_DIAL_ERROR, "nope", addrs[0])
    assert core.decode_response(core.encode_response(response)) == response
    for garbage in (b"", b"\x08\x01", b"\x08\x00\x12\x00", b"\xff\xff", b"\x08\x00" + b"\x00" * 5000):
        with pytest.raises(RemoteProtocolError):
            core.decode_request(garbage)


def closed_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


@pytest.mark.timeout(30)
def test_dial_backs_decide_public_private_and_refusals():
    async def main():
        server = await Host(host_maddrs=LOCAL).start()
        service = AutoNATService(server, dial_timeout=2, peer_interval=0).start()
        public = await Host(host_maddrs=LOCAL).start()
        private = await Host(host_maddrs=()).start()
        try:
            for host in (public, private):
                await host.connect(server.get_visible_maddrs()[0], timeout=5)

            autonat = AutoNAT(public, confidence=1)
            assert await autonat.probe() is Reachability.PUBLIC
            answer = autonat.answers[server.peer_id]
            assert Multiaddr.from_bytes(answer.addr) in [
                a.without_peer_id() for a in public.get_visible_maddrs()
            ]
            assert autonat.mode(relays_available=True) == "direct"

            autonat = AutoNAT(private, confidence=1)
            autonat.candidate_addrs = lambda: [Multiaddr(f"/ip4/127.0.0.1/tcp/{closed_port()}").to_bytes()]
            assert await autonat.probe() is Reachability.PRIVATE
            assert autonat.answers[server.peer_id].status is ResponseStatus.E_DIAL_ERROR
            assert autonat.mode(relays_available=True) == "relay"

            # Addresses on an IP other than the one the server sees us at are never dialed.
            autonat = AutoNAT(private, confidence=1)
            autonat.candidate_addrs = lambda: [Multiaddr("/ip4/192.0.2.1/tcp/80").to_bytes()]
            assert (await autonat.ask(server.peer_id)).status is ResponseStatus.E_DIAL_REFUSED
            assert autonat.reachability is Reachability.UNKNOWN

            # Malformed requests and requests on behalf of another peer get E_BAD_REQUEST.
            for payload in (b"\x08\x07", core.encode_request(server.peer_id, [])):
                stream = await private.new_stream(server.peer_id, core.PROTOCOL, timeout=5)
                await write_delimited(stream, payload)
                assert core.decode_response(await read_message(stream)).status is ResponseStatus.E_BAD_REQUEST

            # A peer that asks too often is refused.
            service.peer_interval = 60
            service._last_request.clear()
            autonat = AutoNAT(public, confidence=1)
            assert (await autonat.ask(server.peer_id)).status is ResponseStatus.OK
            assert (await autonat.ask(server.peer_id)).status is ResponseStatus.E_DIAL_REFUSED
        finally:
            await service.stop()
            for host in (server, public, private):
                await host.shutdown()

    asyncio.run(main())
