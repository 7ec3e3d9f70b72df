"""Private swarms by access token: tokens signed by the run's authority, checked on every protocol.

Members talk as usual (DHT, averaging, state sharing); an outsider without a token, one with a token
from another authority, one with a token for another key, and a member whose token expired are each
refused, with a clear error on their side and one log line on ours.
"""

import asyncio
import logging

import pytest
import torch

from plexus.averaging.averager import DecentralizedAverager
from plexus.dht.dht import DHT
from plexus.dht.node import DHTBootstrapError
from plexus.errors import UsageError
from plexus.p2p import rpc
from plexus.p2p.auth import (
    AccessToken,
    AuthorizationError,
    SignedTokenAuthorizer,
    TokenAuthority,
    TokenAuthorizerBase,
)
from plexus.p2p.host import Host
from plexus.p2p.identity import PrivateKey
from plexus.p2p.stream import StreamError
from plexus.utils.timing import ManualClock, get_dht_time, use_clock

pytestmark = pytest.mark.timeout(60)
LOCAL = ("/ip4/127.0.0.1/tcp/0",)
PROTOCOLS = ("/plexus/dht/1.0.0", "/plexus/averaging/join/1.0.0", "/plexus/moe/forward/1.0.0")


def member(authority: TokenAuthority, **options) -> SignedTokenAuthorizer:
    return SignedTokenAuthorizer(authority.public_key, lambda key: authority.issue(key, "member", **options))


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 50))


def logged(caplog, text: str) -> list[str]:
    return [record.getMessage() for record in caplog.records if text in record.getMessage()]


def test_tokens_bind_a_key_an_authority_and_a_time():
    async def main():
        authority, other_authority = TokenAuthority(), TokenAuthority()
        key, thief = PrivateKey.generate(), PrivateKey.generate()
        checker = member(authority)
        checker.bind(PrivateKey.generate())
        good = authority.issue(key.public_key, "alice", lifetime=60)
        assert await checker.validate(key.peer_id, key.public_key, good.encode()) == good.expiration_time
        cases = [
            (thief.public_key, good, "names another key"),  # a copied token is useless to anyone else
            (
                key.public_key,
                other_authority.issue(key.public_key, "alice"),
                "not signed by this run's authority",
            ),
            (
                key.public_key,
                AccessToken("mallory", key.public_key.to_protobuf(), get_dht_time() + 60, b"\x00" * 64),
                "not signed by this run's authority",
            ),
            (
                key.public_key,
                AccessToken("alice", good.public_key, good.expiration_time + 1, good.signature),
                "not signed",
            ),  # a longer life is a different token
            (key.public_key, authority.issue(key.public_key, "alice", lifetime=-1), "expired"),
        ]
        for public_key, token, reason in cases:
            with pytest.raises(AuthorizationError, match=reason):
                await checker.validate(key.peer_id, public_key, token.encode())
        with pytest.raises(AuthorizationError, match="malformed access token"):
            await checker.validate(key.peer_id, key.public_key, b"\xc1garbage")
        # Our own token is asked again once it is about to expire, and never for another key.
        clock, issued = ManualClock(1000.0), []
        with use_clock(clock):
            mine = SignedTokenAuthorizer(
                authority.public_key,
                lambda k: issued.append(k) or authority.issue(k, lifetime=100),
                refresh_before=30,
            )
            mine.bind(key)
            first = await mine.credentials()
            assert await mine.credentials() == first and len(issued) == 1
            clock.advance(75)
            assert await mine.credentials() != first and len(issued) == 2
            wrong = SignedTokenAuthorizer(authority.public_key, lambda k: authority.issue(thief.public_key))
            wrong.bind(key)
            with pytest.raises(ValueError, match="another key"):
                await wrong.credentials()
        with pytest.raises(ValueError, match="not the host's identity"):
            Host(
                key,
                authorizer=SignedTokenAuthorizer(
                    authority.public_key, authority.issue, local_private_key=thief
                ),
            )

    run(main())


async def echo(request, context):
    return request


