"""libp2p Kademlia (`/ipfs/kad/1.0.0`): the codec and the lookup on a simulated network, then
`DHT(use_ipfs=True)` against Go libp2p daemons that form a Kademlia DHT: one of our peers joins it
as a server and another finds it by its peer id alone."""

import asyncio
import random

import pytest

from plexus.dht.dht import DHT
from plexus.p2p.identity import PrivateKey
from plexus.p2p.multiaddr import Multiaddr
from plexus.p2p.protocols import kad as core
from plexus.p2p.protocols.errors import RemoteProtocolError
from plexus.p2p.protocols.kad import KadMessage, KadPeer, KadTable, MessageType, PeerLookup
from plexus.utils.timing import get_dht_time

ADDR = Multiaddr("/ip4/127.0.0.1/tcp/4001").to_bytes()


def peers(n: int):
    return [PrivateKey.from_seed(bytes([i]) * 32).peer_id for i in range(n)]


def test_codec_roundtrip_and_malformed_messages():
    a, b = peers(2)
    message = KadMessage(
        MessageType.FIND_NODE, a.to_bytes(), (KadPeer(a, (ADDR,), core.Connectedness.CONNECTED), KadPeer(b))
    )
    assert core.decode(core.encode(message)) == message
    assert core.decode(core.encode(KadMessage(MessageType.PING))) == KadMessage(MessageType.PING)
    # A peer whose id is not a multihash is dropped, not fatal; its neighbours survive.
    bad_peer = bytes([0x42, 5]) + b"\x0a\x03abc"
    raw = core.encode(KadMessage(MessageType.FIND_NODE, b"k", (KadPeer(a, (ADDR,)),))) + bad_peer
    assert core.decode(raw).closer_peers == (KadPeer(a, (ADDR,)),)
    for garbage in (
        b"\x08\x09",
        b"\x08",
        b"\x12\xff",
        b"\x12" + bytes([0x80, 0x04]) + b"x" * 512,
        b"\x42\x02\x0a\x00" * (core.MAX_PEERS_PER_MESSAGE + 1),
        b"\x00" * (core.MAX_MESSAGE_SIZE + 1),
    ):
        with pytest.raises(RemoteProtocolError):
            core.decode(garbage)


def test_server_answers_from_its_table():
    local, requester, wanted, *others = peers(30)
    table = KadTable(local, max_size=25)
    for peer in others + [requester]:
        table.add(peer, [ADDR])
    addrs_of = lambda peer: (ADDR,) if peer in table or peer == wanted else ()  # noqa: E731
    me = KadPeer(local, (ADDR,))
    # A known peer comes back alone; an unknown key gets the k closest servers, never the requester.
    assert core.answer(
        KadMessage(MessageType.FIND_NODE, wanted.to_bytes()), table, addrs_of, me, requester
    ).closer_peers == (KadPeer(wanted, (ADDR,)),)
    assert core.answer(
        KadMessage(MessageType.FIND_NODE, local.to_bytes()), table, addrs_of, me, requester
    ).closer_peers == (me,)
    reply = core.answer(KadMessage(MessageType.GET_PROVIDERS, b"some cid"), table, addrs_of, me, requester)
    named = [peer.peer_id for peer in reply.closer_peers]
    assert len(named) == core.K and requester not in named and reply.provider_peers == ()
    assert named == sorted(named, key=lambda peer: core.distance(peer.to_bytes(), b"some cid"))
    assert core.answer(KadMessage(MessageType.PING), table, addrs_of, me, requester).type is MessageType.PING
    assert core.answer(KadMessage(MessageType.PUT_VALUE, b"k"), table, addrs_of, me, requester) is None
    assert len(table) == 25  # bounded: the oldest were dropped


