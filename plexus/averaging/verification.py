"""Checking reducers with a few scalars per part: is each result the CenteredClip fixed point?

Theory of operation
-------------------
At the fixed point v of CenteredClip (`centered_clip.py`) over a part's contributions x_i with
weights w_i and radius tau, sum_i w_i clip(x_i - v, tau) = 0. So for any direction z,

    sum_i w_i <clip(x_i - v, tau), z> / tau = 0,

and every term can be computed by its own member from what it sent (x_i) and what it got back
(v). A reducer that returns anything else fails this for a random z, unless it knew z before it
answered. This is the check of BTARD ("Secure Distributed Training at Scale", Gorbunov et al.,
2022), fitted to our all-reduce:

1. Each reducer of the group is also a *verifier* of the other reducers' spans. After the last
   part, every sender tells every reducer it streams to that it has all its answers
   (`VerifyDone`). Once all its live senders have, the verifier reveals a fresh random 32-byte
   seed (`VerifySeed`): no reducer can have known it while answering, since every answer of the
   round was already received by then.
2. Each sender computes, for every part of every span it received, with z drawn from the seed
   (`direction`): the projection s_i = <clip(x_i - y_i, tau), z> / tau, where y_i is the result
   it applied; the distance d_i = ||x_i - y_i||; the norm ||y_i||; and the radius tau the reducer
   announced. With the weight the reducer said it gave it, these go back to the verifier
   (`VerifyReport`, 32 bytes per part).
3. The verifier (`Verifier`) judges each part of every span but its own: the weighted projections
   must sum to 0 within `DETECTION_SIGMAS` x (total weight x tolerance + sum_i w_i u_i): the
   reducer's own convergence residual plus what each member's rounding and compression can add (a
   projection of an error e on a random sign vector z has variance ||e||^2 and sub-Gaussian tails,
   by Hoeffding's inequality). The verifier computes u_i itself (`uncertainty`), from the part's
   dtype and wire compression, the median reported ||y|| and min(d_i, tau), so a member cannot
   widen the bound by claiming large errors or norms. Every member must report the same radius;
   the radius must be the configured one, or for the adaptive radius at most `RADIUS_SLACK` x
   radius_factor x the median reported distance; and the weight the reducer gave each member must
   be the one the verifier gives it too (robust rounds count every member once). It sends the
   indices of the parts that failed back to every sender (`VerifyVerdict`).
4. A sender discards a part (keeps its local values there) when more than half of the verifiers
   that judged it say it failed (`discarded_parts`); its own judgement counts as one vote.

What it catches: a reducer that returns a wrong result (to everyone, or only to some members), a
radius larger than the rule allows, or weights it made up, as soon as the error exceeds the
uncertainty bound in the direction z (an error e is missed with probability ~0.8 x bound/||e||
per verifier, and verifiers draw independent directions). What it does not catch: errors below
the rounding of the tensors' dtype (float16, bfloat16 results are checked only to their
precision) or below the compression error of lossy answers (`CODEC_ERROR` x the member's distance
to the result: 8-bit answers are checked only to about half of that distance); errors against a
member that lies farther than tau from the result, which are seen only in their component across
its direction, weakened by tau / distance. What it cannot tell apart: a wrong reducer from a
member that reports false scalars, or withholds them (the verifier then flags the parts, since
it cannot complete the sum): a lying member can make honest parts be discarded (the round loses
those parts and keeps local values: a denial of service, never a corrupted result), and so can a
member that contributed to a part but lost its answer. A verifier that lies in its verdict is
outvoted when honest verifiers are the majority. Nothing carries over between rounds (no bans).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ..compression import CompressionType
from .aggregation import RobustAggregation, accumulator_dtype
from .centered_clip import MIN_RADIUS, median
from .messages import VerifyReport

SEED_BYTES = 32
PART_FIELDS = 4  # projection, result norm, distance, radius (0 for a part answered KEEP)
DETECTION_SIGMAS = 8.0
RADIUS_SLACK = 4.0  # the adaptive radius is taken at the coordinate median, the distances at the result
CODEC_ERROR: dict[
    int, float
] = {  # the largest relative error (of the decoded answer) each lossy method is assumed to make
    CompressionType.NONE: 0.0,
    CompressionType.FLOAT16: 2.0**-10,
    CompressionType.MEANSTD_16BIT: 2.0**-8,
    CompressionType.UNIFORM_8BIT: 0.5,
    CompressionType.QUANTILE_8BIT: 0.5,
    CompressionType.BLOCKWISE_8BIT: 0.5,
    CompressionType.BLOCKWISE_4BIT: 1.0,
}


def direction(seed: bytes, span: int, part: int, numel: int) -> torch.Tensor:
    """The random direction of one part, drawn from a verifier's seed: independent signs +-1
    (float64). A projection on it has variance ||e||^2 and sub-Gaussian tails, as on a Gaussian
    direction, at a third of the cost to draw."""
    digest = hashlib.sha256(seed + span.to_bytes(4, "little") + part.to_bytes(8, "little")).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    signs = torch.randint(0, 2, (numel,), generator=generator, dtype=torch.int8)
    return signs.to(torch.float64).mul_(2).sub_(1)


class PartPrecision(NamedTuple):
    """How exactly a member can reproduce a part's fixed point: the relative rounding of the result's
    dtype and of the reducer's accumulator, and the relative error of the part's lossy answers."""

    result_eps: float
    accumulator_eps: float
    codec_error: float

    @classmethod
    def of(cls, dtype: torch.dtype, compression_type: int) -> PartPrecision:
        return cls(
            torch.finfo(dtype).eps,
            torch.finfo(accumulator_dtype(dtype)).eps,
            CODEC_ERROR.get(compression_type, 1.0),
        )


def part_row(sent: torch.Tensor, applied: torch.Tensor, radius: float, z: torch.Tensor) -> tuple[float, ...]:
    """A sender's report on one part: (projection, result norm, distance, radius), see step 2.
    `sent` is what it contributed, `applied` the result it now holds."""
    difference = sent.double() - applied.double()
    distance = float(torch.linalg.vector_norm(difference))
    clipped = difference * min(1.0, radius / distance) if distance > 0 else difference
    return float(clipped @ z) / radius, float(torch.linalg.vector_norm(applied.double())), distance, radius


def uncertainty(precision: PartPrecision, result_norm: float, distance: float, radius: float) -> float:
    """The most a member's projection can differ from the exact one, in radii (step 3): the result
    rounded to its dtype, the member's values and the result rounded in the accumulator, and a lossy
    answer's error. A clip moves by at most what its input moves, and by about radius x error /
    distance for a member beyond the radius: so only min(distance, radius) counts."""
    near = min(distance, radius)
    rounding = precision.result_eps * result_norm + 2 * precision.accumulator_eps * (2 * result_norm + near)
    return (rounding + 2 * precision.codec_error * near) / radius


def encode_report(weights: Sequence[float], rows_by_span: Sequence[Sequence[tuple]]) -> VerifyReport:
    rows = [row for span_rows in rows_by_span for row in span_rows]
    buffer = np.asarray(rows, dtype=np.float64).reshape(-1, PART_FIELDS).tobytes()
    return VerifyReport([float(w) for w in weights], [len(r) for r in rows_by_span], buffer)


def decode_report(report: VerifyReport, num_parts: Sequence[int]) -> list[tuple[float, np.ndarray]]:
    """(weight, rows) per span; ValueError if it does not fit the group's spans or holds non-finite values."""
    if len(report.parts) != len(num_parts):
        raise ValueError(f"a report on {len(report.parts)} spans, the group has {len(num_parts)}")
    for span, (count, total) in enumerate(zip(report.parts, num_parts)):
        if count > total:
            raise ValueError(f"a report on {count} parts of span {span}, which has {total}")
    rows = np.frombuffer(report.rows, dtype=np.float64).reshape(-1, PART_FIELDS)
    if not (np.isfinite(rows).all() and all(math.isfinite(w) and w >= 0 for w in report.weights)):
        raise ValueError("a report holds NaN, inf or negative weights")
    spans, offset = [], 0
    for weight, count in zip(report.weights, report.parts):
        spans.append((weight, rows[offset : offset + count]))
        offset += count
    return spans


