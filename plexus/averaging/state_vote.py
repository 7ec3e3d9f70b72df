"""Which donor's state a newcomer adopts when several answer: a vote over manifests, then, only if
the donors disagree, a comparison of the states themselves. No I/O.

Why: any donor serves whatever it likes, and chunk hashes only prove that a chunk is the one its
own manifest promised. One hostile donor must not be able to poison a newcomer while honest
donors are around, so no single donor decides alone.

The rule
--------
1. Eligible donors state (in their manifests) a priority of at least `min_priority`.
2. The *credible priority* P is the second-highest priority the eligible donors state, raised to
   `min_priority` (the swarm's epoch, from the progress records) when that is higher; with one
   eligible donor, its own. So a donor alone ahead of everyone else gains nothing by it: it
   competes at P like the rest. The *tier* is the eligible donors stating at least P.
3. Each manifest gives a `content_key`: a SHA-256 of its tensor headers, chunk size and chunk
   hashes, and of the priority stated. Donors with the same key serve the same tensors at the
   same priority (metadata is left out: it holds per-peer fields such as matchmaking bits).
4. A key held by more than half of the tier wins outright; the others are outvoted. Costs no
   more than the manifests, which were asked for anyway.
5. Otherwise (honest peers may legitimately differ, e.g. after local updates or discarded parts
   of a gradient round), every distinct state of the tier is downloaded and `judge` decides:
   a state with NaN or inf was already refused by the caller; a state whose L2 norm exceeds
   `NORM_TOLERANCE` x the lower median of the candidates' norms (each donor counted) is refused;
   among the rest wins the state closest to the others (least sum, over the other candidates'
   donors, of the L2 distance to their state), then the higher *effective* priority (the stated
   one, but P for a donor more than `MAX_LEAD` ahead of P), then the smaller norm, then the
   donors' order.

6. A state that a single donor offers at or above `min_priority`, while the other donors that
   answered are all older (below it), wins no vote: that donor may be the one peer that stepped
   alone (e.g. a hostile or broken peer that made the swarm believe it is ahead). Their older
   states are downloaded too, as references only (they cannot win), and the lone state is
   refused (`screen_alone`) if its norm exceeds `STALE_TOLERANCE` x the lower median of its own
   and the references' norms: looser than `NORM_TOLERANCE`, since states epochs apart (or a
   fresh peer's initial state) legitimately differ more.

What it bounds: with a majority of honest, agreeing donors among those asked, a hostile one
never wins. With honest donors that disagree, an outlier state (blown up, or far from the
others) loses to the honest ones as soon as two of them are asked. What it cannot do: tell one
honest donor from one hostile donor with nothing to compare against; then the newer state
within `MAX_LEAD` wins, and the norm screen keeps out a blown-up one (not a small wrong one).
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..p2p.identity import PeerID
from .state_messages import StateManifest

NORM_TOLERANCE = 2.0  # a candidate state larger than this x the lower median norm is refused
STALE_TOLERANCE = 10.0  # the same, against older states, for a state only one donor offers
MAX_LEAD = 1.0  # a donor may be believed this far ahead of the credible priority (a step of lag)


def content_key(manifest: StateManifest, priority: float) -> bytes:
    """What two donors must share to agree: the same tensors, chunked the same way, at the same priority."""
    hasher = hashlib.sha256()
    for header in manifest.tensors:
        hasher.update(header.encode())
    hasher.update(struct.pack("<Qd", manifest.chunk_size, priority))
    hasher.update(manifest.chunk_hashes)
    return hasher.digest()


@dataclass(frozen=True)
class Ballot:
    """One eligible donor's manifest, as the vote sees it."""

    peer_id: PeerID
    priority: float  # as its manifest states it
    key: bytes  # content_key


@dataclass(frozen=True)
class Tally:
    credible: float  # the credible priority P
    tier: tuple[Ballot, ...]  # the eligible donors stating at least P, in the donors' order
    majority: bytes | None  # the key more than half of the tier holds, if any

    @property
    def keys(self) -> list[bytes]:
        """The distinct keys of the tier, most supported first (then in the donors' order)."""
        counts: dict[bytes, int] = {}
        for ballot in self.tier:
            counts[ballot.key] = counts.get(ballot.key, 0) + 1
        return sorted(counts, key=lambda key: -counts[key])

    def supporters(self, key: bytes) -> list[PeerID]:
        return [ballot.peer_id for ballot in self.tier if ballot.key == key]

    def outvoted(self, winner: bytes) -> list[PeerID]:
        return [ballot.peer_id for ballot in self.tier if ballot.key != winner]


