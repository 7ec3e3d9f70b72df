"""The matchmaking state machine of one peer, without I/O: who may join us, whom we ask, when we assemble.

Theory of operation (protocol shape: hivemind reference, section 5, "Matchmaking"; Moshpit SGD).

Every non-client peer declares itself in the DHT under its group key with a declared time `T`
(DHT time by its own clock: when it means to assemble if it leads). Declarations are totally
ordered by the key `(T, peer id bytes)`; smaller is more senior. A peer asks to join only peers
more senior than itself, and a leader accepts only requests from less senior peers, so every
accepted edge points down the order and joins can never form a cycle. Everyone who sees the
same declarations asks the same most senior peer first, which is how simultaneous starters end
up in one group instead of several.

    phase       what we do                                        leaves by
    IDLE        refuse everyone (NOT_LOOKING_FOR_GROUP)           start() -> LOOKING
    LOOKING     accept followers; ask more senior peers           on_accepted() -> FOLLOWING
                                                                  assemble() -> ASSEMBLED
                                                                  stop() -> IDLE
    FOLLOWING   refuse with NOT_A_LEADER(our leader); wait for    on_begin() -> ASSEMBLED
                its BEGIN                                         on_leader_lost() -> LOOKING
    ASSEMBLED   refuse everyone (NOT_LOOKING_FOR_GROUP)           start() -> LOOKING

A LOOKING peer is a leader and a candidate follower at once: when a more senior peer accepts
it, it redirects its own followers there (GROUP_DISBANDED with a suggested leader). A leader
assembles as soon as it holds `target_group_size` peers, or when its own clock reaches `T` with
at least `min_group_size`; otherwise the driver declares a later `T` and followers hear the new
wait as a repeated ACCEPTED. Time enters only as `now` arguments, the leader's own clock, so
skew between peers shifts who leads but never whether a group forms; followers learn how long to
wait as a duration (`time_left`), never as a foreign timestamp.

The driver owns "handles": opaque objects naming one accepted join stream. Notices for
followers come back as (handle, JoinResponse) pairs for the driver to deliver. Left out here: the
DHT (declaring, reading), timers, streams; see `matchmaking.py`.
"""

import enum
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..errors import PeerMisbehaved, PlexusError
from ..p2p.identity import PeerID
from .group_info import GroupInfo
from .matchmaking_messages import MAX_GROUP_SIZE, JoinCode, JoinRequest, JoinResponse

Notice = tuple[object, JoinResponse]


class Phase(enum.Enum):
    IDLE = "idle"
    LOOKING = "looking"
    FOLLOWING = "following"
    ASSEMBLED = "assembled"


class MatchmakingStateError(PlexusError, RuntimeError):
    """Our own driver called the state machine in a phase where that makes no sense (a bug here)."""


class LeaderProtocolError(PeerMisbehaved, ValueError):
    """The leader sent an answer that cannot be right (e.g. a group without us); drop that leader."""


@dataclass
class _Follower:
    peer_id: PeerID
    gather: bytes
    handle: object


