"""The DHT's NAT options on 127.0.0.1: what each attaches, the AutoNAT verdict and the choice it drives,
relays found through initial peers and through the DHT, and a relayed connection through them.
(tests/test_nat.py runs the same options through real NATs in network namespaces.)"""

import logging
import signal
import subprocess
import sys

import pytest

from plexus.dht.dht import DHT, RELAY_KEY
from plexus.p2p.protocols import autonat as autonat_core
from plexus.p2p.protocols.relay import HOP_PROTOCOL

LOCAL = ["/ip4/127.0.0.1/tcp/0"]


@pytest.mark.timeout(30)
def test_defaults_attach_everything_and_never_probe_or_warn_on_localhost(caplog):
    with caplog.at_level(logging.INFO, logger="plexus"):
        first = DHT(start=True, host_maddrs=LOCAL)
        second = DHT(initial_peers=first.get_visible_maddrs(), start=True, host_maddrs=LOCAL)
    try:
        for dht in (first, second):
            assert dht.relay_client is not None and dht.hole_puncher is not None
            assert dht.relay_service is not None and dht.autonat_service is not None
            assert dht.host.options.reuse_port
            assert dht.autonat is None and dht.reachability == "unknown" and dht.nat_mode == "direct"
            assert not dht.client_mode
        protocols = second.run_coroutine(lambda dht, node: _protocols_of(dht, first.peer_id))
        assert HOP_PROTOCOL in protocols and autonat_core.PROTOCOL in protocols
        assert not [record for record in caplog.records if record.levelno >= logging.WARNING], caplog.text
    finally:
        second.shutdown()
        first.shutdown()


async def _protocols_of(dht, peer):
    return (await dht.host.identify(peer, timeout=5)).protocols


@pytest.mark.timeout(30)
def test_switches_turn_components_off_and_bad_values_are_refused():
    with pytest.raises(ValueError, match="force_reachability"):
        DHT(force_reachability="maybe")
    with DHT(start=True, host_maddrs=LOCAL, use_relay=False, auto_nat=False, relay_service=False) as dht:
        assert dht.relay_client is None and dht.hole_puncher is None
        assert dht.autonat_service is None and dht.relay_service is None
        assert dht.host.circuit_dialer is None and not dht.host.options.reuse_port


@pytest.mark.timeout(30)
def test_auto_mode_asks_initial_peers_and_stays_direct_when_they_can_dial_back(caplog):
    with caplog.at_level(logging.INFO, logger="plexus"):
        first = DHT(start=True, host_maddrs=LOCAL)
        auto = DHT(initial_peers=first.get_visible_maddrs(), start=True, host_maddrs=LOCAL, client_mode=None)
    try:
        assert auto.reachability == "public" and auto.nat_mode == "direct" and auto.client_mode is False
        assert auto.autonat.answers[first.peer_id].status is autonat_core.ResponseStatus.OK
        assert auto.get_visible_maddrs()
        assert not [record for record in caplog.records if record.levelno >= logging.WARNING], caplog.text
    finally:
        auto.shutdown()
        first.shutdown()


@pytest.mark.timeout(60)
def test_private_peer_reserves_on_an_initial_peer_or_on_a_relay_announced_in_the_dht():
    # A verified public peer announces its relay service; the bootstrap peer relays for nobody.
    relay = DHT(start=True, host_maddrs=LOCAL, force_reachability="public")
    bootstrap = DHT(
        initial_peers=relay.get_visible_maddrs(), start=True, host_maddrs=LOCAL, relay_service=False
    )
    peers = [relay, bootstrap]
    try:
        assert relay.get(RELAY_KEY, latest=True) is not None
        # Through the DHT: its only initial peer does not relay.
        private = DHT(
            initial_peers=bootstrap.get_visible_maddrs(),
            start=True,
            host_maddrs=LOCAL,
            force_reachability="private",
            use_auto_relay=True,
        )
        peers.append(private)
        assert private.nat_mode == "relay" and list(private.relay_client.reservations) == [relay.peer_id]
        circuits = [addr for addr in private.get_visible_maddrs() if addr.is_circuit]
        assert circuits and all(str(relay.peer_id) in str(addr) for addr in circuits), circuits
        assert private.relay_service is None, "a private peer relays for nobody"
        # Through an initial peer that relays (explicit `relays` work the same way), in auto mode.
        auto = DHT(
            initial_peers=relay.get_visible_maddrs(),
            start=True,
            host_maddrs=LOCAL,
            client_mode=None,
            force_reachability="private",
            use_auto_relay=True,
            hole_punching=False,
        )
        peers.append(auto)
        assert auto.nat_mode == "relay" and not auto.client_mode
        # Another peer reaches the private one through its relay address (the relay client dialed by
        # hand: on 127.0.0.1 the two are already connected directly).
        circuit = circuits[0]
        connection = auto.run_coroutine(lambda dht, node: dht.relay_client.dial(private.peer_id, circuit))
        assert connection.relayed and connection.remote_peer == private.peer_id
        assert relay.relay_service.circuits_served == 1
    finally:
        for dht in reversed(peers):
            dht.shutdown()


@pytest.mark.timeout(30)
def test_private_peer_without_any_relay_says_what_to_do(caplog):
    first = DHT(start=True, host_maddrs=LOCAL, relay_service=False)
    try:
        with caplog.at_level(logging.WARNING, logger="plexus"):
            lonely = DHT(
                initial_peers=first.get_visible_maddrs(),
                start=True,
                host_maddrs=LOCAL,
                force_reachability="private",
                use_auto_relay=True,
            )
        try:
            assert lonely.nat_mode == "direct" and not lonely.client_mode
            assert "no relay gave it a slot" in caplog.text and "client_mode=True" in caplog.text
        finally:
            lonely.shutdown()
    finally:
        first.shutdown()


@pytest.mark.timeout(60)
def test_plexus_dht_flags_reserve_on_the_given_relay_and_say_so():
    relay = DHT(start=True, host_maddrs=LOCAL)
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "plexus.cli.main",
            "dht",
            "--host_maddrs",
            LOCAL[0],
            "--initial_peers",
            str(relay.get_visible_maddrs()[0]),
            "--use_auto_relay",
            "--force_reachability",
            "private",
            "--relays",
            str(relay.get_visible_maddrs()[0]),
            "--refresh_period",
            "30",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = [process.stderr.readline() for _ in range(3)]
        assert "/p2p-circuit/p2p/" in lines[0], lines  # its relayed address is among those to share
        assert "/p2p-circuit/p2p/" in lines[1], lines  # and in the full list, as hivemind prints it
        assert "reachability: private; relay mode" in lines[2], lines
        process.send_signal(signal.SIGTERM)
        assert process.wait(10) == 0
    finally:
        process.kill()
        process.wait()
        relay.shutdown()


@pytest.mark.timeout(30)
def test_auto_relay_without_a_relay_client_falls_back_to_client_mode():
    # use_auto_relay needs use_relay's client; without one the choice of mode must still be made
    # (it used to fail reading the reservations of a relay client that did not exist).
    first = DHT(start=True, host_maddrs=LOCAL)
    try:
        lonely = DHT(
            initial_peers=first.get_visible_maddrs(),
            start=True,
            host_maddrs=LOCAL,
            client_mode=None,
            force_reachability="private",
            use_relay=False,
            use_auto_relay=True,
        )
        try:
            assert lonely.relay_client is None
            assert lonely.client_mode and lonely.nat_mode == "client"
        finally:
            lonely.shutdown()
    finally:
        first.shutdown()
