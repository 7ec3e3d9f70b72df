"""DHTNode swarms on the in-memory network: store/get/latest/subkeys/expiry, validators, failures."""

import asyncio
import logging
import random

import pytest

from plexus.dht.crypto import Ed25519SignatureValidator
from plexus.dht.messages import DHTRPCError, ErrorResponse, Message, PingRequest, PingResponse, StoreItem
from plexus.dht.node import DHTBootstrapError, DHTNode
from plexus.dht.protocol import make_record
from plexus.dht.routing import DHTID
from plexus.testing import MemoryNetwork
from plexus.utils.serializer import MSGPackSerializer
from plexus.utils.timing import ManualClock, get_dht_time, use_clock

pytestmark = pytest.mark.timeout(60)


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, timeout=50))


async def make_swarm(network: MemoryNetwork, size: int, seed: int = 0, **kwargs) -> list[DHTNode]:
    rng = random.Random(seed)
    nodes = [await DHTNode.create(rpc=network.create_transport(), **kwargs)]
    for _ in range(size - 1):
        initial = [node.peer_id for node in rng.sample(nodes, min(3, len(nodes)))]
        nodes.append(await DHTNode.create(rpc=network.create_transport(), initial_peers=initial, **kwargs))
    return nodes


async def shutdown(nodes):
    await asyncio.gather(*(node.shutdown() for node in nodes))


def test_swarm_store_get_latest_subkeys():
    async def main():
        network = MemoryNetwork()
        nodes = await make_swarm(network, 24)
        rng = random.Random(1)
        now = get_dht_time()
        for i in range(10):
            writer, reader = rng.sample(nodes, 2)
            assert await writer.store(f"key{i}", {"i": i, "pair": (i, "x")}, now + 60)
            found = await reader.get(f"key{i}")
            assert found.value == {"i": i, "pair": (i, "x")} and found.expiration_time == now + 60
        assert await nodes[0].get("missing") is None

        # a later expiration wins; an earlier one is refused everywhere
        assert await nodes[1].store("shared", "old", now + 30)
        assert await nodes[2].store("shared", "new", now + 40)
        assert not await nodes[3].store("shared", "stale", now + 35)
        assert (await nodes[4].get("shared", latest=True)).value == "new"

        # dictionary values: entries stored by different peers merge on get
        for i, node in enumerate(nodes[:6]):
            assert await node.store("group", f"member{i}", now + 30 + i, subkey=f"peer{i}")
        group = await nodes[10].get("group", latest=True)
        assert {k: v.value for k, v in group.value.items()} == {f"peer{i}": f"member{i}" for i in range(6)}
        assert group.expiration_time == now + 35 and group.value["peer2"].expiration_time == now + 32
        # deleting is storing a newer record
        assert await nodes[7].store("group", None, now + 50, subkey="peer0")
        assert (await nodes[11].get("group", latest=True)).value["peer0"].value is None

        result = await nodes[5].store_many(["a", "b", "c"], [1, 2, 3], now + 20, subkeys=[None, "s", None])
        assert result == {"a": True, ("b", "s"): True, "c": True}
        found = await nodes[8].get_many(["a", "b", "c", "zzz"])
        assert found["a"].value == 1 and found["b"].value["s"].value == 2 and found["zzz"] is None
        await shutdown(nodes)

    run(main())


def test_latest_finds_the_newest_copy():
    async def main():
        network = MemoryNetwork()
        nodes = await make_swarm(network, 20, cache_locally=False)
        now = get_dht_time()
        assert await nodes[0].store("k", "v1", now + 10)
        # put a newer copy on one far peer only, behind the others' backs
        key_id = DHTID.generate("k")
        far = max(nodes, key=lambda node: node.node_id ^ key_id)
        far.storage.store(key_id, b"\xa2v2", now + 20, now)
        assert (await nodes[1].get("k")).value in ("v1", "v2")
        # latest=True walks the whole beam; the far node is outside it unless the swarm is small
        assert (await nodes[1].get("k", latest=True)).value in ("v1", "v2")
        # a copy on one of the nearest peers is always seen by latest=True
        nearest = min((n for n in nodes if n is not nodes[1]), key=lambda node: node.node_id ^ key_id)
        nearest.storage.store(key_id, b"\xa2v3", now + 30, now)
        assert (await nodes[1].get("k", latest=True)).value == "v3"
        await shutdown(nodes)

    run(main())


