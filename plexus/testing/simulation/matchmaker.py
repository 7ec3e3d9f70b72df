"""Matchmaking in the simulator: Plexus's `MatchmakingState`, driven as `Matchmaking` drives it.

The core (matchmaking_state.py: who may join whom, when a leader assembles, what followers are
told) runs unchanged, and so do the group keys and `next_group_bits` of group_info.py. What is
reproduced here from the asyncio driver (averaging/matchmaking.py), in callbacks: declaring our
time T in the DHT under the group key (a real store through the simulated DHT), reading the
bucket with `get(latest=True)` (first once our declaration landed, then at intervals doubling from
50 ms to `min(1 s, max(0.1 s, min_matchmaking_time / 5))` while nothing changes), asking the most
senior candidate to take us in, following redirects, refusing peers for a while after they
refused us, waiting for our leader's BEGIN, declaring a later time when ours passed without
enough peers, and withdrawing the declaration after the round. A join stream becomes messages:
the JoinRequest and its first answer are a call with `request_timeout`; the leader's later
notices are one-way messages; a follower that gives up says so (`Left`), as closing its stream
does. A group whose BEGIN reached a member that had already given up is counted as broken.
"""

import dataclasses
import math

from ...averaging.group_info import GroupInfo, make_group_key, next_group_bits
from ...averaging.matchmaking_messages import JoinCode, JoinRequest, JoinResponse
from ...averaging.matchmaking_state import MatchmakingState, Phase
from ...dht.routing import DHTID
from ...dht.storage import DictionaryDHTValue
from ...p2p.identity import PeerID

SCHEMA_HASH = b"simulated-schema"
FIRST_POLL_INTERVAL = 0.05
MAX_REDIRECTS = 16
MESSAGE_SIZE = 160  # bytes of a JoinRequest or JoinResponse on the wire, roughly
DECLARED, WITHDRAWN = b"\xc3", b"\xc2"  # msgpack True and False, the values of a bucket entry
SHORT_REFUSALS = {
    JoinCode.NOT_A_LEADER,
    JoinCode.GROUP_DISBANDED,
    JoinCode.NOT_DECLARED,
    JoinCode.DUPLICATE_PEER_ID,
    JoinCode.PROTOCOL_VIOLATION,
}


@dataclasses.dataclass(frozen=True)
class Left:
    """A follower gave up on its leader (in the real protocol: it closed the join stream)."""


@dataclasses.dataclass
class MatchmakingOptions:
    """As `DecentralizedAverager` takes them. Times in seconds."""

    target_group_size: int | None = 16
    min_group_size: int = 2
    min_matchmaking_time: float = 5.0
    request_timeout: float = 3.0
    averaging_timeout: float = 30.0
    """How long one round may look for a group (the deadline of `look_for_group`)."""
    prefix: str = "sim"


@dataclasses.dataclass
class Round:
    """What one `look_for_group` came to."""

    started: float
    seconds: float
    group_size: int  # 0: no group by the deadline
    led: bool


