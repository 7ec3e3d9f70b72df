"""The protocol core (requests in, responses and actions out) and the beam search, without I/O."""

import random

import pytest

from plexus.dht.crypto import Ed25519SignatureValidator
from plexus.dht.messages import (
    FindRequest,
    Message,
    PingRequest,
    PingResponse,
    StoreItem,
    StoreRequest,
    StoreResponse,
)
from plexus.dht.protocol import DHTProtocol, HandOver, PingToEvict, make_record
from plexus.dht.routing import DHTID, RoutingTable
from plexus.dht.storage import DHTLocalStorage
from plexus.dht.traverse import Traversal
from plexus.p2p.identity import PrivateKey

pytestmark = pytest.mark.timeout(60)
PEERS = [PrivateKey.from_seed(bytes([i]) * 32).peer_id for i in range(1, 120)]


def make_core(node_id=None, bucket_size=20, client_mode=False, validator=None, depth_modulo=5) -> DHTProtocol:
    node_id = node_id if node_id is not None else DHTID.generate()
    return DHTProtocol(
        node_id,
        RoutingTable(node_id, bucket_size, depth_modulo),
        DHTLocalStorage(),
        DHTLocalStorage(maxsize=10),
        validator,
        num_replicas=3,
        client_mode=client_mode,
    )


def serve(core: DHTProtocol, sender, request: Message, now=0.0, available=False):
    """Bytes in, bytes out: what the node does around `handle`."""
    response, actions = core.handle(sender, Message.decode(request.encode()), now, available)
    return Message.decode(response.encode()), actions


def test_ping_adds_server_senders_but_not_clients():
    core = make_core()
    sender = DHTID.generate()
    response, _ = serve(core, PEERS[0], PingRequest(sender), now=5.0)
    assert response == PingResponse(core.node_id, 5.0, False)
    assert core.routing_table.uid_to_peer_id == {sender: PEERS[0]}
    serve(core, PEERS[1], PingRequest(None))  # client mode: no id, never added
    assert PEERS[1] not in core.routing_table
    serve(core, PEERS[2], PingRequest(DHTID.generate(), validate=True), available=False)
    assert PEERS[2] not in core.routing_table  # asked for a reachability check and failed it
    response, _ = serve(core, PEERS[3], PingRequest(DHTID.generate(), validate=True), available=True)
    assert response.available and PEERS[3] in core.routing_table


def test_client_core_answers_without_an_id():
    core = make_core(client_mode=True)
    response, _ = serve(core, PEERS[0], PingRequest(DHTID.generate()))
    assert response.node_id is None


def test_store_then_find():
    core = make_core()
    key = DHTID.generate("k")
    items = (
        StoreItem(key, None, b"v1", 10.0),
        StoreItem(key, None, b"v0", 9.0),
        StoreItem(key, None, b"v", -1.0),
    )
    response, _ = serve(core, PEERS[0], StoreRequest(None, items), now=0.0)
    assert response == StoreResponse(core.node_id, (True, False, False))
    dict_key = DHTID.generate("d")
    serve(
        core,
        PEERS[0],
        StoreRequest(
            None,
            (
                StoreItem(dict_key, b"\xa1a", b"x", 5.0),
                StoreItem(dict_key, b"\xa1b", b"y", 7.0, in_cache=True),
            ),
        ),
    )
    for i in range(5):
        serve(core, PEERS[i + 1], PingRequest(DHTID.generate()))
    response, _ = serve(core, PEERS[0], FindRequest(None, (key, dict_key, DHTID.generate("none"))), now=1.0)
    found, dictionary, missing = response.results
    assert (found.value, found.expiration_time) == (b"v1", 10.0) and len(found.nearest) == 5
    assert dictionary.entries == ((b"\xa1a", b"x", 5.0), (b"\xa1b", b"y", 7.0))  # storage and cache merged
    assert not missing.found and len(missing.nearest) == 5
    assert not serve(core, PEERS[0], FindRequest(None, (key,)), now=10.0)[0].results[0].found


def test_find_excludes_the_requester():
    core = make_core()
    requester = DHTID.generate()
    serve(core, PEERS[0], PingRequest(requester))
    serve(core, PEERS[1], PingRequest(DHTID.generate()))
    response, _ = serve(core, PEERS[0], FindRequest(requester, (requester,)))
    assert [node_id for node_id, _ in response.results[0].nearest] != [requester]
    assert requester not in [node_id for node_id, _ in response.results[0].nearest]


def test_store_of_a_record_owned_by_someone_else_is_refused():
    owner, mallory = Ed25519SignatureValidator(), Ed25519SignatureValidator()
    core = make_core(validator=Ed25519SignatureValidator())
    key = DHTID.generate("progress")
    record = make_record(key, owner.local_public_key, b"\x01", 10.0)
    good = StoreItem(key, record.subkey, owner.sign_value(record), 10.0)
    mallory_signature = mallory.sign_value(make_record(key, mallory.local_public_key, b"\x02", 11.0))[1:]
    forged = StoreItem(key, record.subkey, b"\x02" + mallory_signature, 11.0)  # alice's subkey, mallory's key
    response, _ = serve(core, PEERS[0], StoreRequest(None, (good, forged)))
    assert response.results == (True, False)
    # and an invalid record in someone's find answer is dropped on receipt
    result = serve(core, PEERS[0], FindRequest(None, (key,)))[0].results[0]
    assert core.filter_found(key, result, now=0.0).entries == ((record.subkey, good.value, 10.0),)
    tampered = result.__class__(None, ((record.subkey, b"\x03" + good.value[1:], 10.0),), 10.0, ())
    assert not core.filter_found(key, tampered, now=0.0).found


