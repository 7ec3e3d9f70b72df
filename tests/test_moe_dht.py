"""Experts in a real DHT on 127.0.0.1: announcing, finding, routing by peer id, re-announcing, sampling."""

import itertools
import random
import time

import pytest
import torch

from plexus.dht.dht import DHT
from plexus.moe import ExpertInfo, RemoteExpert, Server, declare_experts, get_experts
from plexus.moe.client import MoEBeamSearcher
from plexus.moe.expert_registry import EMPTY_PREFIX_SUBKEY
from plexus.utils.timing import get_dht_time

pytestmark = pytest.mark.timeout(30)
LOCAL = ["/ip4/127.0.0.1/tcp/0"]
GRID = (3, 4)


@pytest.fixture(scope="module")
def grid_server():
    """One server with the full 3x4 grid of small ffn experts, in a DHT of its own."""
    uids = [f"grid.{i}.{j}" for i, j in itertools.product(*map(range, GRID))]
    server = Server.create(
        expert_uids=uids, hidden_dim=8, optim_cls=None, start=True, host_maddrs=LOCAL, device="cpu"
    )  # compared with the local module on CPU inputs
    yield server
    server.shutdown()


@pytest.fixture
def client(grid_server):
    dht = DHT(initial_peers=grid_server.dht.get_visible_maddrs(), start=True, client_mode=True)
    yield dht
    dht.shutdown()


def test_get_experts_and_call_one_by_peer_id_alone(grid_server, client):
    experts = get_experts(client, ["grid.1.2", "grid.9.9", "grid.0.3"])
    assert experts[1] is None
    assert [e.uid for e in experts if e] == ["grid.1.2", "grid.0.3"]
    assert experts[0].peer_id == grid_server.host.peer_id
    x = torch.randn(2, 8, requires_grad=True)
    out = experts[0](x)
    local = grid_server.module_backends["grid.1.2"].module
    torch.testing.assert_close(out, local(x), rtol=1e-5, atol=1e-5)


def test_a_peer_routes_to_a_server_it_knows_by_id_only():
    """Peer routing: clients that joined before the server existed reach it from (uid, peer id) alone."""
    with (
        DHT(start=True, host_maddrs=LOCAL) as bootstrap,
        DHT(initial_peers=bootstrap.get_visible_maddrs(), start=True, client_mode=True) as first,
        DHT(initial_peers=bootstrap.get_visible_maddrs(), start=True, client_mode=True) as second,
    ):
        server = Server.create(
            expert_uids=["routed.0"],
            hidden_dim=4,
            optim_cls=None,
            start=True,
            initial_peers=bootstrap.get_visible_maddrs(),
            host_maddrs=LOCAL,
        )
        try:
            for client in (first, second):
                assert client.host.peer_info(server.host.peer_id) is None, (
                    "the client must not know the address"
                )
            # the host's own peer routing (a DHT lookup from inside the dial; see learn_addresses)
            expert = RemoteExpert(ExpertInfo("routed.0", server.host.peer_id), first.host)
            assert expert(torch.ones(1, 4)).shape == (1, 4)
            assert first.host.get_connection(server.host.peer_id) is not None
            # get_experts looks the address up before any dial
            expert = get_experts(second, ["routed.0"])[0]
            assert expert(torch.ones(1, 4)).shape == (1, 4)
        finally:
            server.shutdown()


def test_beam_search_through_the_dht_matches_brute_force(grid_server, client):
    searcher = MoEBeamSearcher(client, "grid", GRID)
    rng = random.Random(0)
    batch = [[[rng.gauss(0, 1) for _ in range(size)] for size in GRID] for _ in range(16)]
    found = searcher.batch_find_best_experts(batch, 3)
    for scores, experts in zip(batch, found):
        ranked = sorted(
            grid_server.module_backends,
            key=lambda uid: -sum(s[int(c)] for s, c in zip(scores, uid.split(".")[1:])),
        )
        assert [e.uid for e in experts] == ranked[:3]
        assert all(e.peer_id == grid_server.host.peer_id for e in experts)
    # hivemind's layout of the arguments: one [batch, size] array per dimension
    per_dim = [torch.tensor([sample[d] for sample in batch]) for d in range(len(GRID))]
    assert [[e.uid for e in experts] for experts in searcher.batch_find_best_experts(per_dim, 3)] == [
        [e.uid for e in experts] for experts in found
    ]


def test_empty_prefixes_are_cached_negatively(grid_server, client):
    searcher = MoEBeamSearcher(client, "grid", (5, 4), cache_expiration=60)
    experts = searcher.find_best_experts([[0, 0, 2, 9, 8], [1, 2, 3, 4]], 2)  # grid.3. and grid.4. are empty
    assert [e.uid for e in experts] == ["grid.2.3", "grid.2.2"]
    deadline = time.monotonic() + 10
    while True:  # the markers are stored in the background
        record = grid_server.dht.get("grid.4.", latest=True)
        if record is not None:
            break
        assert time.monotonic() < deadline, "the empty prefix was not cached in the DHT"
        time.sleep(0.05)
    assert set(record.value) == {EMPTY_PREFIX_SUBKEY} and record.value[EMPTY_PREFIX_SUBKEY].value is None
    # a flat expert announced under a cached-empty prefix is still found by other peers
    assert grid_server.dht.store("flat.1.", None, get_dht_time() + 60, subkey=EMPTY_PREFIX_SUBKEY)
    assert all(declare_experts(grid_server.dht, ["flat.1"], get_dht_time() + 60).values())
    with DHT(initial_peers=grid_server.dht.get_visible_maddrs(), start=True, client_mode=True) as other:
        assert [e.uid for e in MoEBeamSearcher(other, "flat", (3,)).find_best_experts([[0, 1, 0]], 1)] == [
            "flat.1"
        ]


def test_server_reannounces_every_update_period():
    with Server.create(
        expert_uids=["renew.0"],
        hidden_dim=4,
        optim_cls=None,
        start=True,
        host_maddrs=LOCAL,
        update_period=0.2,
        expiration=2,
    ) as server:
        first = server.dht.get("renew.0", latest=True).expiration_time
        deadline = time.monotonic() + 10
        while server.dht.get("renew.0", latest=True).expiration_time <= first:
            assert time.monotonic() < deadline, "the announcement was not renewed"
            time.sleep(0.05)


def test_create_skips_uids_that_other_servers_announce(grid_server):
    initial = grid_server.dht.get_visible_maddrs()
    first = Server.create(
        expert_uids=["dedup.0.0", "dedup.0.1", "dedup.1.1"],
        hidden_dim=4,
        optim_cls=None,
        start=True,
        initial_peers=initial,
        host_maddrs=LOCAL,
    )
    try:
        for seed in range(3):
            second = Server.create(
                num_experts=1,
                expert_pattern="dedup.[0:2].[0:2]",
                hidden_dim=4,
                optim_cls=None,
                start=False,
                initial_peers=initial,
                host_maddrs=LOCAL,
                rng=random.Random(seed),
            )
            assert list(second.module_backends) == ["dedup.1.0"]
            second.shutdown()
        with pytest.raises(ValueError, match="no other server announces"):
            Server.create(
                num_experts=2,
                expert_pattern="dedup.[0:2].[0:2]",
                hidden_dim=4,
                start=False,
                initial_peers=initial,
                host_maddrs=LOCAL,
            )
    finally:
        first.shutdown()
