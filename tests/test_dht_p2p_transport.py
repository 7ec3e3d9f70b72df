"""HostDHTTransport's address bookkeeping: what it shares and learns stays in step with the host."""

import asyncio

import pytest

from plexus.dht.p2p_transport import MAX_SHARED_ADDRESSES, HostDHTTransport
from plexus.p2p.host import MAX_ADDRS_PER_PEER, Host
from plexus.p2p.identity import PrivateKey
from plexus.p2p.multiaddr import Multiaddr

pytestmark = pytest.mark.timeout(30)


def test_shared_and_learnt_addresses_follow_the_host():
    async def main():
        host = await Host(host_maddrs=()).start()
        transport = HostDHTTransport(host)
        other = PrivateKey.from_seed(b"\x07" * 32).peer_id
        first, second = Multiaddr("/ip4/10.0.0.1/tcp/1"), Multiaddr("/ip4/10.0.0.2/tcp/2")
        assert transport.known_addresses(other) == ()
        host.add_addrs(other, [first])
        assert list(transport.known_addresses(other)) == [first.to_bytes()]
        assert list(transport.known_addresses(other)) == [first.to_bytes()]  # the cached answer
        host.add_addrs(other, [second])  # the host puts it first: the cache must notice
        assert list(transport.known_addresses(other)) == [second.to_bytes(), first.to_bytes()]
        host.add_addrs(other, [first])  # moved back to the front, same length
        assert list(transport.known_addresses(other)) == [first.to_bytes(), second.to_bytes()]

        # learning: known addresses change nothing, a new one is added, a bad one is skipped
        third = Multiaddr("/ip4/10.0.0.3/tcp/3")
        transport.add_addresses([(other, (first.to_bytes(),))])
        assert host.peer_info(other).addrs == [first, second]
        transport.add_addresses([(other, (b"\xff\xff garbage", third.to_bytes()))])
        assert host.peer_info(other).addrs[0] == third
        assert transport.known_addresses(other)[0] == third.to_bytes()
        transport.add_addresses([(host.peer_id, (third.to_bytes(),))])  # never our own
        assert host.peer_info(host.peer_id) is None

        many = [Multiaddr(f"/ip4/10.0.1.{i}/tcp/{i}") for i in range(1, MAX_ADDRS_PER_PEER + 2)]
        host.add_addrs(other, many)
        assert len(transport.known_addresses(other)) <= MAX_SHARED_ADDRESSES
        # a full list whose first address object and length stay the same, yet whose contents change
        full = list(host.peer_info(other).addrs)
        first, new = full[0], Multiaddr("/ip4/10.0.2.1/tcp/1")
        transport.known_addresses(other)
        host.add_addrs(other, [new, first])
        assert len(full) == MAX_ADDRS_PER_PEER
        assert host.peer_info(other).addrs[0] is first and len(host.peer_info(other).addrs) == len(full)
        assert (
            list(transport.known_addresses(other))
            == [a.to_bytes() for a in host.peer_info(other).addrs][:MAX_SHARED_ADDRESSES]
        )
        assert new.to_bytes() in transport.known_addresses(other)
        await host.shutdown()

    asyncio.run(main())


def test_remote_ip_is_the_address_of_the_live_connection():
    async def main():
        server = await Host(host_maddrs=("/ip4/127.0.0.1/tcp/0",)).start()
        client = await Host(host_maddrs=()).start()
        client_side, server_side = HostDHTTransport(client), HostDHTTransport(server)
        assert client_side.remote_ip(server.peer_id) is None  # not connected: unknown
        server_addr = server.get_listen_maddrs()[0].with_peer_id(server.peer_id)
        await client.connect(server_addr)
        assert client_side.remote_ip(server.peer_id) == "127.0.0.1"  # the address we dialed
        deadline = asyncio.get_running_loop().time() + 10
        while server.get_connection(client.peer_id) is None:  # the server registers it after its handshake
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.01)  # polling with a deadline
        assert server_side.remote_ip(client.peer_id) == "127.0.0.1"  # the address it dialed us from
        await client.shutdown()
        await server.shutdown()

    asyncio.run(main())
