"""The synchronous DHT over real libp2p hosts on 127.0.0.1, and the `plexus dht` command."""

import asyncio
import signal
import subprocess
import sys
import time

import pytest

from plexus.dht.dht import DHT
from plexus.dht.node import DHTBootstrapError
from plexus.utils.timing import get_dht_time

pytestmark = pytest.mark.timeout(60)
LOCAL = ["/ip4/127.0.0.1/tcp/0"]


@pytest.fixture
def swarm():
    first = DHT(start=True, host_maddrs=LOCAL)
    peers = [first] + [
        DHT(initial_peers=first.get_visible_maddrs(), start=True, host_maddrs=LOCAL) for _ in range(11)
    ]
    yield peers
    for peer in peers:
        peer.shutdown()


def test_store_get_latest_and_subkeys_across_real_hosts(swarm):
    now = get_dht_time()
    assert swarm[3].store("model", {"epoch": 1}, now + 60)
    assert swarm[9].get("model").value == {"epoch": 1}
    assert swarm[5].store("model", {"epoch": 2}, now + 120)
    assert swarm[1].get("model", latest=True).value == {"epoch": 2}
    swarm[6].store("model", {"epoch": 0}, now + 30)
    assert swarm[10].get("model", latest=True).value == {"epoch": 2}, "an older record must not win"
    assert swarm[2].store("group", (1, "a"), now + 60, subkey="peer-a")
    assert swarm[8].store("group", (2, "b"), now + 60, subkey="peer-b")
    entries = swarm[0].get("group", latest=True).value
    assert {k: v.value for k, v in entries.items()} == {"peer-a": (1, "a"), "peer-b": (2, "b")}


def test_futures_run_coroutine_and_asyncio_use(swarm):
    future = swarm[4].store("k", "v", get_dht_time() + 60, return_future=True)
    assert future.result(10) is True
    assert swarm[7].get("k", return_future=True).result(10).value == "v"

    async def routing_table_size(dht, node):
        return len(node.routing_table)

    assert swarm[0].run_coroutine(routing_table_size) >= 5

    async def from_asyncio():
        return await asyncio.wrap_future(swarm[2].get("k", return_future=True))

    assert asyncio.run(from_asyncio()).value == "v"


def test_client_mode_peer_dials_out_only(swarm):
    with DHT(initial_peers=swarm[0].get_visible_maddrs(), start=True, client_mode=True) as client:
        assert client.get_visible_maddrs() == [] and client.host.get_listen_maddrs() == []
        assert client.store("from-client", 1, get_dht_time() + 60)
        assert swarm[5].get("from-client").value == 1

        client_id = client.peer_id
        for peer in swarm:
            assert peer.run_coroutine(lambda dht, node: _contains(node, client_id)) is False


async def _contains(node, peer_id) -> bool:
    return any(peer == peer_id for _, peer in node.routing_table)


def test_bootstrap_failure_names_every_address():
    dead = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWQqdDUU8FdikL7oDJNFdKVAhYbZ6hPRY2WKw7XmdXRUeF"
    with pytest.raises(DHTBootstrapError, match="tcp/1: .*connection refused"):
        DHT(initial_peers=[dead], start=True, host_maddrs=LOCAL)


def test_a_peer_that_offers_only_chachapoly_joins_and_bad_cipher_names_fail_at_once():
    with pytest.raises(ValueError, match="noise_ciphers must name"):
        DHT(host_maddrs=LOCAL, noise_ciphers=("AES128",))
    with (
        DHT(start=True, host_maddrs=LOCAL) as first,
        DHT(
            initial_peers=first.get_visible_maddrs(),
            start=True,
            host_maddrs=LOCAL,
            noise_ciphers=("ChaChaPoly",),
        ) as second,
    ):
        assert second.store("key", "value", get_dht_time() + 30)
        assert first.get("key", latest=True).value == "value"
        connection = first.host._connections[second.peer_id][0]
        assert connection.noise_suite.protocol_id == "/noise"


def test_identity_path_keeps_the_peer_id(tmp_path):
    with DHT(start=True, host_maddrs=LOCAL, identity_path=tmp_path / "id.key") as first:
        peer_id = first.peer_id
    with DHT(start=True, host_maddrs=LOCAL, identity_path=tmp_path / "id.key") as again:
        assert again.peer_id == peer_id


def test_plexus_dht_command_prints_initial_peers_and_stops_on_sigterm():
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "plexus.cli.main",
            "dht",
            "--host_maddrs",
            "/ip4/127.0.0.1/tcp/0",
            "--refresh_period",
            "0.2",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = process.stderr.readline()
        assert "To connect other peers to this one, use --initial_peers /ip4/127.0.0.1/tcp/" in line
        address = line.rsplit(" ", 1)[1].strip()
        with DHT(initial_peers=[address], start=True, host_maddrs=LOCAL) as joiner:
            assert joiner.store("hello", "world", get_dht_time() + 60)
        deadline = time.monotonic() + 10
        while "Local storage contains 1 keys" not in process.stderr.readline():
            assert time.monotonic() < deadline, "the status line never showed the stored key"
        process.send_signal(signal.SIGTERM)
        assert process.wait(10) == 0
    finally:
        process.kill()
        process.wait()


def test_peers_found_through_the_dht_can_be_dialed_by_id_alone():
    first = DHT(start=True, host_maddrs=LOCAL)
    chain = [first]
    for _ in range(6):  # each peer only knows the previous one at first
        chain.append(DHT(initial_peers=chain[-1].get_visible_maddrs(), start=True, host_maddrs=LOCAL))
    try:
        last, target = chain[-1], chain[1]

        async def ping_by_id(dht, node):
            await dht.host.disconnect(target.peer_id)
            dht.host._peers.pop(target.peer_id, None)  # forget its address: only the DHT can tell
            return await dht.host.ping(target.peer_id, timeout=10)

        assert last.run_coroutine(ping_by_id) < 5
    finally:
        for peer in chain:
            peer.shutdown()