class MatchmakingState:
    """One peer's view of the join protocol; see the module comment."""

    def __init__(
        self,
        peer_id: PeerID,
        *,
        schema_hash: bytes,
        target_group_size: int | None,
        min_group_size: int = 2,
        client_mode: bool = False,
    ):
        if target_group_size is not None and not 1 <= target_group_size <= MAX_GROUP_SIZE:
            raise ValueError(f"target_group_size must be within [1, {MAX_GROUP_SIZE}] or None")
        if not 1 <= min_group_size <= (target_group_size or MAX_GROUP_SIZE):
            raise ValueError(f"min_group_size must be within [1, target_group_size], got {min_group_size}")
        self.peer_id, self.schema_hash, self.client_mode = peer_id, schema_hash, client_mode
        self.target_group_size, self.min_group_size = target_group_size, min_group_size
        self.phase = Phase.IDLE
        self.group_key: str | None = None
        self.expected_group_size: int | None = None
        self.round_tag = b""
        self.gather = b""
        self.declared: float | None = None
        self.leader: PeerID | None = None
        self._followers: dict[PeerID, _Follower] = {}

    # --- our own round ------------------------------------------------------------------------

    def start(
        self, group_key: str, gather: bytes, expected_group_size: int | None = None, round_tag: bytes = b""
    ) -> None:
        """Begin a round of matchmaking under `group_key`.

        `expected_group_size`: how many peers the caller knows will look for this round (e.g. the
        Optimizer's trainers); the group does not form early, before our declared time, with fewer.
        `round_tag`: we take only followers that ask for the same round (e.g. the same epoch).
        """
        self._require(Phase.IDLE, Phase.ASSEMBLED)
        self.phase, self.group_key, self.gather = Phase.LOOKING, group_key, gather
        self.expected_group_size, self.round_tag = expected_group_size, round_tag
        self.declared, self.leader, self._followers = None, None, {}

    def declare(self, expiration: float | None, now: float) -> list[Notice]:
        """Record our declared time (None: not visible in the DHT, so we must not lead).

        Returns ACCEPTED updates telling current followers the new wait."""
        self._require(Phase.LOOKING)
        if expiration is not None and not math.isfinite(expiration):
            raise ValueError(f"declared time must be finite, got {expiration}")
        self.declared = None if self.client_mode else expiration
        if self.declared is None:
            return self._disband("we are not declared, so we cannot lead")
        return [(f.handle, JoinResponse.accepted(self.declared - now)) for f in self._followers.values()]

    @property
    def key(self) -> tuple[float, bytes] | None:
        """Our seniority: (declared time, peer id bytes); None while we may not lead."""
        return None if self.declared is None else (self.declared, self.peer_id.to_bytes())

    @property
    def group_size(self) -> int:
        return 1 + len(self._followers)

    @property
    def followers(self) -> list[PeerID]:
        return list(self._followers)

    @property
    def is_full(self) -> bool:
        return self.group_size >= (self.target_group_size or MAX_GROUP_SIZE)

    def should_assemble(self, now: float, view: Mapping[PeerID, float] | None = None) -> bool:
        """Full, or our declared time has come (by our clock) with enough peers, or (with no
        target_group_size) everyone looking is already with us.

        The last rule is what makes a group form at once when every peer is waiting: `view` is the
        bucket as last read from the DHT ({peer: declared time}); once it shows our own record (so
        it is not older than our declaration) and every other live peer in it follows us, nobody
        else could join by waiting. Client-mode peers never declare, so they cannot be waited
        for this way: they make it when they ask before that moment."""
        if self.phase is not Phase.LOOKING or self.declared is None:
            return False
        if self.is_full or (now >= self.declared and self.group_size >= self.min_group_size):
            return True
        if self.target_group_size is not None or view is None or self.peer_id not in view:
            return False  # with a target size, "full" means that size: wait for it until our time
        if self.group_size < max(2, self.min_group_size, self.expected_group_size or 0):
            return False  # peers we expect have not declared yet: wait for them, until our time
        others = {peer for peer, declared in view.items() if peer != self.peer_id and declared > now}
        return others <= self._followers.keys()

    def assemble(self, group_id: bytes, shuffle: Callable[[list], None]) -> tuple[GroupInfo, list[Notice]]:
        """Form the group from us and our followers in an order `shuffle` picks; BEGIN for each follower."""
        self._require(Phase.LOOKING)
        members = [(self.peer_id, self.gather)] + [(f.peer_id, f.gather) for f in self._followers.values()]
        shuffle(members)
        group = GroupInfo(group_id, tuple(p for p, _ in members), tuple(g for _, g in members))
        begin = JoinResponse(
            int(JoinCode.BEGIN_ALLREDUCE),
            group_id=group_id,
            peer_ids=tuple(p.to_bytes() for p in group.peer_ids),
            gathered=group.gathered,
        )
        notices = [(f.handle, begin) for f in self._followers.values()]
        self.phase, self.leader, self._followers = Phase.ASSEMBLED, self.peer_id, {}
        return group, notices

    def stop(self, reason: str) -> list[Notice]:
        """End the round without a group (deadline, cancellation); followers hear GROUP_DISBANDED."""
        notices = self._disband(reason)
        self.phase, self.declared, self.leader = Phase.IDLE, None, None
        return notices

    # --- requests from would-be followers -----------------------------------------------------

    def on_join_request(self, peer: PeerID, request: JoinRequest, now: float, handle: object) -> JoinResponse:
        """Admit `peer` (ACCEPTED, remembered under `handle`) or say why not; checks in a fixed order."""
        if self.phase not in (Phase.LOOKING, Phase.FOLLOWING):
            return JoinResponse.refusal(JoinCode.NOT_LOOKING_FOR_GROUP, f"I am {self.phase.value}")
        if self.client_mode:
            return JoinResponse.refusal(JoinCode.NOT_DECLARED, "I am a client and never lead")
        if request.schema_hash != self.schema_hash:
            return JoinResponse.refusal(JoinCode.BAD_SCHEMA_HASH, "we average different tensors")
        if request.group_key != self.group_key:
            return JoinResponse.refusal(JoinCode.BAD_GROUP_KEY, f"I am looking under {self.group_key!r}")
        if request.round_tag != self.round_tag:
            return JoinResponse.refusal(JoinCode.BAD_GROUP_KEY, f"I am in round {self.round_tag!r}")
        if self.phase is Phase.FOLLOWING:
            return JoinResponse.refusal(JoinCode.NOT_A_LEADER, "I follow another peer", self.leader)
        if self.declared is None:
            return JoinResponse.refusal(JoinCode.NOT_DECLARED, "I have not declared myself yet")
        own = (self.declared, self.peer_id.to_bytes())  # our seniority (`key`)
        if request.expiration is not None and (request.expiration, peer.to_bytes()) <= own:
            return JoinResponse.refusal(JoinCode.BAD_EXPIRATION_TIME, "you declared before me: you lead")
        if peer == self.peer_id or peer in self._followers:
            return JoinResponse.refusal(JoinCode.DUPLICATE_PEER_ID, "you are already in my group")
        if self.is_full:
            return JoinResponse.refusal(JoinCode.GROUP_IS_FULL, f"I have {self.group_size} peers")
        self._followers[peer] = _Follower(peer, request.gather, handle)
        return JoinResponse.accepted(self.declared - now)

    def on_follower_left(self, handle: object) -> bool:
        """The stream under `handle` closed before the group formed; forget that follower."""
        for peer, follower in self._followers.items():
            if follower.handle is handle:
                del self._followers[peer]
                return True
        return False

    # --- our requests to leaders --------------------------------------------------------------

    def candidates(
        self,
        view: Mapping[PeerID, float],
        skip: Callable[[PeerID, float], bool] = lambda peer, declared: False,
    ) -> list[PeerID]:
        """Peers in `view` ({peer: declared time}) we may ask, most senior first.

        A declared peer asks only more senior peers; a client or undeclared peer may ask anyone.
        Our own followers are never candidates (a stale view may still show them as senior).
        `skip(peer, declared)` lets the driver leave out peers that already refused us."""
        own = self.key
        ranked = sorted(
            (declared, peer.to_bytes(), peer)
            for peer, declared in view.items()
            if peer != self.peer_id and peer not in self._followers and math.isfinite(declared)
        )
        return [
            peer
            for declared, raw, peer in ranked
            if (own is None or (declared, raw) < own) and not skip(peer, declared)
        ]

    def on_accepted(self, leader: PeerID) -> list[Notice]:
        """A leader took us in: follow it and send our followers there."""
        self._require(Phase.LOOKING)
        notices = self._disband("I joined another leader", suggested=leader)
        self.phase, self.leader = Phase.FOLLOWING, leader
        return notices

    def on_begin(self, leader: PeerID, response: JoinResponse) -> GroupInfo:
        """Our leader assembled; check the group includes both of us and take it."""
        self._require(Phase.FOLLOWING)
        if leader != self.leader or response.join_code is not JoinCode.BEGIN_ALLREDUCE:
            raise MatchmakingStateError(f"on_begin for {leader} with {response!r}; we follow {self.leader}")
        peers = tuple(PeerID(raw) for raw in response.peer_ids)
        if self.peer_id not in peers or leader not in peers:
            missing = "us" if self.peer_id not in peers else "itself"
            raise LeaderProtocolError(f"leader {leader} sent a group without {missing}")
        assert response.group_id is not None  # (JoinResponse checks: BEGIN_ALLREDUCE carries one)
        group = GroupInfo(response.group_id, peers, tuple(response.gathered))
        self.phase = Phase.ASSEMBLED
        return group

    def on_leader_lost(self) -> None:
        """The leader disbanded, vanished or misbehaved: look again (our declaration still stands)."""
        self._require(Phase.FOLLOWING)
        self.phase, self.leader = Phase.LOOKING, None

    # --- helpers ------------------------------------------------------------------------------

    def _disband(self, reason: str, suggested: PeerID | None = None) -> list[Notice]:
        notice = JoinResponse.refusal(JoinCode.GROUP_DISBANDED, reason, suggested)
        notices = [(f.handle, notice) for f in self._followers.values()]
        self._followers = {}
        return notices

    def _require(self, *phases: Phase) -> None:
        if self.phase not in phases:
            raise MatchmakingStateError(
                f"matchmaking of {self.peer_id.short()} is {self.phase.value}, "
                f"expected {' or '.join(p.value for p in phases)}"
            )

    def __repr__(self) -> str:
        leader = f" leader={self.leader.short()}" if self.leader else ""
        return (
            f"<MatchmakingState {self.peer_id.short()} {self.phase.value} {self.group_key} "
            f"size={self.group_size}{leader}>"
        )