def test_expired_records_vanish():
    async def main():
        clock = ManualClock()
        with use_clock(clock):
            network = MemoryNetwork()
            nodes = await make_swarm(network, 20)
            assert await nodes[0].store("short", "value", get_dht_time() + 5)
            assert await nodes[0].store("dict", 1, get_dht_time() + 5, subkey="a")
            assert await nodes[0].store("dict", 2, get_dht_time() + 15, subkey="b")
            assert (await nodes[3].get("short")).value == "value"
            assert not await nodes[1].store("past", "value", get_dht_time() - 1)
            clock.advance(10)
            assert await nodes[4].get("short") is None and await nodes[3].get("short", latest=True) is None
            assert set((await nodes[5].get("dict", latest=True)).value) == {"b"}
            clock.advance(10)
            assert await nodes[5].get("dict", latest=True) is None
            await shutdown(nodes)

    run(main())


def test_signed_records_cannot_be_overwritten_by_others():
    async def main():
        network = MemoryNetwork()
        validators = [Ed25519SignatureValidator() for _ in range(20)]
        nodes = [await DHTNode.create(rpc=network.create_transport(), record_validator=validators[0])]
        for i in range(1, 20):
            nodes.append(
                await DHTNode.create(
                    rpc=network.create_transport(),
                    initial_peers=[nodes[0].peer_id],
                    record_validator=validators[i],
                )
            )
        alice, mallory = validators[1], validators[2]
        now = get_dht_time()
        assert await nodes[1].store("progress", {"step": 1}, now + 30, subkey=alice.local_public_key)
        assert await nodes[2].store("progress", {"step": 7}, now + 30, subkey=mallory.local_public_key)
        # mallory writes under alice's subkey: her node signs nothing (not her key) and peers refuse it
        assert not await nodes[2].store("progress", {"step": 999}, now + 40, subkey=alice.local_public_key)
        progress = (await nodes[5].get("progress", latest=True)).value
        assert progress[alice.local_public_key].value == {"step": 1}
        assert progress[mallory.local_public_key].value == {"step": 7}
        # even a hand-crafted request that skips her validator is refused by every peer
        key_id, subkey = DHTID.generate("progress"), MSGPackSerializer.dumps(alice.local_public_key)
        value = MSGPackSerializer.dumps({"step": 999})
        value += mallory.sign_value(make_record(key_id, mallory.local_public_key, value, now + 40))[
            len(value) :
        ]
        item = StoreItem(key_id, subkey, value, now + 40)
        for node in nodes[3:]:
            assert await nodes[2]._send_items(node.peer_id, [item]) == [False]
        assert (await nodes[6].get("progress", latest=True)).value[alice.local_public_key].value == {
            "step": 1
        }
        await shutdown(nodes)

    run(main())


def test_malformed_requests_get_an_error_and_the_node_keeps_serving():
    async def main():
        network = MemoryNetwork()
        nodes = await make_swarm(network, 3)
        attacker = network.create_transport()
        for garbage in (
            b"",
            b"\xc1",
            b"\x93\x05\xc0\x90" + b"\x00",
            PingResponse(None, 1.0).encode(),
            b"\x92\x03" * 100,
        ):
            answer = Message.decode(await attacker.call(nodes[0].peer_id, garbage, timeout=1))
            assert isinstance(answer, ErrorResponse) and "DHT" in answer.message
        answer = Message.decode(await attacker.call(nodes[0].peer_id, PingRequest(None).encode(), timeout=1))
        assert answer.node_id == nodes[0].node_id
        assert await nodes[1].store("still", "works", get_dht_time() + 10)
        assert (await nodes[2].get("still")).value == "works"
        await shutdown(nodes)

    run(main())


