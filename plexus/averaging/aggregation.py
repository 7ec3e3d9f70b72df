"""How a reducer combines the members' values of one part: the plain weighted mean, or CenteredClip.

Theory of operation
-------------------
Weights. A member states its weight in its first part header; the reducer bounds it before any
value is added (`bounded_weights`): by a per-member limit the caller knows (for gradient rounds,
the samples the member's progress record justifies), and by `max_weight_ratio` times the lower
median of the group's positive weights, so that no member stating a huge weight can make the
average its own. In robust mode every member of positive weight counts once (`equal_weights`), as
in BTARD's setting, where every peer computes its gradient on a batch of the same size: nobody can
check a member's sample count, CenteredClip holds only while attackers carry under half of the
weight, and equal weights let every verifier know exactly what each member got.

Plain mode (`MeanPart`): `acc += w * x` as contributions arrive (float32, float64 for float64
tensors), `average = acc / sum(w)` when the part completes: one accumulator per part in flight.

Robust mode (`ClippedPart`, with a `RobustAggregation`): the reducer keeps each member's values of
the part until it completes, then takes their CenteredClip (`centered_clip.py`), ButterflyClip
style. A member excluded before the part completes is taken out again, so the part's result is
over exactly the members that receive it (the verification in `verification.py` relies on that).
Memory: the window's parts times the members, instead of the window's parts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .centered_clip import centered_clip
from .messages import decode_tensor

DEFAULT_MAX_WEIGHT_RATIO = 8.0


@dataclass(frozen=True)
class RobustAggregation:
    """Byzantine-robust averaging: CenteredClip per part (ButterflyClip) and checks of the reducers.

    Every member of a group must use the same options (they are part of the averager's schema).
    With 1 attacker among n members of equal weight, the attacker moves each part's result away
    from the others' mean by at most `radius / (n - 1)`.

    Tolerance with honest members only: a part of at least 64 elements comes out as their plain
    weighted mean up to float rounding (within 1e-5 of their median distance to the mean, plus the
    float32 rounding of the values; measured: 2e-7) unless a member lies `radius_factor` times
    farther from the mean than the median member. Smaller parts (tiny tensors, a tensor's last few
    elements in a span) may be clipped, and then differ from the mean by up to the members' spread:
    with so few coordinates an honest outlier looks like an attacker.
    """

    clip_radius: float | None = None
    """A fixed L2 clipping radius per part; None: adaptive, `radius_factor` x the members' median
    distance to their coordinate-wise median (fits values of any scale)."""
    radius_factor: float = 1.5
    """The adaptive radius in median distances: smaller clips honest members sooner, larger lets an
    attacker pull harder. At 1.5 honest parts of >= 64 elements are not clipped (measured), and one
    attacker among n pulls by at most 1.5 / (n - 1) median distances, so a sign-flipping member of
    four leaves at least half of the honest descent when noise dominates the gradients."""
    tolerance: float = 1e-6
    """CenteredClip stops when a step is shorter than `tolerance x radius`."""
    max_iterations: int = 1000
    """CenteredClip stops after this many steps anyway (a warning says so)."""
    min_contributors: int = 3
    """A part is averaged only when at least this many members of positive weight contributed it;
    otherwise everyone keeps its local values: of two members neither can be outvoted, so the plain
    mean of two would let one attacker move the other by half of anything."""
    verify: bool = True
    """Check each reducer's result with random projections of the clipped differences
    (`verification.py`) and discard the parts that fail; costs two small messages per stream."""

    def __post_init__(self):
        if self.clip_radius is not None and not (math.isfinite(self.clip_radius) and self.clip_radius > 0):
            raise ValueError(f"clip_radius must be a finite positive number or None, got {self.clip_radius}")
        if not (
            self.radius_factor > 0
            and 0 < self.tolerance < 1
            and self.max_iterations >= 1
            and self.min_contributors >= 1
        ):
            raise ValueError(
                f"invalid {self}: need radius_factor > 0, 0 < tolerance < 1, "
                f"max_iterations >= 1 and min_contributors >= 1"
            )


def lower_median(values) -> float:
    """The lower median (for an even count, the smaller of the two middle values)."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def bounded_weights(
    declared: Mapping[int, float], limits: Mapping[int, float | None], max_weight_ratio: float
) -> dict[int, float]:
    """Each member's weight, at most its limit (None: no limit) and `max_weight_ratio` x the lower
    median of the positive declared weights."""
    positive = [weight for weight in declared.values() if weight > 0]
    cap = max_weight_ratio * lower_median(positive) if positive else 0.0
    bounded = {}
    for member, weight in declared.items():
        limit = limits.get(member)
        bounded[member] = min(weight, cap, math.inf if limit is None else max(limit, 0.0))
    return bounded


