"""Wire messages of matchmaking (`/plexus/averaging/join/1.0.0`): a join request, the leader's answers.

A follower opens one stream to a leader, sends one `JoinRequest` and keeps its side open while it
waits; closing or resetting it means "I left". The leader answers with a stream of
`JoinResponse`s: first ACCEPTED or a refusal (after which the stream ends), then, for an accepted
follower, zero or more ACCEPTED updates (the leader moved its assembly time) and one final
BEGIN_ALLREDUCE or GROUP_DISBANDED.

One protocol id serves every averager on a host: the request names its group key
`{prefix}.0b{bits}`, and the host routes it to the averager of that prefix. Every field is bounded
and checked on construction, so a decoded message is always well-formed; anything else is a
`MessageError` (or ValueError) that the receiver answers with PROTOCOL_VIOLATION.
"""

import enum
import math
from dataclasses import dataclass

from ..p2p.identity import PeerID
from ..p2p.messages import Message
from .group_info import check_group_key

JOIN_PROTOCOL = "/plexus/averaging/join/1.0.0"
MAX_GATHER_BYTES = 64 << 10
MAX_GROUP_SIZE = 256
MAX_SCHEMA_HASH_BYTES = 64
MAX_ROUND_TAG_BYTES = 64
MAX_GROUP_ID_BYTES = 64
MAX_REASON_CHARS = 1024
MAX_TIME_LEFT = 24 * 3600.0
MAX_JOIN_MESSAGE_SIZE = MAX_GROUP_SIZE * (MAX_GATHER_BYTES + 128) + (64 << 10)


class JoinCode(enum.IntEnum):
    """What a leader answers; the integer values are part of the wire."""

    ACCEPTED = 0  # you are in; I mean to assemble in `time_left` seconds (by my clock)
    BEGIN_ALLREDUCE = 1  # the group is assembled: group_id, peer_ids, gathered
    GROUP_DISBANDED = 2  # I will not lead this group after all; try `suggested_leader` if given
    NOT_LOOKING_FOR_GROUP = 3  # I am not matchmaking now (or already assembled)
    PROTOCOL_VIOLATION = 4  # your request is malformed
    BAD_SCHEMA_HASH = 5  # we average different tensors
    BAD_GROUP_KEY = 6  # I am looking under another key (or serve no such prefix)
    NOT_DECLARED = 7  # I have not declared myself (yet), or I am a client that never leads
    BAD_EXPIRATION_TIME = 8  # your (expiration, peer id) is not later than mine: you should lead me
    NOT_A_LEADER = 9  # I follow `suggested_leader`
    DUPLICATE_PEER_ID = 10  # you are already in my group, or you are me
    GROUP_IS_FULL = 11  # I have target_group_size peers


REFUSALS = frozenset(JoinCode) - {JoinCode.ACCEPTED, JoinCode.BEGIN_ALLREDUCE, JoinCode.GROUP_DISBANDED}
_SUGGESTING = {JoinCode.NOT_A_LEADER, JoinCode.GROUP_DISBANDED}


def _check_peer_id(raw: bytes, what: str) -> None:
    try:
        PeerID(raw)
    except ValueError as error:
        raise ValueError(f"{what} is not a peer id: {error}") from None


@dataclass(frozen=True)
class JoinRequest(Message):
    """Ask a leader to let us into its group."""

    group_key: str
    schema_hash: bytes
    expiration: float | None
    """Our declared time (DHT time by our clock); None for a client or an undeclared peer."""
    gather: bytes
    client_mode: bool = False
    round_tag: bytes = b""
    """Which round of the group key the requester is in (empty: any); leaders take only their own."""

    def __post_init__(self) -> None:
        check_group_key(self.group_key)
        if len(self.round_tag) > MAX_ROUND_TAG_BYTES:
            raise ValueError(f"round_tag of {len(self.round_tag)} bytes exceeds {MAX_ROUND_TAG_BYTES}")
        if len(self.schema_hash) > MAX_SCHEMA_HASH_BYTES:
            raise ValueError(f"schema_hash of {len(self.schema_hash)} bytes exceeds {MAX_SCHEMA_HASH_BYTES}")
        if self.expiration is not None and not math.isfinite(self.expiration):
            raise ValueError(f"expiration must be finite, got {self.expiration}")
        if len(self.gather) > MAX_GATHER_BYTES:
            raise ValueError(f"gather of {len(self.gather)} bytes exceeds {MAX_GATHER_BYTES}")