@pytest.mark.timeout(120)
def test_64_node_swarm_with_10_percent_dead_still_answers():
    async def main():
        network = MemoryNetwork()
        nodes = await make_swarm(network, 64, wait_timeout=1)
        now = get_dht_time()
        keys = [f"key{i}" for i in range(40)]
        for i, key in enumerate(keys):
            assert await nodes[i % len(nodes)].store(key, i, now + 60)
        rng = random.Random(5)
        dead = rng.sample(nodes[1:], 6)
        for node in dead:
            network.kill(node.peer_id)
        alive = [node for node in nodes if node not in dead]
        found = 0
        for i, key in enumerate(keys):
            result = await rng.choice(alive).get(key, latest=True)
            found += result is not None and result.value == i
        assert found == len(keys)
        await shutdown(nodes)

    run(main())


def test_silent_peers_time_out_and_are_skipped():
    async def main():
        network = MemoryNetwork()
        nodes = await make_swarm(network, 20, wait_timeout=0.2)
        assert await nodes[0].store("k", "v", get_dht_time() + 60)
        silent = [node for node in nodes[2:] if node.storage.get(DHTID.generate("k"), get_dht_time())][:2]
        for node in silent:
            network.make_unresponsive(node.peer_id)
        assert (await nodes[1].get("k", latest=True)).value == "v"
        # their requests time out in the background (the lookup stopped waiting for them): each is
        # then banned and out of the table, not asked again for a while
        assert await wait_until(
            lambda: all(
                nodes[1].blacklist.is_banned(node.peer_id, get_dht_time())
                or node.peer_id not in nodes[1].routing_table
                for node in silent
            ),
            timeout=5,
        )
        await shutdown(nodes)

    run(main())


async def wait_until(predicate, timeout: float) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.01)  # polling with a deadline for background work
    return True


def test_lookups_stop_waiting_for_silent_peers_long_before_the_request_timeout():
    """Silent peers among the nearest no longer cost every lookup the whole `wait_timeout`: a
    request outstanding past the learned straggler limit stops holding the lookup up."""

    async def main():
        network = MemoryNetwork(latency=0.002)
        nodes = await make_swarm(network, 30, wait_timeout=600.0)
        key_id = DHTID.generate("k")
        assert await nodes[0].store("k", "v", get_dht_time() + 60)
        holders = {node.peer_id for node in nodes if node.storage.get(key_id, get_dht_time())}
        nearest = sorted(nodes[2:], key=lambda node: node.node_id ^ key_id)
        silent = [node for node in nearest if node.peer_id in holders][:2] + nearest[:3]
        for node in silent:
            network.make_unresponsive(node.peer_id)
        reader = nodes[1]
        assert reader.latency.straggler_timeout() < 1.0  # learnt from the answers so far
        # A beam of 10: a beam that cannot fill keeps waiting for its stragglers, by design (they may be
        # all it has left), and in ~3% of these random 30-node swarms the reader learns of only ~19 live
        # peers, short of the default 20.
        # The silent peers' full timeout is 600 s: a lookup that waited for it would not end in time.
        async with asyncio.timeout(60):
            assert (await reader.get("k", latest=True, beam_size=10)).value == "v"
        await shutdown(nodes)

    run(main())


def test_client_mode_nodes_never_enter_routing_tables():
    async def main():
        network = MemoryNetwork()
        nodes = await make_swarm(network, 10)
        client = await DHTNode.create(
            rpc=network.create_transport(), initial_peers=[nodes[0].peer_id], client_mode=True
        )
        now = get_dht_time()
        assert await client.store("from-client", 42, now + 30)
        assert (await nodes[5].get("from-client")).value == 42
        assert (await client.get("from-client", latest=True)).value == 42
        assert len(client.routing_table) > 0
        for node in nodes:
            assert client.peer_id not in node.routing_table
        assert not network.is_alive(client.peer_id)  # it never served
        await shutdown(nodes + [client])

    run(main())