def simulate(n: int, seed: int, target_index: int, lose: set[int] = frozenset()):
    """A network where every peer knows its 8 closest peers and 8 random others (the far and near
    buckets of a Kademlia table, in small); `lose` never answer. Returns the finished lookup."""
    rng = random.Random(seed)
    ids = peers(n)
    knows = {
        peer: sorted(
            (p for p in ids if p != peer), key=lambda p: core.distance(p.to_bytes(), peer.to_bytes())
        )[:8]
        + rng.sample([p for p in ids if p != peer], 8)
        for peer in ids
    }
    lookup = PeerLookup(ids[target_index], [KadPeer(ids[1], (ADDR,))], local=ids[0])
    while not lookup.done:
        batch = lookup.next_queries()
        assert batch and len(batch) <= core.ALPHA
        for peer in batch:
            if ids.index(peer.peer_id) in lose:
                lookup.on_failure(peer.peer_id)
            else:
                closer = sorted(
                    knows[peer.peer_id], key=lambda p: core.distance(p.to_bytes(), lookup.target.to_bytes())
                )
                lookup.on_answer(
                    peer.peer_id,
                    KadMessage(
                        MessageType.FIND_NODE, b"", tuple(KadPeer(p, (ADDR,)) for p in closer[: core.K])
                    ),
                )
    return lookup


def test_lookup_finds_a_peer_in_a_simulated_network_within_bounds():
    for seed in range(5):
        lookup = simulate(200, seed, target_index=150, lose={3, 4, 5})
        assert lookup.found is not None and lookup.found.peer_id == peers(151)[150], seed
        assert lookup.queries <= lookup.max_queries
    # A peer that does not exist: the lookup ends after asking the k closest, not the whole network.
    ids = peers(2)
    lookup = PeerLookup(PrivateKey.generate().peer_id, [KadPeer(ids[1], (ADDR,))], local=ids[0])
    (first,) = lookup.next_queries()
    lookup.on_answer(first.peer_id, KadMessage(MessageType.FIND_NODE))
    assert lookup.done and lookup.found is None and lookup.next_queries() == []
    with pytest.raises(Exception, match="in flight"):
        lookup.on_answer(first.peer_id, KadMessage(MessageType.FIND_NODE))


# --- against the Go libp2p daemon's Kademlia DHT -------------------------------------------------


@pytest.mark.interop
@pytest.mark.timeout(90)
def test_use_ipfs_finds_our_peer_by_id_through_a_go_kademlia_dht(p2pd_factory):
    async def start_daemons():
        first = await p2pd_factory.start(dht_server=True)
        rest = [
            await p2pd_factory.start(dht_server=True, bootstrap_peers=tuple(first.maddrs)) for _ in range(3)
        ]
        return [first] + rest

    daemons = asyncio.run(start_daemons())
    local = ["/ip4/127.0.0.1/tcp/0"]
    # Our first peer joins the Kademlia DHT through one daemon only...
    target = DHT(start=True, host_maddrs=local, use_ipfs=True, ipfs_bootstrap_peers=daemons[1].maddrs)
    try:
        assert target.kademlia is not None and len(target.kademlia.table) >= 1
        assert target.store("hello", "from the peer found by id", get_dht_time() + 60)
        # ...and the second, bootstrapping through another daemon, finds it by its peer id alone.
        with DHT(
            initial_peers=[f"/p2p/{target.peer_id}"],
            start=True,
            host_maddrs=local,
            use_ipfs=True,
            ipfs_bootstrap_peers=daemons[3].maddrs,
        ) as finder:
            assert finder.get("hello", latest=True).value == "from the peer found by id"
            info = finder.host.peer_info(target.peer_id)
            assert info is not None and set(map(str, info.addrs)) & {
                str(a.without_peer_id()) for a in target.get_visible_maddrs()
            }
            connection = finder.host.get_connection(target.peer_id)
            assert connection is not None and not getattr(connection, "relayed", False)
        # Without use_ipfs, a bare peer id is refused with the reason.
        with pytest.raises(Exception, match="use_ipfs"):
            DHT(initial_peers=[f"/p2p/{target.peer_id}"], start=True, host_maddrs=local)
    finally:
        target.shutdown()
