"""The Optimizer's epoch rules as plain functions: when a peer is behind, when it withdraws from a
round, what it does after one. No I/O and no clocks (time comes in as `now`), so the rules are
tested on their own with made-up swarms and virtual time.

The invariant they keep: every epoch the swarm counts is one optimizer step on that epoch's
averaged gradient, and peers that finish an epoch by stepping hold the same parameters.

- A gradient round gathers each member's epoch. A member that finds a newer epoch in its group
  contributes nothing (`gradient_weight`) and downloads the state instead of stepping: gradients of
  different epochs are never mixed.
- While a peer waits for its round, the swarm may move on without it (the tracker shows a newer
  epoch): it stops waiting and downloads the state (`overtaken`).
- After the round (`after_gradient_round`): a success at our epoch steps on the averaged gradients.
  A failure steps on the peer's own gradients only if the swarm did not step without it, judged by
  a fresh look at the tracker; otherwise the peer downloads the state, instead of holding a
  parameter set of its own under the swarm's epoch number.
- State rounds (`state_weight`) gather (epoch, digest of the state). Members at different epochs,
  or holding one and the same state, all contribute weight 0 (every member sees the same group and
  decides alike), so the round changes nothing: states that differ by whole steps are not mixed,
  and identical states stay bit for bit identical (an average of equal numbers may round).
- `should_load_state`: a peer behind the swarm's epoch downloads the state, retrying a download that
  left it behind only after a pause.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any


class EpochAction(enum.Enum):
    """What a peer does at the end of its epoch, once its gradient round is over."""

    STEP_AVERAGED = "step on the averaged gradients"
    STEP_LOCAL = "step on this peer's own gradients"
    LOAD_STATE = "download the state from peers (this peer is behind)"


def newest_epoch(gathered: Mapping[Any, Any], default: int) -> int:
    """The newest epoch among gathered values (ints, or [epoch, ...] lists); `default` if none."""
    epochs = [epoch for epoch in map(_epoch_of, gathered.values()) if epoch is not None]
    return max(epochs, default=default)


def gradient_weight(epoch: int, gathered: Mapping[Any, Any], weight: float) -> float:
    """A gradient round's weight for this group: nothing if a member is at a newer epoch."""
    return 0.0 if newest_epoch(gathered, epoch) > epoch else weight


def state_weight(epoch: int, gathered: Mapping[Any, Any], weight: float) -> float:
    """A state round's weight for this group: 0 unless every member is at `epoch` and they do not
    all hold the same state (members gather [epoch, digest])."""
    epochs = {_epoch_of(value) for value in gathered.values()}
    digests = {
        value[1] if isinstance(value, (list, tuple)) and len(value) == 2 else None
        for value in gathered.values()
    }
    if epochs != {epoch} or (len(digests) == 1 and None not in digests):
        return 0.0
    return weight


def overtaken(epoch: int, swarm_epoch: int) -> bool:
    """While waiting for the round of `epoch`: the swarm already counts a newer one (a group formed
    and stepped without us), so waiting on can only put us further apart."""
    return swarm_epoch > epoch


def after_gradient_round(epoch: int, gathered: Mapping[Any, Any] | None, swarm_moved_on: bool) -> EpochAction:
    """The action after the round of `epoch`: `gathered` is the group's {peer: epoch} on success,
    None if the round failed or was given up; `swarm_moved_on`: a fresh look at the tracker shows
    that the swarm stepped without us (`overtaken`)."""
    if gathered is not None:
        return EpochAction.LOAD_STATE if newest_epoch(gathered, epoch) > epoch else EpochAction.STEP_AVERAGED
    return EpochAction.LOAD_STATE if swarm_moved_on else EpochAction.STEP_LOCAL


def should_load_state(
    local_epoch: int, swarm_epoch: int, *, must_load: bool, now: float, next_attempt: float
) -> bool:
    """Behind the swarm (or told so by a round): download the state; a download that left the peer
    behind (no up-to-date donor yet) is retried only from `next_attempt` on."""
    return must_load or (local_epoch < swarm_epoch and now >= next_attempt)


def _epoch_of(value: Any) -> int | None:
    if isinstance(value, (list, tuple)) and value:
        value = value[0]
    return value if isinstance(value, int) and not isinstance(value, bool) else None