def test_blacklist_backoff_doubles():
    async def main():
        clock = ManualClock()
        with use_clock(clock):
            network = MemoryNetwork()
            nodes = await make_swarm(network, 4, blacklist_time=5.0, backoff_rate=2.0)
            victim = nodes[3]
            network.kill(victim.peer_id)
            caller = nodes[0]
            bans = []
            for _ in range(3):
                with pytest.raises(ConnectionError):
                    await caller.call_ping(victim.peer_id)
                bans.append(caller.blacklist.banned_until(victim.peer_id) - get_dht_time())
                assert await caller._call(victim.peer_id, PingRequest(None), PingResponse) is None  # skipped
                assert victim.peer_id not in caller.routing_table
                clock.advance(bans[-1] + 0.1)
            assert bans == [5.0, 10.0, 20.0]
            caller.blacklist.register_success(victim.peer_id)
            assert not caller.blacklist.is_banned(victim.peer_id, get_dht_time())
            await shutdown(nodes)

    run(main())


def test_bootstrap_failure_names_each_peer_and_why():
    async def main():
        network = MemoryNetwork()
        dead, silent = network.create_transport(), network.create_transport()
        silent.serve(lambda sender, data: asyncio.sleep(10))  # never answers in time
        network.kill(dead.local_peer_id)
        with pytest.raises(DHTBootstrapError) as error:
            await DHTNode.create(
                rpc=network.create_transport(),
                initial_peers=[dead.local_peer_id, silent.local_peer_id],
                wait_timeout=0.2,
            )
        message = str(error.value)
        assert str(dead.local_peer_id) in message and "killed" in message
        assert str(silent.local_peer_id) in message and "TimeoutError" in message
        node = await DHTNode.create(
            rpc=network.create_transport(), initial_peers=[dead.local_peer_id], ensure_bootstrap_success=False
        )
        await node.shutdown()

    run(main())


def test_transport_errors_become_rpc_errors():
    async def main():
        network = MemoryNetwork()
        transport, caller = network.create_transport(), network.create_transport()

        async def broken(sender, data):
            raise RuntimeError("handler bug")

        transport.serve(broken)
        with pytest.raises(DHTRPCError, match="handler bug"):
            await caller.call(transport.local_peer_id, b"x", timeout=1)

    run(main())


def test_concurrent_gets_share_one_search_and_values_get_cached():
    async def main():
        network = MemoryNetwork()
        nodes = await make_swarm(network, 20)
        assert await nodes[0].store("popular", "v", get_dht_time() + 30)
        reader = nodes[7]
        reader.cache.remove(DHTID.generate("popular"))
        before = network.calls
        results = await asyncio.gather(*(reader.get("popular", latest=True) for _ in range(5)))
        assert all(result.value == "v" for result in results)
        shared_calls = network.calls - before
        assert shared_calls < 3 * 25  # not five separate searches
        assert reader.cache.get(DHTID.generate("popular"), get_dht_time()) is not None
        await shutdown(nodes)

    run(main())


def test_keys_are_handed_over_to_new_nearer_peers():
    async def main():
        network = MemoryNetwork()
        nodes = await make_swarm(network, 8, num_replicas=2)
        assert await nodes[0].store("handover", "v", get_dht_time() + 60)
        key_id = DHTID.generate("handover")
        # a newcomer whose id is nearly the key itself must end up holding it
        newcomer = await DHTNode.create(
            rpc=network.create_transport(),
            node_id=DHTID(key_id ^ 1),
            initial_peers=[nodes[3].peer_id],
            num_replicas=2,
        )
        for _ in range(100):
            if newcomer.storage.get(key_id, get_dht_time()) is not None:
                break
            await asyncio.sleep(0.01)  # polling with a deadline for background hand-over
        assert newcomer.storage.get(key_id, get_dht_time()) is not None
        await shutdown(nodes + [newcomer])

    run(main())


