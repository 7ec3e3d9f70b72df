"""Client mode end to end on 127.0.0.1: a peer that cannot accept connections (no listener at all)
dials out, takes part in the DHT as a client, and averages as a sender through its own outgoing
connections; the same when the DHT decides client mode by itself (client_mode=None, private, no relay)."""

import pytest
import torch

from plexus.averaging.averager import DecentralizedAverager
from plexus.dht.dht import DHT
from plexus.utils.timing import get_dht_time

LOCAL = ["/ip4/127.0.0.1/tcp/0"]
FAST = dict(min_matchmaking_time=1.0, request_timeout=1.0)


async def _in_routing_table(node, peer_id) -> bool:
    return any(peer == peer_id for _, peer in node.routing_table)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["client_mode=True", "auto: private without relays"])
def test_a_peer_without_listener_uses_the_dht_and_averages_as_a_sender(how):
    first = DHT(start=True, host_maddrs=LOCAL)
    second = DHT(initial_peers=first.get_visible_maddrs(), start=True, host_maddrs=LOCAL)
    if how == "client_mode=True":
        client = DHT(initial_peers=first.get_visible_maddrs(), start=True, client_mode=True)
    else:  # AutoNAT would say "public" on 127.0.0.1, so the verdict is forced
        client = DHT(
            initial_peers=first.get_visible_maddrs(),
            start=True,
            client_mode=None,
            force_reachability="private",
            use_auto_relay=True,
            relays=[],
        )
    averagers = []
    try:
        assert client.client_mode and client.nat_mode == "client", (client.client_mode, client.nat_mode)
        assert client.get_visible_maddrs() == []
        if how == "client_mode=True":
            assert client.host.get_listen_maddrs() == []  # it could not accept a connection if it wanted to
        assert client.relay_service is None  # it relays for nobody

        # The DHT: it stores and reads through its outgoing connections, and stays out of routing tables.
        assert client.store("from-client", "hello", get_dht_time() + 60)
        assert second.get("from-client", latest=True).value == "hello"
        assert first.store("from-server", 42, get_dht_time() + 60)
        assert client.get("from-server", latest=True).value == 42
        for server in (first, second):
            assert server.run_coroutine(lambda dht, node: _in_routing_table(node, client.peer_id)) is False

        # Averaging: the client sends its tensors and receives the average; it reduces no part itself.
        values = {first: 0.0, second: 4.0, client: 8.0}
        averagers = [
            DecentralizedAverager(
                [torch.full((5000,), value)], dht, prefix="client", target_group_size=3, start=True, **FAST
            )
            for dht, value in values.items()
        ]
        assert averagers[-1].client_mode and averagers[-1].bandwidth == 0.0
        controls = [
            averager.step(wait=False, gather=str(averager.dht.peer_id), timeout=30) for averager in averagers
        ]
        groups = [control.result() for control in controls]
        for averager, group in zip(averagers, groups):
            assert sorted(group.values()) == sorted(str(dht.peer_id) for dht in values), group
            with averager.get_tensors() as (tensor,):
                assert torch.allclose(tensor, torch.full((5000,), 4.0)), tensor[:4]

        # Every connection of the client was opened by the client.
        for peer in client.host.connected_peers():
            assert client.host.get_connection(peer).initiator, f"{peer} connected to the client"
        for server in (first, second):
            assert server.host.get_connection(client.peer_id).initiator is False
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in (client, second, first):
            dht.shutdown()
