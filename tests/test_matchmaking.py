"""Matchmaking: the sans-I/O state machine, its messages, and swarms of real hosts on 127.0.0.1.

Swarm tests build N hosts, each with a DHTNode over `HostDHTTransport`, in one event loop,
bootstrapped from the first peer. They wait on results (or poll a condition) under deadlines,
never on sleeps.
"""

import asyncio
import math
import random

import msgpack
import pytest

from plexus.averaging.group_info import GroupInfo, check_group_key, make_group_key, next_group_bits
from plexus.averaging.matchmaking import JOIN_PROTOCOL, MAX_JOIN_REQUEST_SIZE, Matchmaking
from plexus.averaging.matchmaking_messages import JoinCode, JoinRequest, JoinResponse
from plexus.averaging.matchmaking_state import LeaderProtocolError, MatchmakingState, Phase
from plexus.dht.node import DHTNode
from plexus.dht.p2p_transport import HostDHTTransport
from plexus.p2p import rpc
from plexus.p2p.host import Host
from plexus.p2p.identity import PrivateKey
from plexus.p2p.messages import MessageError
from plexus.utils.timing import get_dht_time

LOCAL = ("/ip4/127.0.0.1/tcp/0",)
KEY = "test.0b"


def new_peer_id():
    return PrivateKey.generate().peer_id


def request(expiration=101.0, schema=b"s", key=KEY, gather=b"g", client=False):
    return JoinRequest(key, schema, expiration, gather, client)


# --- the state machine, without I/O ------------------------------------------------------------


def leader_state(target=4, min_size=2, declared=100.0, client=False):
    state = MatchmakingState(
        new_peer_id(), schema_hash=b"s", target_group_size=target, min_group_size=min_size, client_mode=client
    )
    state.start(KEY, b"leader")
    state.declare(declared, now=90.0)
    return state


def answer(state, peer, join_request, handle="h") -> JoinCode:
    return state.on_join_request(peer, join_request, 90, handle).join_code


def test_admission_checks_each_refusal_in_order():
    state = leader_state(target=3)
    follower = new_peer_id()
    assert answer(state, follower, request(schema=b"other")) is JoinCode.BAD_SCHEMA_HASH
    assert answer(state, follower, request(key="test.0b1")) is JoinCode.BAD_GROUP_KEY
    assert answer(state, follower, request(expiration=99.0)) is JoinCode.BAD_EXPIRATION_TIME
    accepted = state.on_join_request(follower, request(), 90, "h1")
    assert accepted.join_code is JoinCode.ACCEPTED and accepted.time_left == pytest.approx(10.0)
    assert state.on_join_request(follower, request(), 90, "h1").join_code is JoinCode.DUPLICATE_PEER_ID
    assert state.on_join_request(state.peer_id, request(), 90, "h").join_code is JoinCode.DUPLICATE_PEER_ID
    client = state.on_join_request(new_peer_id(), request(expiration=None, client=True), 90, "h2")
    assert client.join_code is JoinCode.ACCEPTED, "clients do not declare, so seniority does not apply"
    assert state.is_full and state.should_assemble(now=0.0)
    assert state.on_join_request(new_peer_id(), request(), 90, "h").join_code is JoinCode.GROUP_IS_FULL

    undeclared = MatchmakingState(new_peer_id(), schema_hash=b"s", target_group_size=4)
    assert undeclared.on_join_request(follower, request(), 0, "h").join_code is JoinCode.NOT_LOOKING_FOR_GROUP
    undeclared.start(KEY, b"")
    assert undeclared.on_join_request(follower, request(), 0, "h").join_code is JoinCode.NOT_DECLARED
    client_leader = leader_state(client=True)
    assert client_leader.key is None
    assert client_leader.on_join_request(follower, request(), 0, "h").join_code is JoinCode.NOT_DECLARED


def test_equal_times_break_ties_by_peer_id():
    state = leader_state(declared=100.0)
    other = new_peer_id()
    senior = other.to_bytes() < state.peer_id.to_bytes()
    assert answer(state, other, request(expiration=100.0)) is (
        JoinCode.BAD_EXPIRATION_TIME if senior else JoinCode.ACCEPTED
    )