def test_clock_skew_is_warned_about(caplog):
    async def main():
        network = MemoryNetwork()
        skewed = network.create_transport()
        skewed.serve(
            lambda sender, data: asyncio.sleep(
                0, PingResponse(DHTID.generate(), get_dht_time() + 60).encode()
            )
        )
        with caplog.at_level(logging.WARNING, logger="plexus.dht.node"):
            node = await DHTNode.create(rpc=network.create_transport(), initial_peers=[skewed.local_peer_id])
        assert "Clock of" in caplog.text and "NTP" in caplog.text
        assert "could not reach this node back" in caplog.text  # its ping response said available=False
        await node.shutdown()

    run(main())


def test_cached_keys_that_are_read_get_refreshed_before_they_expire():
    async def main():
        network = MemoryNetwork()
        nodes = await make_swarm(network, 10, cache_refresh_before_expiry=1.0)
        key_id = DHTID.generate("hot")
        assert await nodes[0].store("hot", "v1", get_dht_time() + 1.3)
        reader = next(node for node in nodes[1:] if node.storage.get(key_id, get_dht_time()) is None)
        assert (await reader.get("hot")).value == "v1"  # now in reader's cache
        assert (await reader.get("hot")).value == "v1"  # read from the cache: scheduled for refresh
        renewed = get_dht_time() + 30
        assert await nodes[0].store("hot", "v2", renewed)
        deadline = asyncio.get_running_loop().time() + 5
        while asyncio.get_running_loop().time() < deadline:
            cached = reader.cache.get(key_id, get_dht_time())
            if cached is not None and cached.expiration_time == renewed:
                break
            await asyncio.sleep(0.05)  # polling with a deadline while the refresh runs in the background
        assert reader.cache.get(key_id, get_dht_time()).expiration_time == renewed
        await shutdown(nodes)

    run(main())


def test_hostile_storer_is_bounded_and_cannot_hide_honest_entries():
    """A peer floods a victim with keys and stuffs one key with sub-keys; honest readers still see
    the honest entry and the victim's storage stays within its limits."""
    from plexus.dht.storage import StorageLimits

    async def main():
        network = MemoryNetwork()
        limits = StorageLimits(max_records_per_sender=300, max_entries_per_key=50, max_subkeys_per_sender=20)
        victim = await DHTNode.create(rpc=network.create_transport(), storage_limits=limits)
        honest, hostile = [
            await DHTNode.create(
                rpc=network.create_transport(), client_mode=True, initial_peers=[victim.peer_id]
            )
            for _ in range(2)
        ]
        now = get_dht_time()
        key = DHTID.generate("stuffed")
        entry, value = MSGPackSerializer.dumps(b"honest-entry"), MSGPackSerializer.dumps("honest")
        honest_item = StoreItem(key, entry, value, now + 60)
        assert await honest._send_items(victim.peer_id, [honest_item]) == [True]
        items = [
            StoreItem(DHTID.generate(f"flood{i}"), None, MSGPackSerializer.dumps(i), now + 60)
            for i in range(1000)
        ]
        items += [
            StoreItem(key, MSGPackSerializer.dumps(f"junk{i}"), MSGPackSerializer.dumps(i), now + 60)
            for i in range(1000)
        ]
        await hostile._send_items(victim.peer_id, items)  # what a hostile client can send by hand
        assert victim.storage.bytes_of(hostile.peer_id.to_bytes()) > 0
        assert len(victim.storage.get(key, get_dht_time()).value) <= limits.max_entries_per_key
        assert sum(1 for _ in victim.storage.items(get_dht_time())) <= limits.max_records_per_sender + 2
        found = await honest.get("stuffed", latest=True)
        assert found.value[b"honest-entry"].value == "honest"
        await shutdown([victim, honest, hostile])

    run(main())