def test_members_talk_and_outsiders_are_refused_on_every_protocol(caplog):
    caplog.set_level(logging.WARNING)

    async def main():
        authority = TokenAuthority()
        # negotiate_timeout: how long a peer's token may keep us waiting
        server, friend = [
            await Host(host_maddrs=LOCAL, negotiate_timeout=1, authorizer=member(authority)).start()
            for _ in range(2)
        ]
        for protocol in PROTOCOLS:
            rpc.add_handler(server, protocol, echo)
        addr = server.get_visible_maddrs()[0]
        await friend.connect(addr)
        for protocol in PROTOCOLS:
            assert await rpc.call(friend, server.peer_id, protocol, b"hi", timeout=5) == b"hi"
        assert await friend.ping(addr) < 5
        # Without any token: every stream is refused, then the connection is closed.
        stranger = await Host(host_maddrs=(), negotiate_timeout=1).start()
        connection = await stranger.connect(addr)
        for protocol in PROTOCOLS + ("/ipfs/ping/1.0.0", "/ipfs/id/1.0.0"):
            with pytest.raises((StreamError, ConnectionError)):
                await rpc.call(stranger, server.peer_id, protocol, b"hi", timeout=5)
        await asyncio.wait_for(connection.closed.wait(), 5)
        # A token of another run's authority, or for another key: refused, and the caller is told why.
        for authorizer, reason in (
            (member(TokenAuthority()), "not signed by this run's authority"),
            (SignedTokenAuthorizer(authority.public_key, authority.issue), None),
        ):
            intruder = await Host(host_maddrs=(), authorizer=authorizer).start()
            intruder.add_addrs(server.peer_id, server.get_listen_maddrs())
            if reason is None:  # a stolen token: issued to the friend's key, presented under another
                stolen = authority.issue(friend.private_key.public_key)
                authorizer._local_access_token = stolen
                authorizer.does_token_need_refreshing = lambda token: False
                reason = "names another key"
            with pytest.raises(AuthorizationError, match=reason):
                await rpc.call(intruder, server.peer_id, PROTOCOLS[0], b"hi", timeout=5)
            await intruder.shutdown()
        assert await rpc.call(friend, server.peer_id, PROTOCOLS[0], b"still", timeout=5) == b"still"
        for host in (server, friend, stranger):
            await host.shutdown()
        # five streams refused, one line
        assert len(logged(caplog, f"stream from {stranger.peer_id}: it presented no access token")) == 1
        assert len(logged(caplog, f"closing the connection from {stranger.peer_id}")) == 1

    run(main())


def test_an_expired_token_is_refused_and_a_renewed_one_lets_the_member_back_in(caplog):
    caplog.set_level(logging.WARNING)

    async def main():
        authority, clock = TokenAuthority(), ManualClock()
        renew = [True]
        with use_clock(clock):
            server = await Host(host_maddrs=LOCAL, authorizer=member(authority)).start()
            rpc.add_handler(server, PROTOCOLS[0], echo)
            tokens = []

            def get_token(key):  # tokens of 1 s (on the manual clock), while the authority renews them
                if renew[0] or not tokens:
                    tokens.append(authority.issue(key, lifetime=1))
                return tokens[-1]

            client = await Host(
                host_maddrs=(),
                authorizer=SignedTokenAuthorizer(authority.public_key, get_token, refresh_before=0.5),
            ).start()
            client.add_addrs(server.peer_id, server.get_listen_maddrs())
            assert await rpc.call(client, server.peer_id, PROTOCOLS[0], b"a", timeout=5) == b"a"
            renew[0] = False
            clock.advance(5)  # the token expired, and the authority gives no new one
            with pytest.raises(AuthorizationError, match="our access token expired"):
                await rpc.call(client, server.peer_id, PROTOCOLS[0], b"b", timeout=5)
            # A stream opened past the client's own check is refused by the server all the same.
            stream = client.get_connection(server.peer_id).open_stream()
            await stream.write(b"\x13/multistream/1.0.0\n\x12/plexus/dht/1.0.0\n")
            with pytest.raises(StreamError):
                while await stream.read():  # the server's side of the negotiation, then the reset
                    pass
            renew[0] = True  # the authority renews again: the member is back in, on the same connection
            async with asyncio.timeout(10):
                while True:
                    try:
                        assert await rpc.call(client, server.peer_id, PROTOCOLS[0], b"c", timeout=5) == b"c"
                        break
                    except AuthorizationError:
                        await asyncio.sleep(0.05)  # polling with a deadline: the renewal loop
            assert len(server.connections_to(client.peer_id)) == 1
            await client.shutdown()
            await server.shutdown()
        lines = logged(caplog, f"/plexus/dht/1.0.0 stream from {client.peer_id}: its access token expired")
        assert len(lines) == 1

    run(main())