class SimMatchmaker:
    """One peer's matchmaking over its SimDHTNode (see the module docstring)."""

    def __init__(self, node, options: MatchmakingOptions, group_bits: str, registry: dict):
        self.node, self.sim, self.internet = node, node.sim, node.internet
        self.options, self.group_bits, self.registry = options, group_bits, registry
        self.peer_id: PeerID = node.peer_id
        self.state = MatchmakingState(
            self.peer_id,
            schema_hash=SCHEMA_HASH,
            target_group_size=options.target_group_size,
            min_group_size=options.min_group_size,
        )
        self.max_poll = min(1.0, max(0.1, options.min_matchmaking_time / 5))
        self.round = 0
        self.over = True
        node.services[JoinRequest] = self._serve_join
        node.services[JoinResponse] = self._notice
        node.services[Left] = self._follower_left

    # --- one round --------------------------------------------------------------------------------

    def look_for_group(self, on_done) -> None:
        """Run one round; `on_done(Round)` when it has a group or its deadline passed."""
        o, now = self.options, self.sim.now
        self.round += 1
        self.over, self.on_done, self.started = False, on_done, now
        self.deadline = now + o.averaging_timeout
        self.key = make_group_key(o.prefix, self.group_bits)
        self.key_id = DHTID.generate(source=self.key)
        self.view: dict[PeerID, float] = {}
        self.refused: dict[PeerID, tuple[float | None, float]] = {}
        self.declared_until = None
        self.asking = self.following = self.suggestion = None
        self.redirects, self.timer, self.follow_timer = 0, None, None
        self.poll_interval, self.polling, self.poll_event = FIRST_POLL_INTERVAL, False, None
        self.state.start(self.key, b"")
        self._declare(o.min_matchmaking_time)
        self.poll_event = self.sim.after(o.request_timeout, self._poll)  # or sooner, once declared
        self.sim.at(self.deadline, self._advance)
        self._advance()

    def _finish(self, group: GroupInfo | None) -> None:
        self.over = True
        for event in (self.timer, self.follow_timer, self.poll_event):
            if event is not None:
                event.cancel()
        if self.following is not None:
            self._send(self.following, Left())
        if self.state.phase in (Phase.LOOKING, Phase.FOLLOWING):
            self._deliver(self.state.stop("the round ended"))
        if self.declared_until is not None:  # withdraw, in the background
            self.node.store(
                self.key_id,
                WITHDRAWN,
                math.nextafter(self.declared_until, math.inf),
                lambda *_: None,
                subkey=self.peer_id.to_bytes(),
            )
        led = group is not None and self.state.leader == self.peer_id
        if group is not None:
            target = self.options.target_group_size
            self.group_bits = next_group_bits(self.group_bits, group, self.peer_id, target)
        self.on_done(Round(self.started, self.sim.now - self.started, group.group_size if group else 0, led))

    def _advance(self) -> None:
        """The matcher's loop body: run whenever something changed (an answer, a view, a timer)."""
        if self.over or not self.node.alive:
            return
        now, state = self.sim.now, self.state
        if now >= self.deadline:
            self._finish(None)
            return
        if state.should_assemble(now):
            self._assemble()
            return
        if self.asking is None and self.following is None:  # else the answer or its timeout wakes us
            if state.declared is not None and now >= state.declared and self._extend():
                return
            leader, self.suggestion = self.suggestion, None
            if leader is None:
                leader = next(iter(state.candidates(self.view, self._skip)), None)
            if leader is not None:
                self._ask(leader)
        if self.timer is not None:
            self.timer.cancel()
        wake = (
            self.deadline
            if state.declared is None or now >= state.declared
            else min(self.deadline, state.declared)
        )
        self.timer = self.sim.at(wake, self._advance)

    def _assemble(self) -> None:
        group, notices = self.state.assemble(self.node.swarm.rng.randbytes(20), self.node.swarm.rng.shuffle)
        self.registry[group.group_id] = {"size": group.group_size, "joined": 1, "broken": False}
        self._deliver(notices)
        self._finish(group)

    # --- the DHT ----------------------------------------------------------------------------------

    def _declare(self, wait: float) -> None:
        o, now = self.options, self.sim.now
        expiration = min(now + max(wait, o.request_timeout), self.deadline)
        self._deliver(self.state.declare(expiration, now))
        self.declared_until = max(self.declared_until or expiration, expiration)
        this_round = self.round

        def stored(ok: bool, _) -> None:
            if self.round != this_round or self.over:
                return
            self._poll_soon()
            if not ok and self.state.phase is Phase.LOOKING and self.state.declared == expiration:
                self._deliver(self.state.declare(None, self.sim.now))  # nobody can see us: join others
                self._advance()

        self.node.store(self.key_id, DECLARED, expiration, stored, subkey=self.peer_id.to_bytes())

    def _extend(self) -> bool:
        old = self.state.declared
        if (
            min(
                self.sim.now + max(self.options.min_matchmaking_time, self.options.request_timeout),
                self.deadline,
            )
            <= old + 1e-3
        ):
            return False
        self._declare(self.options.min_matchmaking_time)
        self._advance()
        return True

    def _poll_soon(self) -> None:
        if not self.polling and not self.over:
            if self.poll_event is not None:
                self.poll_event.cancel()
            self._poll()

    def _poll(self) -> None:
        if self.over or not self.node.alive:
            return
        if self.state.phase is Phase.FOLLOWING:
            self.poll_event = self.sim.after(self.poll_interval, self._poll)
            return
        self.polling, started, this_round = True, self.sim.now, self.round

        def read(found, _) -> None:
            if self.round != this_round or self.over:
                return
            self.polling = False
            view = None
            if self.sim.now - started <= self.options.request_timeout:  # else read_bucket timed out
                view = {}
                if found is not None and isinstance(found.value, DictionaryDHTValue):
                    view = {
                        PeerID(subkey): entry.expiration_time
                        for subkey, entry in found.value.items(self.sim.now)
                        if entry.value == DECLARED
                    }
            if view is not None and view != self.view:
                self.view, self.poll_interval = view, FIRST_POLL_INTERVAL
                self._advance()
            else:
                self.poll_interval = min(2 * self.poll_interval, self.max_poll)
            self.poll_event = self.sim.after(self.poll_interval, self._poll)

        self.node.get(self.key_id, read, latest=True)

    # --- asking leaders ---------------------------------------------------------------------------

    def _skip(self, peer: PeerID, declared: float | None = None) -> bool:
        if peer == self.peer_id:
            return True
        refused = self.refused.get(peer)
        if refused is None:
            return False
        if declared is None:
            declared = self.view.get(peer)
        return declared == refused[0] and self.sim.now < refused[1]

    def _refuse(self, peer: PeerID, short: bool) -> None:
        until = self.sim.now + self.options.request_timeout if short else math.inf
        self.refused[peer] = (self.view.get(peer), until)

    def _ask(self, leader: PeerID) -> None:
        self.asking, this_round = leader, self.round
        request = JoinRequest(self.state.group_key, SCHEMA_HASH, self.state.declared, b"", False)
        timeout = max(0.0, min(self.options.request_timeout, self.deadline - self.sim.now))

        def answered(response: JoinResponse | None) -> None:
            if self.round != this_round or self.over or self.asking != leader:
                if response is not None and response.join_code is JoinCode.ACCEPTED:
                    self._send(leader, Left())  # we stopped asking meanwhile: close that stream
                return
            self.asking = None
            if response is None or response.join_code is not JoinCode.ACCEPTED:
                code = response.join_code if response is not None else None
                self._refuse(leader, short=code in SHORT_REFUSALS)
                suggested = response.suggested_leader if response is not None else None
                follow = suggested is not None and self.redirects < MAX_REDIRECTS
                if follow and not self._skip(PeerID(suggested)):
                    self.suggestion, self.redirects = PeerID(suggested), self.redirects + 1
                else:
                    self.redirects = 0
                self._advance()
                return
            self._deliver(self.state.on_accepted(leader))
            self.following = leader
            self._wait_for_leader(response.time_left)

        target = self.node.swarm.peers_by_id[leader]
        self.internet.call(self.node.peer, target, (self.peer_id, request), MESSAGE_SIZE, timeout, answered)

    def _wait_for_leader(self, time_left: float) -> None:
        if self.follow_timer is not None:
            self.follow_timer.cancel()
        until = min(self.deadline, self.sim.now + time_left + self.options.request_timeout)
        self.follow_timer = self.sim.at(until, self._leader_lost, None)

    def _notice(self, sender: PeerID, response: JoinResponse, reply) -> None:
        """A leader's later message on our join stream."""
        if self.over or sender != self.following:
            if response.join_code is JoinCode.BEGIN_ALLREDUCE:
                record = self.registry.get(response.group_id)
                if record is not None:
                    record["broken"] = True  # it counts on us, and we are gone
            return
        code = response.join_code
        if code is JoinCode.ACCEPTED:
            self._wait_for_leader(response.time_left)
        elif code is JoinCode.BEGIN_ALLREDUCE:
            group = self.state.on_begin(sender, response)
            self.registry[group.group_id]["joined"] += 1
            self.following = None
            self._finish(group)
        else:
            self._leader_lost(response.suggested_leader)

    def _leader_lost(self, suggested: bytes | None) -> None:
        if self.over or self.following is None:
            return
        leader, self.following = self.following, None
        if self.follow_timer is not None:
            self.follow_timer.cancel()
        self._send(leader, Left())
        self.state.on_leader_lost()
        self._refuse(leader, short=suggested is not None)
        if suggested is not None:
            self.suggestion = PeerID(suggested)
        self._poll_soon()
        self._advance()

    # --- serving followers ------------------------------------------------------------------------

    def _serve_join(self, sender: PeerID, request: JoinRequest, reply) -> None:
        response = self.state.on_join_request(sender, request, self.sim.now, sender)
        reply(response, MESSAGE_SIZE)
        if response.join_code is JoinCode.ACCEPTED:
            self._advance()

    def _follower_left(self, sender: PeerID, message: Left, reply) -> None:
        if self.state.on_follower_left(sender):
            self._advance()

    def _deliver(self, notices) -> None:
        for follower, response in notices:
            self._send(follower, response)

    def _send(self, peer: PeerID, message) -> None:
        target = self.node.swarm.peers_by_id[peer]
        self.internet.send(self.node.peer, target, (self.peer_id, message), MESSAGE_SIZE)