@dataclass(frozen=True)
class JoinResponse(Message):
    """One answer from a leader; which fields are set depends on `code` (checked here)."""

    code: int
    time_left: float | None = None
    suggested_leader: bytes | None = None
    group_id: bytes | None = None
    peer_ids: tuple[bytes, ...] = ()
    gathered: tuple[bytes, ...] = ()
    reason: str = ""

    def __post_init__(self) -> None:
        if self.code not in JoinCode._value2member_map_:
            raise ValueError(f"unknown join code {self.code!r}")
        code = JoinCode(self.code)
        if (self.time_left is not None) != (code == JoinCode.ACCEPTED):
            raise ValueError("time_left comes with ACCEPTED and only with it")
        if self.time_left is not None and not 0 <= self.time_left <= MAX_TIME_LEFT:
            raise ValueError(f"time_left must be within [0, {MAX_TIME_LEFT}], got {self.time_left}")
        if self.suggested_leader is not None:
            if code not in _SUGGESTING:
                raise ValueError(f"{code.name} carries no suggested leader")
            _check_peer_id(self.suggested_leader, "suggested_leader")
        if code == JoinCode.BEGIN_ALLREDUCE:
            self._check_group()
        elif self.group_id is not None or self.peer_ids or self.gathered:
            raise ValueError(f"{code.name} carries no group")
        if len(self.reason) > MAX_REASON_CHARS:
            raise ValueError(f"reason of {len(self.reason)} characters exceeds {MAX_REASON_CHARS}")

    def _check_group(self) -> None:
        if self.group_id is None or not 0 < len(self.group_id) <= MAX_GROUP_ID_BYTES:
            raise ValueError(f"BEGIN_ALLREDUCE needs a group_id of 1 to {MAX_GROUP_ID_BYTES} bytes")
        if not 0 < len(self.peer_ids) <= MAX_GROUP_SIZE:
            raise ValueError(f"a group has 1 to {MAX_GROUP_SIZE} peers, got {len(self.peer_ids)}")
        if len(self.gathered) != len(self.peer_ids):
            raise ValueError(f"{len(self.peer_ids)} peers but {len(self.gathered)} gathered payloads")
        if len(set(self.peer_ids)) != len(self.peer_ids):
            raise ValueError("a peer appears twice in the group")
        for index, raw in enumerate(self.peer_ids):
            _check_peer_id(raw, f"peer_ids[{index}]")
        for index, gather in enumerate(self.gathered):
            if len(gather) > MAX_GATHER_BYTES:
                raise ValueError(f"gathered[{index}] of {len(gather)} bytes exceeds {MAX_GATHER_BYTES}")

    @property
    def join_code(self) -> JoinCode:
        return JoinCode(self.code)

    @classmethod
    def refusal(
        cls, code: JoinCode, reason: str = "", suggested_leader: PeerID | None = None
    ) -> "JoinResponse":
        suggested = suggested_leader.to_bytes() if suggested_leader is not None else None
        return cls(int(code), suggested_leader=suggested, reason=reason[:MAX_REASON_CHARS])

    @classmethod
    def accepted(cls, time_left: float) -> "JoinResponse":
        return cls(int(JoinCode.ACCEPTED), time_left=min(max(time_left, 0.0), MAX_TIME_LEFT))

    def __repr__(self) -> str:
        extra = f" {self.reason!r}" if self.reason else ""
        if self.time_left is not None:
            extra += f" in {self.time_left:.3f}s"
        return f"<JoinResponse {self.join_code.name}{extra}>"