def test_tokens_are_renewed_before_they_expire_on_open_connections():
    async def main():
        authority = TokenAuthority()
        issued = []

        def get_token(key):
            issued.append(get_dht_time())
            return authority.issue(key, lifetime=1.5)

        server = await Host(host_maddrs=LOCAL, authorizer=member(authority, lifetime=30)).start()
        rpc.add_handler(server, PROTOCOLS[0], echo)
        client = await Host(
            host_maddrs=(),
            authorizer=SignedTokenAuthorizer(authority.public_key, get_token, refresh_before=1.0),
        ).start()
        client.add_addrs(server.peer_id, server.get_listen_maddrs())
        started = get_dht_time()
        while get_dht_time() - started < 4:  # the scenario: more than two lifetimes of the token
            assert await rpc.call(client, server.peer_id, PROTOCOLS[0], b"x", timeout=5) == b"x"
            await asyncio.sleep(0.1)
        assert len(issued) >= 3
        assert len(server.connections_to(client.peer_id)) == 1  # the same connection all along
        await client.shutdown()
        await server.shutdown()

    run(main())


class _Refuser(TokenAuthorizerBase):
    """A hivemind-style subclass: the three abstract methods are the whole policy."""

    async def get_token(self):
        return AccessToken("nobody", self.local_public_key.to_protobuf(), get_dht_time() + 60)

    def is_token_valid(self, access_token):
        return access_token.username == "somebody"

    def does_token_need_refreshing(self, access_token):
        return False


@pytest.mark.timeout(120)
def test_authorized_peers_average_and_share_state_and_outsiders_cannot_join():
    authority = TokenAuthority()
    first = DHT(start=True, host_maddrs=list(LOCAL), authorizer=member(authority))
    second = DHT(
        initial_peers=first.get_visible_maddrs(),
        start=True,
        host_maddrs=list(LOCAL),
        authorizer=member(authority),
    )
    averagers = []
    try:
        assert second.store("run", "members only", get_dht_time() + 60)
        assert first.get("run", latest=True).value == "members only"
        averagers = [
            DecentralizedAverager(
                [torch.full((100,), float(i))],
                dht,
                prefix="private",
                start=True,
                target_group_size=2,
                min_matchmaking_time=1.0,
                request_timeout=0.5,
            )
            for i, dht in enumerate((first, second))
        ]
        controls = [averager.step(wait=False, timeout=30) for averager in averagers]
        for control in controls:
            control.result()
        for averager in averagers:
            with averager.get_tensors() as (tensor,):
                assert torch.allclose(tensor, torch.full((100,), 0.5))
        _metadata, tensors = averagers[1].load_state_from_peers(timeout=20)
        assert torch.allclose(tensors[0], torch.full((100,), 0.5))
        for authorizer in (None, member(TokenAuthority()), _Refuser()):
            with pytest.raises((DHTBootstrapError, TimeoutError)):
                DHT(
                    initial_peers=first.get_visible_maddrs(),
                    start=True,
                    host_maddrs=list(LOCAL),
                    authorizer=authorizer,
                    startup_timeout=20,
                ).shutdown()
        assert first.get("run", latest=True).value == "members only"
    finally:
        for thing in averagers + [second, first]:
            thing.shutdown()


def test_an_authorizer_without_a_key_says_it_needs_one():
    # Until a Host binds it (or local_private_key is given), it has no identity to ask a token for.
    lonely = member(TokenAuthority())
    with pytest.raises(UsageError, match="no key yet"):
        run(lonely.credentials())