def test_assembles_when_full_or_at_its_time_with_enough_peers():
    state = leader_state(target=None, min_size=3, declared=100.0)
    state.on_join_request(new_peer_id(), request(gather=b"a"), 90, "a")
    assert not state.should_assemble(now=99.0) and not state.should_assemble(now=100.0), "2 < min_group_size"
    state.on_join_request(new_peer_id(), request(gather=b"b"), 90, "b")
    assert not state.should_assemble(now=99.9) and state.should_assemble(now=100.0)
    group, notices = state.assemble(b"id", random.Random(0).shuffle)
    assert state.phase is Phase.ASSEMBLED and sorted(group.gathered) == [b"a", b"b", b"leader"]
    assert {handle for handle, _ in notices} == {"a", "b"}
    begin = notices[0][1]
    assert begin.join_code is JoinCode.BEGIN_ALLREDUCE and begin.group_id == b"id"
    assert [p.to_bytes() for p in group.peer_ids] == list(begin.peer_ids) and group.gathered == begin.gathered
    assert answer(state, new_peer_id(), request()) is JoinCode.NOT_LOOKING_FOR_GROUP


def test_redeclaring_tells_followers_the_new_wait_and_a_leader_that_follows_redirects():
    state = leader_state(target=None, declared=100.0)
    state.on_join_request(new_peer_id(), request(), 90, "a")
    ((handle, update),) = state.declare(105.0, now=100.0)
    assert handle == "a" and update.join_code is JoinCode.ACCEPTED and update.time_left == pytest.approx(5.0)
    leader = new_peer_id()
    ((handle, notice),) = state.on_accepted(leader)
    assert notice.join_code is JoinCode.GROUP_DISBANDED and notice.suggested_leader == leader.to_bytes()
    refusal = state.on_join_request(new_peer_id(), request(), 100, "b")
    assert refusal.join_code is JoinCode.NOT_A_LEADER and refusal.suggested_leader == leader.to_bytes()
    state.on_leader_lost()
    assert state.phase is Phase.LOOKING and state.group_size == 1


def test_follower_checks_the_begin_message():
    state = leader_state()
    leader = new_peer_id()
    state.on_accepted(leader)
    stranger = new_peer_id()
    without_us = JoinResponse(
        int(JoinCode.BEGIN_ALLREDUCE),
        group_id=b"x",
        peer_ids=(leader.to_bytes(), stranger.to_bytes()),
        gathered=(b"", b""),
    )
    with pytest.raises(LeaderProtocolError):
        state.on_begin(leader, without_us)
    good = JoinResponse(
        int(JoinCode.BEGIN_ALLREDUCE),
        group_id=b"x",
        peer_ids=(state.peer_id.to_bytes(), leader.to_bytes()),
        gathered=(b"leader", b"l"),
    )
    assert state.on_begin(leader, good) == GroupInfo(b"x", (state.peer_id, leader), (b"leader", b"l"))


def test_candidates_are_more_senior_peers_most_senior_first():
    state = leader_state(declared=100.0)
    a, b, c, d = (new_peer_id() for _ in range(4))
    view = {a: 99.0, b: 98.0, c: 101.0, d: math.inf, state.peer_id: 100.0}
    assert state.candidates(view) == [b, a]
    assert state.candidates(view, skip=lambda peer, t: peer == b) == [a]
    state.on_join_request(a, request(), 90, "a")
    assert state.candidates(view) == [b], "our own follower is never our leader, whatever a stale view says"
    client = leader_state(client=True)
    assert client.candidates(view) == [b, a, state.peer_id, c], "a client asks any declared peer"
    assert client.candidates({client.peer_id: 1.0}) == [], "never itself"