class MatchmakingSwarm:
    """`peers` peers of a DHT swarm (no churn, no other workload) looking for groups, round after
    round: each starts at a random moment within `start_spread`, and after a group spends
    `allreduce_time` averaging before it looks again (at once after a round without a group).
    With `group_bits` > 0 each peer starts in a random one of 2**group_bits buckets."""

    def __init__(
        self,
        swarm,
        options: MatchmakingOptions,
        group_bits: int = 0,
        start_spread: float = 5.0,
        allreduce_time: float = 10.0,
    ):
        self.swarm, self.options = swarm, options
        self.start_spread, self.allreduce_time = start_spread, allreduce_time
        self.registry: dict[bytes, dict] = {}
        self.rounds: list[Round] = []
        rng = swarm.rng
        self.matchmakers = [
            SimMatchmaker(node, options, "".join(rng.choice("01") for _ in range(group_bits)), self.registry)
            for node in swarm.online.values()
            if node not in swarm.bootstrap
        ]

    def start(self) -> None:
        for matchmaker in self.matchmakers:
            self.swarm.sim.after(self.swarm.rng.uniform(0, self.start_spread), self._look, matchmaker)

    def _look(self, matchmaker: SimMatchmaker) -> None:
        def done(result: Round) -> None:
            self.rounds.append(result)
            self.swarm.sim.after(self.allreduce_time if result.group_size else 0.0, self._look, matchmaker)

        matchmaker.look_for_group(done)
