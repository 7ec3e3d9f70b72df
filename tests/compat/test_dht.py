"""hivemind's DHT API: awaitable futures, DHTNode over its own host, DHT(p2p=..., no_listen=...),
and a failed bootstrap that hivemind code catches as P2PDaemonError."""

import asyncio
import concurrent.futures
import logging

import pytest
from hivemind import DHT
from hivemind.dht import DHTNode
from hivemind.p2p import P2P, P2PDaemonError
from hivemind.utils import get_dht_time

pytestmark = pytest.mark.timeout(60)

UNREACHABLE = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWPAwbPmHzkzFX9rsS3G9TtGnnAY37tvcr3jdtvJJMRCea"


def test_return_future_results_can_be_awaited_from_asyncio(dht_pair):
    first, second = dht_pair
    assert first.store("key", "value", get_dht_time() + 30)

    async def main():
        found = await second.get("key", latest=True, return_future=True)
        stored = await second.store("other", 1, get_dht_time() + 30, return_future=True)
        pending = second.get("absent", return_future=True)
        assert isinstance(pending, concurrent.futures.Future)
        return found, stored, await pending

    found, stored, absent = asyncio.run(main())
    assert found.value == "value" and stored and absent is None


def test_futures_are_awaitable_inside_the_dhts_own_coroutines(dht_pair):
    first, _ = dht_pair
    first.store("key", 7, get_dht_time() + 30)

    async def inner(dht, node):  # hivemind's averagers await return_future=True calls like this
        return (await dht.get("key", return_future=True)).value

    assert first.run_coroutine(inner) == 7


def test_dhtnode_creates_its_own_host_and_joins_by_multiaddr():
    async def main():
        alice = await DHTNode.create()
        bob = await DHTNode.create(initial_peers=await alice.get_visible_maddrs(), cache_locally=False)
        assert await bob.store("shared", [1, 2], get_dht_time() + 30)
        assert (await alice.get("shared")).value == [1, 2]
        await asyncio.gather(alice.shutdown(), bob.shutdown())
        with pytest.raises(P2PDaemonError, match="(?i)failed to connect to bootstrap peers"):
            await DHTNode.create(initial_peers=[UNREACHABLE])

    asyncio.run(main())


def test_dht_runs_on_a_given_p2p_and_leaves_it_running():
    async def make_p2p():
        return await P2P.create(announce_maddrs=["/ip4/123.45.67.89/tcp/31337"])

    p2p = asyncio.run(make_p2p())
    dht = DHT(start=True, p2p=p2p)
    assert dht.peer_id == p2p.peer_id
    visible = [str(addr) for addr in dht.get_visible_maddrs()]
    assert visible == [f"/ip4/123.45.67.89/tcp/31337/p2p/{p2p.peer_id}"]
    dht.shutdown()
    assert p2p.host.get_listen_maddrs(), "the DHT closed a host it did not own"
    asyncio.run(p2p.shutdown())


def test_no_listen_peer_joins_without_accepting_connections(dht_pair, caplog):
    first, _ = dht_pair
    with caplog.at_level(logging.WARNING):
        quiet = DHT(
            start=True, initial_peers=first.get_visible_maddrs(), no_listen=True, client_mode=True, tls=True
        )  # a hivemind daemon option without meaning here: accepted, with a warning
    try:
        assert not quiet.host.get_listen_maddrs()
        assert quiet.store("from_a_client", 1, get_dht_time() + 30) and first.get("from_a_client").value == 1
        assert "tls" in caplog.text and "no effect" in caplog.text
    finally:
        quiet.shutdown()


def test_failed_bootstrap_is_what_hivemind_users_catch():
    with pytest.raises(P2PDaemonError, match=r"(?i)Failed to connect to bootstrap peers") as caught:
        DHT(initial_peers=[UNREACHABLE], start=True)
    assert "tcp/1" in str(caught.value), "the error names the address that failed"