def test_messages_validate_every_field():
    for bad in [
        lambda: JoinRequest("no-dots-missing", b"", 1.0, b""),
        lambda: JoinRequest(KEY, b"s" * 65, 1.0, b""),
        lambda: JoinRequest(KEY, b"s", math.nan, b""),
        lambda: JoinRequest(KEY, b"s", 1.0, b"g" * (64 << 10 + 1)),
        lambda: JoinResponse(99),
        lambda: JoinResponse(int(JoinCode.ACCEPTED)),
        lambda: JoinResponse(int(JoinCode.ACCEPTED), time_left=-1.0),
        lambda: JoinResponse(int(JoinCode.GROUP_IS_FULL), suggested_leader=b"\x00\x01"),
        lambda: JoinResponse(int(JoinCode.NOT_A_LEADER), suggested_leader=b"junk"),
        lambda: JoinResponse(int(JoinCode.BEGIN_ALLREDUCE), group_id=b"x", peer_ids=(), gathered=()),
        lambda: JoinResponse(
            int(JoinCode.BEGIN_ALLREDUCE), group_id=b"", peer_ids=(new_peer_id().to_bytes(),), gathered=(b"",)
        ),
        lambda: JoinResponse(int(JoinCode.GROUP_IS_FULL), group_id=b"x"),
    ]:
        with pytest.raises(ValueError):
            bad()
    peer = new_peer_id().to_bytes()
    with pytest.raises(MessageError, match="twice"):
        JoinResponse.decode(msgpack.packb([1, None, None, b"x", [peer, peer], [b"", b""], ""]))
    message = request(expiration=None, client=True)
    assert JoinRequest.decode(message.encode()) == message


def test_garbage_bytes_never_decode_into_a_bad_request():
    rng = random.Random(1)
    valid = request().encode()
    for _ in range(2000):
        data = bytearray(valid)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            JoinRequest.decode(bytes(data))
        except (MessageError, ValueError):
            continue


def test_group_keys_and_bits():
    assert make_group_key("mnist", "01") == "mnist.0b01" and check_group_key("mnist.0b01") == ("mnist", "01")
    for bad in ["a.b.0b1", "mnist.0b2", "mnist", ".0b1"]:
        with pytest.raises(ValueError):
            check_group_key(bad)
    peers = tuple(new_peer_id() for _ in range(4))
    group = GroupInfo(b"some group", peers, (b"",) * 4)
    assert next_group_bits("", group, peers[0], 4) == ""
    bits = [next_group_bits("0110", group, peer, 4) for peer in peers]
    assert len(set(bits)) == 4 and all(len(b) == 4 and b.startswith("10") for b in bits), "distinct buckets"
    assert bits == [next_group_bits("0110", group, peer, 4) for peer in peers], "deterministic"


# --- swarms of real hosts -----------------------------------------------------------------------


class Swarm:
    """N hosts with DHT nodes in this event loop; `matchmakers()` adds one Matchmaking per peer."""

    def __init__(self):
        self.hosts, self.nodes, self.matchmakers = [], [], []

    @classmethod
    async def create(cls, n: int, clients: int = 0) -> "Swarm":
        self = cls()
        first = await Host(host_maddrs=LOCAL).start()
        self.hosts.append(first)
        self.nodes.append(await DHTNode.create(rpc=HostDHTTransport(first)))
        first_addr = first.get_visible_maddrs()[0]

        async def join(client: bool):
            host = await Host(host_maddrs=() if client else LOCAL).start()
            await host.connect(first_addr)
            node = await DHTNode.create(
                initial_peers=[first.peer_id], rpc=HostDHTTransport(host), client_mode=client
            )
            return host, node

        for host, node in await asyncio.gather(*(join(i >= n - 1) for i in range(n - 1 + clients))):
            self.hosts.append(host)
            self.nodes.append(node)
        return self

    def add_matchmakers(self, indices=None, prefix="test", **options) -> list[Matchmaking]:
        options = {
            "schema_hash": b"s",
            "target_group_size": None,
            "min_matchmaking_time": 1.0,
            "request_timeout": 1.0,
            **options,
        }
        created = []
        for i in range(len(self.hosts)) if indices is None else indices:
            client = self.nodes[i].client_mode
            created.append(
                Matchmaking(self.hosts[i], self.nodes[i], prefix=prefix, client_mode=client, **options)
            )
        self.matchmakers.extend(created)
        return created

    async def close(self) -> None:
        for matchmaking in self.matchmakers:
            await matchmaking.shutdown()
        for node in self.nodes:
            await node.shutdown()
        for host in self.hosts:
            await host.shutdown()