def credible_priority(priorities: Sequence[float], min_priority: float | None) -> float:
    """The second-highest of `priorities` (the only one when alone), at least `min_priority`."""
    ordered = sorted(priorities, reverse=True)
    credible = ordered[1] if len(ordered) > 1 else ordered[0]
    return credible if min_priority is None else max(credible, min_priority)


def tally(ballots: Sequence[Ballot], min_priority: float | None = None) -> Tally:
    """Steps 2 to 4 of the rule over the eligible donors' ballots (at least one)."""
    if not ballots:
        raise ValueError("tally needs at least one ballot")
    credible = credible_priority([ballot.priority for ballot in ballots], min_priority)
    tier = tuple(ballot for ballot in ballots if ballot.priority >= credible)
    if not tier:  # min_priority above every ballot: the caller refuses these as too old
        return Tally(credible, (), None)
    counts: dict[bytes, int] = {}
    for ballot in tier:
        counts[ballot.key] = counts.get(ballot.key, 0) + 1
    best = max(counts, key=counts.__getitem__)
    return Tally(credible, tier, best if 2 * counts[best] > len(tier) else None)


def effective_priority(priority: float, credible: float) -> float:
    """A stated priority within MAX_LEAD of the credible one stands; one further ahead counts as P."""
    return priority if priority <= credible + MAX_LEAD else credible


@dataclass
class Contender:
    """One distinct state of the tier, downloaded: who serves it and what it holds."""

    key: bytes
    priority: float
    supporters: list[PeerID]
    tensors: Sequence[torch.Tensor]

    @property
    def norm(self) -> float:
        return _norm(self.tensors)


def _floating(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [tensor for tensor in tensors if tensor.dtype.is_floating_point or tensor.dtype.is_complex]


def _norm(tensors: Sequence[torch.Tensor]) -> float:
    return math.hypot(*(float(torch.linalg.vector_norm(tensor.float())) for tensor in _floating(tensors)))


def distance(first: Sequence[torch.Tensor], second: Sequence[torch.Tensor]) -> float:
    """L2 distance over the floating tensors; inf for states of different structure."""
    a, b = _floating(first), _floating(second)
    if len(first) != len(second) or len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return math.inf
    return math.hypot(*(float(torch.linalg.vector_norm(x.float() - y.float())) for x, y in zip(a, b)))


def lower_median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def judge(contenders: Sequence[Contender], credible: float) -> tuple[Contender, dict[bytes, str]]:
    """Step 5 of the rule: the winning contender, and why each other one lost (by key)."""
    if not contenders:
        raise ValueError("judge needs at least one contender")
    norms = {c.key: c.norm for c in contenders}
    median = lower_median([norms[c.key] for c in contenders for _ in c.supporters])
    reasons, standing = {}, []  # the lower-median candidate always stands
    for contender in contenders:
        if norms[contender.key] > NORM_TOLERANCE * median:
            reasons[contender.key] = (
                f"its state's norm {norms[contender.key]:.4g} exceeds {NORM_TOLERANCE:g} x the "
                f"median norm {median:.4g} of the candidates"
            )
        else:
            standing.append(contender)
    distances = {}
    for index, a in enumerate(standing):
        for b in standing[index + 1 :]:
            distances[a.key, b.key] = distances[b.key, a.key] = distance(a.tensors, b.tensors)
    scores = {
        a.key: sum(len(b.supporters) * distances[a.key, b.key] for b in standing if b is not a)
        for a in standing
    }
    order = {c.key: index for index, c in enumerate(contenders)}
    winner = min(
        standing,
        key=lambda c: (scores[c.key], -effective_priority(c.priority, credible), norms[c.key], order[c.key]),
    )
    for contender in standing:
        if contender is not winner:
            reasons[contender.key] = (
                f"its state (norm {norms[contender.key]:.4g}, priority {contender.priority:g}) lost to "
                f"one closer to the other candidates or newer (norm {norms[winner.key]:.4g}, "
                f"priority {winner.priority:g})"
            )
    return winner, reasons


def screen_alone(alone: Contender, older: Sequence[Sequence[torch.Tensor]]) -> str | None:
    """Step 6 of the rule: why the state only one donor offers is refused, or None if it stands."""
    if not older:
        return None
    norm = alone.norm
    median = lower_median([norm, *map(_norm, older)])
    if norm > STALE_TOLERANCE * median:
        return (
            f"only it offers a state this new, and that state's norm {norm:.4g} exceeds "
            f"{STALE_TOLERANCE:g} x the median norm {median:.4g} of it and the older donors' states"
        )
    return None