def test_full_far_bucket_asks_to_ping_the_oldest():
    core = make_core(node_id=DHTID(0), bucket_size=2, depth_modulo=1)
    far = [DHTID(2**159 + i) for i in range(3)]
    serve(core, PEERS[0], PingRequest(far[0]))
    serve(core, PEERS[1], PingRequest(far[1]))
    _, actions = serve(core, PEERS[2], PingRequest(far[2]))
    assert actions == [PingToEvict(far[0], PEERS[0])]
    core.peer_failed(PEERS[0])
    assert far[2] in core.routing_table


def test_new_nearer_peer_gets_the_keys_handed_over():
    core = make_core(node_id=DHTID(2**159))
    key = DHTID(1)
    core.storage.store(key, b"v", 10.0, now=0.0)
    core.storage.store(DHTID(3), b"d", 10.0, now=0.0, subkey=b"\xa1s")
    _, actions = serve(core, PEERS[0], PingRequest(DHTID(2)))
    assert len(actions) == 1 and isinstance(actions[0], HandOver)
    assert {(item.key, item.subkey, item.value) for item in actions[0].items} == {
        (key, None, b"v"),
        (DHTID(3), b"\xa1s", b"d"),
    }
    _, actions = serve(core, PEERS[0], PingRequest(DHTID(2)))
    assert actions == []  # only when first seen
    _, actions = serve(core, PEERS[1], PingRequest(DHTID(2**158)))
    assert actions == []  # we know a nearer peer (DHTID(2)): that one is responsible, not us


# the beam search, driven by hand over a simulated network


def simulate(num_nodes=60, bucket_size=5, seed=0):
    rng = random.Random(seed)
    ids = [DHTID(rng.randrange(2**160)) for _ in range(num_nodes)]
    tables = {}
    for node_id in ids:
        table = RoutingTable(node_id, bucket_size)
        for other in ids:
            table.add_or_update_node(other, PEERS[ids.index(other)], 0)
        tables[node_id] = table
    return ids, tables


def run_traversal(traversal, tables, dead=(), bucket_size=5, order_seed=0):
    rng = random.Random(order_seed)
    pending, requests = [], 0
    while not traversal.done:
        pending.extend(traversal.next_queries())
        assert traversal.in_flight <= traversal.num_workers
        if not pending:
            break
        request = pending.pop(rng.randrange(len(pending)))  # answers arrive in any order
        requests += 1
        if request.node_id in dead:
            traversal.on_failure(request)
        else:
            table = tables[request.node_id]  # live peers have evicted the dead ones from their tables
            answer = {
                q: [n for n in table.get_nearest_neighbors(q, bucket_size + len(dead)) if n[0] not in dead]
                for q in request.queries
            }
            traversal.on_response(request, {q: neighbours[:bucket_size] for q, neighbours in answer.items()})
    return requests


@pytest.mark.parametrize("seed", range(5))
def test_traversal_finds_the_true_nearest_nodes(seed):
    ids, tables = simulate(seed=seed)
    start = ids[0]
    queries = [DHTID.generate(f"q{i}") for i in range(9)]
    traversal = Traversal(queries, tables[start].get_nearest_neighbors(0, 5), beam_size=5, num_workers=3)
    run_traversal(traversal, tables, order_seed=seed)
    assert traversal.done
    for query in queries:
        expected = sorted(ids, key=lambda n: n ^ query)[:5]
        assert [node_id for node_id, _ in traversal.nearest(query)] == expected


def test_traversal_packs_several_queries_per_request_and_skips_dead_nodes():
    ids, tables = simulate(seed=7)
    dead = set(ids[1:10])
    queries = [DHTID.generate(f"q{i}") for i in range(16)]
    traversal = Traversal(queries, tables[ids[0]].get_nearest_neighbors(0, 5), beam_size=5, num_workers=4)
    first = traversal.next_queries()
    assert len(first) == 4 and all(len(request.queries) == 4 for request in first)  # sqrt(16) per request
    for request in first:
        traversal.on_failure(request)
        dead.add(request.node_id)
    run_traversal(traversal, tables, dead=dead)
    for query in queries:
        alive = [n for n in ids if n not in dead]
        expected = sorted(alive, key=lambda n: n ^ query)[:5]
        assert [node_id for node_id, _ in traversal.nearest(query)] == expected


def test_finish_stops_a_query_early():
    ids, tables = simulate(seed=3)
    query = DHTID.generate("q")
    traversal = Traversal([query], tables[ids[0]].get_nearest_neighbors(query, 5), beam_size=5, num_workers=2)
    request = traversal.next_queries()[0]
    traversal.on_response(request, {query: tables[request.node_id].get_nearest_neighbors(query, 5)})
    traversal.finish(query)
    assert traversal.done and traversal.next_queries() == []


def test_traversal_with_no_candidates_is_done_at_once():
    traversal = Traversal([DHTID(1)], [], beam_size=5)
    assert traversal.done and traversal.next_queries() == [] and traversal.nearest(DHTID(1)) == []