def run(main, timeout: float):
    async def wrapper():
        async with asyncio.timeout(timeout):
            await main()

    asyncio.run(wrapper())


def gather_of(matchmaking) -> bytes:
    return b"gather of " + matchmaking.peer_id.to_bytes()[-8:]


async def look(matchmakers, timeout: float, **kwargs):
    """Every matchmaker looks at once; returns (results, seconds until each returned)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = started + timeout

    async def one(matchmaking):
        group = await matchmaking.look_for_group(gather=gather_of(matchmaking), deadline=deadline, **kwargs)
        return group, loop.time() - started

    outcomes = await asyncio.gather(*(one(m) for m in matchmakers))
    return [g for g, _ in outcomes], [t for _, t in outcomes]


def check_groups(matchmakers, results) -> list[GroupInfo]:
    """Every member of a group holds the same GroupInfo, groups are disjoint, gathers line up."""
    groups = {}
    gathers = {m.peer_id: gather_of(m) for m in matchmakers}
    for matchmaking, group in zip(matchmakers, results):
        if group is None:
            continue
        assert matchmaking.peer_id in group.peer_ids
        assert groups.setdefault(group.group_id, group) == group, "members disagree on their group"
    seen = set()
    for group in groups.values():
        assert not seen & set(group.peer_ids), "a peer is in two groups"
        seen |= set(group.peer_ids)
        assert [gathers[p] for p in group.peer_ids] == list(group.gathered)
        members = [r for m, r in zip(matchmakers, results) if m.peer_id in group.peer_ids]
        assert len(members) == group.group_size and all(r == group for r in members)
    return list(groups.values())


async def wait_until(condition, timeout: float) -> None:
    """Poll a condition under a deadline (a test helper: waiting on state we cannot await)."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.timeout(60)
def test_peers_starting_together_form_exactly_one_group(n):
    async def main():
        swarm = await Swarm.create(n)
        try:
            matchmakers = swarm.add_matchmakers(min_matchmaking_time=1.5)
            results, times = await look(matchmakers, timeout=10)
            groups = check_groups(matchmakers, results)
            assert len(groups) == 1 and groups[0].group_size == n, f"expected one group of {n}, got {groups}"
            leaders = {m.last_leader for m in matchmakers}
            assert len(leaders) == 1 and leaders <= {m.peer_id for m in matchmakers}
            print(
                f"\n{n} peers, no target size: one group after {max(times):.3f} s "
                f"(min_matchmaking_time 1.5 s)"
            )
        finally:
            await swarm.close()

    run(main, 50)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.timeout(60)
def test_a_full_group_forms_at_once_without_waiting_out_the_clock(n):
    async def main():
        swarm = await Swarm.create(n)
        try:
            # min_matchmaking_time far past the deadline: a group that waited for it would be None
            matchmakers = swarm.add_matchmakers(target_group_size=n, min_matchmaking_time=600.0)
            samples = []
            for _ in range(3):
                results, times = await look(matchmakers, timeout=10)
                groups = check_groups(matchmakers, results)
                assert len(groups) == 1 and groups[0].group_size == n
                samples.append(max(times))
            print(
                f"\n{n} peers, target {n}: group formed in "
                + ", ".join(f"{t * 1000:.0f} ms" for t in samples)
            )
        finally:
            await swarm.close()

    run(main, 50)


@pytest.mark.timeout(60)
def test_when_all_peers_are_waiting_the_last_arrival_completes_the_group_at_once():
    async def main():
        n = 8
        swarm = await Swarm.create(n)
        try:
            matchmakers = swarm.add_matchmakers(target_group_size=n, min_matchmaking_time=600.0)
            loop = asyncio.get_running_loop()
            samples = []
            for _ in range(3):
                deadline = loop.time() + 10
                waiting = [
                    loop.create_task(m.look_for_group(gather=gather_of(m), deadline=deadline))
                    for m in matchmakers[:-1]
                ]
                await wait_until(lambda: any(len(m._state.followers) == n - 2 for m in matchmakers), 5)
                started, last = loop.time(), matchmakers[-1]
                last = await last.look_for_group(gather=gather_of(last), deadline=deadline)
                results = await asyncio.gather(*waiting) + [last]
                samples.append(loop.time() - started)
                groups = check_groups(matchmakers, results)
                assert len(groups) == 1 and groups[0].group_size == n
            print(
                f"\n{n} peers waiting, the last arrives: everyone has the group after "
                + ", ".join(f"{t * 1000:.0f} ms" for t in samples)
            )
        finally:
            await swarm.close()

    run(main, 50)