def equal_weights(declared: Mapping[int, float]) -> dict[int, float]:
    """Robust mode: weight 1 for every member that stated a positive weight, 0 for the others."""
    return {member: 1.0 if weight > 0 else 0.0 for member, weight in declared.items()}


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class MeanPart:
    """The running weighted sum of one part (plain mode)."""

    def __init__(self):
        self.dtype: torch.dtype | None = None  # of the accumulator, once a value came
        self.acc: torch.Tensor | None = None
        self.total_weight = 0.0
        # lossy senders' parts as received (header, buffer): x~ is decoded again for the delta answer,
        # which keeps 2 bytes per element (float16) in flight instead of 4
        self.received: dict[int, tuple] = {}

    def add(self, sender: int, values: torch.Tensor, weight: float, lossy_wire: tuple | None) -> None:
        if self.acc is None:  # the first contribution starts the sum: one pass, no zero-filled accumulator
            acc_dtype = self.dtype = accumulator_dtype(values.dtype)
            same = values.dtype == acc_dtype
            self.acc = torch.mul(values, weight) if same else values.to(acc_dtype).mul_(weight)
        else:
            self.acc.add_(values, alpha=weight)
        self.total_weight += weight
        if lossy_wire is not None:
            self.received[sender] = lossy_wire

    def drop(self, sender: int) -> None:
        """An excluded sender: its contribution stays in the sum (it was valid data); no answer is owed."""
        self.received.pop(sender, None)

    def take_lossy(self, sender: int) -> torch.Tensor | None:
        """x~, the sender's part as decoded, if it came lossily compressed (then it is owed a delta)."""
        received = self.received.pop(sender, None)  # freed as its answer takes its place
        if received is None:
            return None
        header, buffer = received
        return decode_tensor(header.numel, header.dtype, header.compression, buffer)

    def average(self, out: torch.Tensor | None = None) -> tuple[torch.Tensor | None, float | None]:
        """(the weighted mean, None) or (None, None) when the total weight is 0; written to `out`
        when given (of the accumulator's dtype)."""
        if self.acc is None or self.total_weight <= 0:
            return None, None
        if out is not None:
            return torch.div(self.acc, self.total_weight, out=out), None
        return self.acc.div_(self.total_weight), None


class ClippedPart:
    """One part's contributions kept apart until it completes, then their CenteredClip (robust mode)."""

    def __init__(self, options: RobustAggregation):
        self.options = options
        self.dtype: torch.dtype | None = None  # of the accumulator, once a value came
        self.values: dict[int, tuple[torch.Tensor, float]] = {}  # sender -> (x, or x~ as decoded; weight)
        self.lossy: set[int] = set()  # senders owed a delta answer
        self.iterations, self.converged = 0, True

    def add(self, sender: int, values: torch.Tensor, weight: float, lossy_wire: tuple | None) -> None:
        self.values[sender] = (values, weight)
        self.dtype = accumulator_dtype(values.dtype)
        if lossy_wire is not None:
            self.lossy.add(sender)

    def drop(self, sender: int) -> None:
        """An excluded sender leaves the part entirely: the result is over those who receive it."""
        self.values.pop(sender, None)
        self.lossy.discard(sender)

    def take_lossy(self, sender: int) -> torch.Tensor | None:
        return self.values[sender][0] if sender in self.lossy else None

    def average(self, out: torch.Tensor | None = None) -> tuple[torch.Tensor | None, float | None]:
        """(CenteredClip of the positive-weight contributions, the radius), or (None, None) when fewer
        than `min_contributors` members carry weight."""
        members = [(x, w) for x, w in self.values.values() if w > 0]
        if not members or len(members) < self.options.min_contributors:
            return None, None
        acc_dtype = accumulator_dtype(members[0][0].dtype)
        stacked = torch.stack([x.to(acc_dtype) for x, _ in members])
        weights = torch.tensor([w for _, w in members], dtype=acc_dtype)
        options = self.options
        result = centered_clip(
            stacked,
            weights,
            radius=options.clip_radius,
            radius_factor=options.radius_factor,
            tolerance=options.tolerance,
            max_iterations=options.max_iterations,
        )
        self.iterations, self.converged = result.iterations, result.converged
        if out is not None:
            return out.copy_(result.center), result.radius
        return result.center, result.radius