@dataclass
class Verdict:
    bad_parts: list[list[int] | None]  # per span: failed part indices, None where not judged
    reasons: dict[int, str]  # per span with failures: the first reason


class Verifier:
    """One verifier's judgement of every span but its own (step 3 of the module comment).

    Args:
        me: this verifier's index (its span is not judged).
        num_parts: the parts of each span of the group.
        expected: sender index -> the weight this verifier would give it (every sender whose report is due).
        options: the group's RobustAggregation.
        precision: (span, part) -> the part's PartPrecision (its dtype and wire compression).
    """

    def __init__(
        self,
        me: int,
        num_parts: Sequence[int],
        expected: Mapping[int, float],
        options: RobustAggregation,
        precision: Callable[[int, int], PartPrecision],
    ):
        self.me, self.num_parts, self.expected, self.options = me, list(num_parts), dict(expected), options
        self.precision = precision
        self.reports: dict[int, list[tuple[float, np.ndarray]]] = {}

    def add(self, sender: int, report: VerifyReport) -> None:
        """Take one sender's report (ValueError if malformed)."""
        self.reports[sender] = decode_report(report, self.num_parts)

    def verdict(self) -> Verdict:
        bad: list[list[int] | None] = []
        reasons: dict[int, str] = {}
        missing = sorted(set(self.expected) - set(self.reports))
        for span, total in enumerate(self.num_parts):
            if span == self.me:
                bad.append(None)
                continue
            failed, reason = self._judge_span(span, total, missing)
            bad.append(failed)
            if failed:
                reasons[span] = reason
        return Verdict(bad, reasons)

    def _judge_span(self, span: int, total: int, missing: list[int]) -> tuple[list[int], str]:
        if total == 0:
            return [], ""
        if missing:
            return list(range(total)), f"no report from sender(s) {missing}"
        # members that received no part of this span (its reducer excluded them) are not in its sums
        weights = {sender: spans[span][0] for sender, spans in self.reports.items() if len(spans[span][1])}
        for sender, weight in weights.items():
            expected = self.expected[sender]
            if weight != expected:
                return list(range(total)), f"it gave sender {sender} weight {weight}, expected {expected}"
        failed, first_reason = [], ""
        for part in range(total):
            rows = [
                (weights[sender], spans[span][1][part])
                for sender, spans in self.reports.items()
                if len(spans[span][1]) > part
            ]  # a member that lost the answer to a part is not in it
            reason = self._judge_part(rows, self.precision(span, part))
            if reason:
                failed.append(part)
                first_reason = first_reason or f"part {part}: {reason}"
        return failed, first_reason

    def _judge_part(self, rows: list[tuple[float, np.ndarray]], precision: PartPrecision) -> str:
        if not rows:
            return ""
        radii = {float(row[3]) for _, row in rows}
        if len(radii) > 1:
            return f"members got different radii {sorted(radii)}"
        radius = radii.pop()
        total_weight = sum(w for w, _ in rows)
        if radius == 0:  # answered KEEP: right when too few members carried weight
            contributors = sum(1 for w, _ in rows if w > 0)
            if contributors < self.options.min_contributors:
                return ""
            return f"answered KEEP although {contributors} members carried weight"
        if self.options.clip_radius is not None:
            if radius != self.options.clip_radius:
                return f"radius {radius}, configured {self.options.clip_radius}"
        else:
            distances = torch.tensor([row[2] for w, row in rows if w > 0], dtype=torch.float64)
            bound = RADIUS_SLACK * self.options.radius_factor * (median(distances) if len(distances) else 0.0)
            if radius > bound + MIN_RADIUS:
                return f"radius {radius:.3g} exceeds {bound:.3g} ({RADIUS_SLACK} x factor x median distance)"
        result_norm = median(torch.tensor([row[1] for _, row in rows], dtype=torch.float64))
        residual = sum(w * row[0] for w, row in rows)
        spread = sum(w * uncertainty(precision, result_norm, row[2], radius) for w, row in rows)
        allowed = DETECTION_SIGMAS * (total_weight * self.options.tolerance + spread)
        if not abs(residual) <= allowed:
            return (
                f"clipped differences sum to {residual:.3g} along a random direction (allowed {allowed:.3g})"
            )
        return ""


def discarded_parts(verdicts: Mapping[int, Sequence[Sequence[int] | None]], num_parts: Sequence[int]) -> dict:
    """{span: sorted part indices} that more than half of the verifiers which judged them found wrong.

    `verdicts`: verifier index -> its `bad_parts` (this peer's own included when it is a verifier)."""
    discarded = {}
    for span, total in enumerate(num_parts):
        judged = [
            judgement
            for verifier, verdict in verdicts.items()
            if verifier != span
            and len(verdict) == len(num_parts)
            and (judgement := verdict[span]) is not None
        ]
        if not judged or total == 0:
            continue
        flags = np.zeros(total, dtype=np.int64)
        for bad in judged:
            flags[[index for index in set(bad) if 0 <= index < total]] += 1
        failed = [int(index) for index in np.nonzero(2 * flags > len(judged))[0]]
        if failed:
            discarded[span] = failed
    return discarded