@pytest.mark.timeout(60)
def test_eight_peers_with_target_four_form_two_disjoint_groups_quickly():
    async def main():
        swarm = await Swarm.create(8)
        try:
            matchmakers = swarm.add_matchmakers(target_group_size=4, min_matchmaking_time=600.0)
            results, times = await look(matchmakers, timeout=10)
            groups = check_groups(matchmakers, results)
            assert sorted(g.group_size for g in groups) == [4, 4], groups
            print(f"\n8 peers, target 4: two groups after {max(times) * 1000:.0f} ms")
        finally:
            await swarm.close()

    run(main, 50)


@pytest.mark.timeout(30)
def test_too_few_peers_get_none_at_their_deadline():
    async def main():
        swarm = await Swarm.create(3)
        try:
            (lone,) = swarm.add_matchmakers([0], prefix="lone", min_matchmaking_time=0.0, request_timeout=0.3)
            stores = []
            original_store = swarm.nodes[0].store

            async def counting_store(*args, **kwargs):
                stores.append(args)
                return await original_store(*args, **kwargs)

            swarm.nodes[0].store = counting_store
            results, times = await look([lone], timeout=1.5)
            assert results == [None] and 1.45 <= times[0] < 2.5
            assert len(stores) <= 1.5 / 0.3 + 2, "re-declarations must be spaced out, even with no min time"
            pair = swarm.add_matchmakers([1, 2], prefix="pair", min_group_size=3, min_matchmaking_time=0.3)
            results, times = await look(pair, timeout=1.5)
            assert results == [None, None] and all(1.45 <= t < 2.5 for t in times)
        finally:
            await swarm.close()

    run(main, 25)


@pytest.mark.timeout(40)
def test_with_alone_timeout_a_round_gives_up_when_nobody_else_looks_but_never_while_someone_does():
    async def main():
        swarm = await Swarm.create(4)
        try:
            options = dict(min_matchmaking_time=0.5, request_timeout=0.5)
            (lone,) = swarm.add_matchmakers([0], prefix="lone", **options)
            results, times = await look([lone], timeout=20, alone_timeout=0.0)
            assert results == [None] and lone.last_round_alone and times[0] < 10, (
                "gave up long before the deadline"
            )

            # a peer that arrives after the first one declared is waited for
            first, second = swarm.add_matchmakers([1, 2], prefix="pair", **options)
            early = asyncio.ensure_future(look([first], timeout=20, alone_timeout=0.0))
            await wait_until(lambda: first.peer_id in first._view, timeout=5)
            late, _ = await look([second], timeout=20, alone_timeout=0.0)
            (result, *_), _ = await early
            assert result is not None and late == [result] and not first.last_round_alone

            # a peer that died after declaring (no withdrawal) is not waited for beyond its declaration
            survivor, victim = swarm.add_matchmakers([3, 0], prefix="dead", **options)
            loop = asyncio.get_running_loop()
            dying = loop.create_task(victim.look_for_group(gather=b"v", deadline=loop.time() + 20))
            await wait_until(lambda: victim.peer_id in victim._view, timeout=5)
            await swarm.hosts[0].shutdown()
            dying.cancel()
            await asyncio.gather(dying, return_exceptions=True)
            results, times = await look([survivor], timeout=20, alone_timeout=0.0)
            assert results == [None] and survivor.last_round_alone and times[0] < 10
        finally:
            await swarm.close()

    run(main, 35)


def test_a_leader_takes_only_followers_of_its_own_round():
    state = MatchmakingState(new_peer_id(), schema_hash=b"s", target_group_size=4)
    state.start(KEY, b"leader", round_tag=b"epoch 7")
    state.declare(100.0, now=90.0)
    other_round = JoinRequest(KEY, b"s", 101.0, b"g", round_tag=b"epoch 8")
    assert state.on_join_request(new_peer_id(), other_round, 90, "h").join_code is JoinCode.BAD_GROUP_KEY
    same_round = JoinRequest(KEY, b"s", 101.0, b"g", round_tag=b"epoch 7")
    assert state.on_join_request(new_peer_id(), same_round, 90, "h").join_code is JoinCode.ACCEPTED
    assert JoinRequest.decode(same_round.encode()) == same_round
    with pytest.raises(ValueError):
        JoinRequest(KEY, b"s", 1.0, b"", round_tag=b"t" * 65)


@pytest.mark.timeout(40)
def test_rounds_with_different_tags_never_meet():
    async def main():
        swarm = await Swarm.create(4)
        try:
            matchmakers = swarm.add_matchmakers(min_matchmaking_time=1.0, request_timeout=0.5)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 6

            async def one(matchmaking, tag):
                return await matchmaking.look_for_group(
                    gather=gather_of(matchmaking), deadline=deadline, round_tag=tag
                )

            tags = [b"epoch 1", b"epoch 2", b"epoch 1", b"epoch 2"]
            results = await asyncio.gather(*(one(m, tag) for m, tag in zip(matchmakers, tags)))
            groups = check_groups(matchmakers, results)
            assert sorted(
                sorted(
                    matchmakers.index(next(m for m in matchmakers if m.peer_id == p)) for p in group.peer_ids
                )
                for group in groups
            ) == [[0, 2], [1, 3]]
        finally:
            await swarm.close()

    run(main, 35)


@pytest.mark.timeout(60)
def test_a_late_peer_still_gets_in_while_the_leader_waits():
    async def main():
        swarm = await Swarm.create(4)
        try:
            matchmakers = swarm.add_matchmakers(min_matchmaking_time=3.0)
            early = asyncio.ensure_future(look(matchmakers[:3], timeout=10))
            await wait_until(lambda: any(len(m._state.followers) == 2 for m in matchmakers[:3]), timeout=5)
            late_results, _ = await look(matchmakers[3:], timeout=10)
            results, _ = await early
            groups = check_groups(matchmakers, results + late_results)
            assert len(groups) == 1 and groups[0].group_size == 4
        finally:
            await swarm.close()

    run(main, 50)


@pytest.mark.timeout(60)
def test_followers_of_a_dead_leader_regroup_before_their_deadline():
    async def main():
        swarm = await Swarm.create(5)
        try:
            matchmakers = swarm.add_matchmakers(min_matchmaking_time=2.0, request_timeout=0.5)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 8
            tasks = [
                loop.create_task(m.look_for_group(gather=gather_of(m), deadline=deadline))
                for m in matchmakers
            ]
            await wait_until(lambda: any(len(m._state.followers) == 4 for m in matchmakers), timeout=5)
            dead = next(i for i, m in enumerate(matchmakers) if len(m._state.followers) == 4)
            tasks[dead].cancel()
            await swarm.hosts[dead].shutdown()
            alive = [i for i in range(5) if i != dead]
            results = await asyncio.gather(*(tasks[i] for i in alive))
            assert loop.time() < deadline + 0.5, "followers must give up by their deadline"
            survivors = [matchmakers[i] for i in alive]
            for matchmaking, group in zip(survivors, results):
                if group is not None:
                    assert matchmakers[dead].peer_id not in group.peer_ids
                    assert group.gathered[group.peer_ids.index(matchmaking.peer_id)] == gather_of(matchmaking)
            groups = {g.group_id: g for g in results if g is not None}
            assert len(groups) == 1 and list(groups.values())[0].group_size == 4, "the four survivors regroup"
        finally:
            await swarm.close()

    run(main, 50)


@pytest.mark.timeout(60)
def test_client_mode_peers_join_a_normal_leader_and_never_lead_or_declare():
    async def main():
        swarm = await Swarm.create(2, clients=3)
        try:
            matchmakers = swarm.add_matchmakers(target_group_size=5, min_matchmaking_time=600.0)
            normal = {m.peer_id for m in matchmakers if not m.client_mode}
            assert len(normal) == 2
            results, _times = await look(matchmakers, timeout=10)
            groups = check_groups(matchmakers, results)
            assert len(groups) == 1 and groups[0].group_size == 5
            assert {m.last_leader for m in matchmakers} <= normal
            bucket = await swarm.nodes[0].get(KEY, latest=True)
            assert set(bucket.value) <= {p.to_bytes() for p in normal}, "clients never declare themselves"

            only_clients = [m for m in matchmakers if m.client_mode]
            results, _ = await look(only_clients, timeout=1.0)
            assert results == [None, None, None], "clients alone never form a group"
        finally:
            await swarm.close()

    run(main, 50)


@pytest.mark.parametrize("target", [None, 4])
@pytest.mark.timeout(60)
def test_clock_skew_of_two_seconds_still_forms_one_group(target):
    async def main():
        swarm = await Swarm.create(4)
        try:
            matchmakers = []
            for i, skew in enumerate([2.0, -2.0, 0.0, 2.0]):
                matchmakers += swarm.add_matchmakers(
                    [i],
                    # with a target, the full group forms at once, long before a minimum time that
                    # outlasts the deadline; without one, the group forms when the minimum time is up
                    min_matchmaking_time=3.0 if target is None else 600.0,
                    target_group_size=target,
                    clock=lambda skew=skew: get_dht_time() + skew,
                )
            results, _times = await look(matchmakers, timeout=10)
            groups = check_groups(matchmakers, results)
            assert len(groups) == 1 and groups[0].group_size == 4
        finally:
            await swarm.close()

    run(main, 50)


@pytest.mark.timeout(60)
def test_garbage_join_requests_get_refusals_and_the_leader_keeps_working():
    async def main():
        swarm = await Swarm.create(4)
        try:
            matchmakers = swarm.add_matchmakers([0, 1, 2], min_matchmaking_time=1.5)
            intruder = swarm.hosts[3]
            lookers = asyncio.ensure_future(look(matchmakers, timeout=10))
            await wait_until(lambda: all(m._state.phase is not Phase.IDLE for m in matchmakers), timeout=5)

            async def ask(peer, payload):
                return [
                    r
                    async for r in rpc.call_stream(
                        intruder, peer, JOIN_PROTOCOL, payload, JoinResponse, timeout=5
                    )
                ]

            for target in matchmakers:
                peer = target.peer_id
                truncated = b"\x95\xa7test.0b\xc4\x01s\xcb" + b"\x00" * 3
                for garbage in [b"", b"\xc1", b"\x93\x01\x02\x03", truncated]:
                    (answer,) = await ask(peer, garbage)
                    assert answer.join_code is JoinCode.PROTOCOL_VIOLATION, (garbage, answer)
                (answer,) = await ask(peer, request(schema=b"wrong").encode())
                assert answer.join_code is JoinCode.BAD_SCHEMA_HASH
                (answer,) = await ask(peer, request(key="other.0b").encode())
                assert answer.join_code is JoinCode.BAD_GROUP_KEY and "no averager" in answer.reason
                with pytest.raises(rpc.RPCError, match="exceeds"):
                    await ask(peer, b"\x00" * (MAX_JOIN_REQUEST_SIZE + 1))
            results, _ = await lookers
            groups = check_groups(matchmakers, results)
            assert len(groups) == 1 and groups[0].group_size == 3
        finally:
            await swarm.close()

    run(main, 50)


@pytest.mark.timeout(60)
def test_one_host_serves_several_prefixes():
    async def main():
        swarm = await Swarm.create(3)
        try:
            first = swarm.add_matchmakers(prefix="alpha", target_group_size=3, min_matchmaking_time=3.0)
            second = swarm.add_matchmakers(prefix="beta", target_group_size=3, min_matchmaking_time=3.0)
            with pytest.raises(ValueError, match="already runs matchmaking"):
                Matchmaking(
                    swarm.hosts[0], swarm.nodes[0], prefix="alpha", schema_hash=b"", target_group_size=2
                )
            (a, _), (b, _) = await asyncio.gather(look(first, timeout=10), look(second, timeout=10))
            assert len(check_groups(first, a)) == 1 and len(check_groups(second, b)) == 1
            assert a[0].group_id != b[0].group_id
        finally:
            await swarm.close()

    run(main, 50)
