"""The reducer check as pure functions: members' scalar reports on a part, one verifier's verdict,
and the majority vote, with no network (the all-reduce tests run it end to end)."""

import os

import numpy as np
import pytest
import torch

from plexus.averaging.aggregation import RobustAggregation
from plexus.averaging.centered_clip import centered_clip
from plexus.averaging.messages import VerifyReport
from plexus.averaging.verification import (
    PartPrecision,
    Verifier,
    decode_report,
    direction,
    discarded_parts,
    encode_report,
    part_row,
)
from plexus.compression import CompressionType

pytestmark = pytest.mark.timeout(60)
OPTIONS = RobustAggregation()
NUM_PARTS = [0, 1]  # span 0 is the verifier's own (empty here), span 1 is judged


def FLOAT32(span: int, part: int) -> PartPrecision:
    return PartPrecision.of(torch.float32, CompressionType.NONE)


def members(n=4, numel=256, seed=0, outlier=None):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(n, numel, generator=generator) + 2.0
    if outlier is not None:
        values[-1] = outlier
    return values


def judge(
    values,
    result,
    radius,
    weights=None,
    *,
    dtype=torch.float32,
    compression=CompressionType.NONE,
    given=None,
    radii=None,
    expected=None,
    skip=(),
    seed=None,
    applied_by=None,
):
    """Every member reports on span 1 (its one part) to a verifier; returns the verdict's bad parts."""
    n = values.shape[0]
    weights = weights if weights is not None else [1.0] * n
    seed = seed or os.urandom(32)  # tests that count misses pass fixed seeds: the counts are then exact
    z = direction(seed, 1, 0, values.shape[1])
    precision = PartPrecision.of(dtype, compression)
    verifier = Verifier(
        0, NUM_PARTS, expected or dict(enumerate(weights)), OPTIONS, lambda span, part: precision
    )
    for i in range(n):
        if i in skip:
            continue
        applied = (applied_by or {}).get(i, result).to(dtype) if radius else values[i]
        row = (
            part_row(values[i].to(dtype), applied, (radii or {}).get(i, radius), z)
            if radius
            else (0.0, 0.0, 0.0, 0.0)
        )
        weight = (given or {}).get(i, weights[i])
        verifier.add(i, encode_report([0.0, weight], [[], [row]]))
    verdict = verifier.verdict()
    assert verdict.bad_parts[0] is None  # its own span is not judged
    return verdict.bad_parts[1], verdict.reasons.get(1, "")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_honest_results_pass_in_every_dtype(dtype):
    for trial in range(20):
        outlier = torch.full((256,), 40.0) if trial % 2 else None
        values = members(seed=trial, outlier=outlier).to(dtype).float()
        result = centered_clip(values, torch.ones(4))
        assert judge(values, result.center, result.radius, dtype=dtype) == ([], "")


def test_a_lossy_answer_is_judged_within_the_codecs_error():
    """A float16 delta answer differs from the exact result by up to 2**-11 of the member's distance:
    it passes with that codec's allowance, and (mostly: the check is random) fails without it."""
    values = members()
    result = centered_clip(values, torch.ones(4))
    distance = float(torch.linalg.vector_norm(values[0] - result.center))
    caught = 0
    generator = torch.Generator().manual_seed(6)
    for trial in range(10):
        error = torch.randn(256, generator=generator)
        lossy = result.center + error / float(torch.linalg.vector_norm(error)) * 2**-11 * distance
        assert judge(values, lossy, result.radius, compression=CompressionType.FLOAT16)[0] == []
        caught += judge(values, lossy, result.radius, seed=bytes([trial]) * 32)[0] == [0]
    assert caught >= 8


@pytest.mark.parametrize("error", [0.1, 1.0, 100.0])
def test_a_wrong_result_fails(error):
    """The check resolves about 8 x (tolerance + rounding) x radius (here ~6e-4 for a radius of ~55):
    an error of 0.1 is missed with probability ~0.8 x 6e-4 / 0.1 per verifier."""
    values = members()
    result = centered_clip(values, torch.ones(4))
    generator = torch.Generator().manual_seed(5)
    caught = 0
    for trial in range(20):
        noise = torch.randn(256, generator=generator)
        wrong = result.center + error * noise / float(torch.linalg.vector_norm(noise))
        caught += judge(values, wrong, result.radius, seed=bytes([trial]) * 32)[0] == [0]
    assert caught >= 19


def test_a_result_wrong_for_one_member_only_fails():
    """A reducer that sends one member a different result than the others (equivocation)."""
    values = members()
    result = centered_clip(values, torch.ones(4))
    caught = 0
    for trial in range(10):
        wrong = result.center + torch.randn(256, generator=torch.Generator().manual_seed(trial)) / 16
        bad, _ = judge(values, result.center, result.radius, applied_by={2: wrong}, seed=bytes([trial]) * 32)
        caught += bad == [0]
    assert caught == 10


def test_a_member_cannot_widen_the_bound_for_a_colluding_reducer():
    """Uncertainties are the verifier's own: a member reporting huge norms or distances for itself
    (one far member, its distance capped at the radius) does not let a wrong result through."""
    values = members()
    result = centered_clip(values, torch.ones(4))
    wrong = result.center + 1.0 * torch.randn(256, generator=torch.Generator().manual_seed(1)) / 16
    seed = bytes(32)
    z = direction(seed, 1, 0, 256)
    precision = PartPrecision.of(torch.float32, CompressionType.NONE)
    verifier = Verifier(0, NUM_PARTS, dict.fromkeys(range(4), 1.0), OPTIONS, lambda span, part: precision)
    for i in range(4):
        row = part_row(values[i], wrong, result.radius, z)
        if i == 3:
            row = (row[0], 1e30, 1e30, row[3])  # the colluder's claims
        verifier.add(i, encode_report([0.0, 1.0], [[], [row]]))
    assert verifier.verdict().bad_parts[1] == [0]


def test_radii_weights_and_missing_reports():
    values = members(outlier=torch.full((256,), 50.0))
    result = centered_clip(values, torch.ones(4))
    bad, reason = judge(values, result.center, result.radius, radii={2: result.radius * 1.01})
    assert bad == [0] and "different radii" in reason
    inflated = centered_clip(values, torch.ones(4), radius=result.radius * 100)
    bad, reason = judge(values, inflated.center, inflated.radius)
    assert bad == [0] and "exceeds" in reason, "a radius far above the rule lets the outlier in"
    bad, reason = judge(values, result.center, result.radius, given={1: 5.0})
    assert bad == [0] and "gave sender 1 weight 5.0" in reason
    bad, reason = judge(values, result.center, result.radius, expected=dict.fromkeys(range(5), 1.0))
    assert bad == [0] and "no report from sender(s) [4]" in reason
    verifier = Verifier(0, NUM_PARTS, {0: 1.0}, OPTIONS, FLOAT32)
    # the reducer excluded it: no part, no weight
    verifier.add(0, encode_report([1.0, 0.0], [[], []]))
    assert verifier.verdict().bad_parts == [None, []]


def test_weights_shifted_by_the_reducer_fail_even_if_consistent():
    """A reducer that clips with weights of its own choosing, and tells each member that weight."""
    values = members()
    made_up = torch.tensor([1.0, 1.0, 1.0, 3.0])
    result = centered_clip(values, made_up)
    bad, reason = judge(
        values, result.center, result.radius, weights=made_up.tolist(), expected=dict.fromkeys(range(4), 1.0)
    )
    assert bad == [0] and "weight 3.0" in reason


def test_a_fixed_radius_must_be_the_configured_one():
    global OPTIONS
    values = members()
    OPTIONS, default = RobustAggregation(clip_radius=30.0), OPTIONS
    try:
        assert judge(values, centered_clip(values, torch.ones(4), radius=30.0).center, 30.0)[0] == []
        bad, reason = judge(values, centered_clip(values, torch.ones(4), radius=31.0).center, 31.0)
        assert bad == [0] and "configured 30.0" in reason
    finally:
        OPTIONS = default


def test_keep_answers():
    values = members()
    verifier = Verifier(0, NUM_PARTS, {0: 0.0, 1: 0.0}, OPTIONS, FLOAT32)
    for i in (0, 1):
        verifier.add(i, encode_report([0.0, 0.0], [[], [(0.0, 0.0, 0.0, 0.0)]]))
    assert verifier.verdict().bad_parts == [None, []]
    assert judge(values, values[0], 0.0)[0] == [0], "KEEP although the members had weight"
    assert judge(values[:2], values[0], 0.0)[0] == [], "KEEP is right below min_contributors"


def test_reports_are_checked_against_the_group():
    with pytest.raises(ValueError, match="32 bytes"):
        VerifyReport([1.0], [1], b"\0" * 31)
    report = encode_report([1.0, 1.0], [[], [(0.0, 0.0, 0.0, 1.0)] * 2])
    with pytest.raises(ValueError, match="span 1, which has 1"):
        decode_report(report, NUM_PARTS)
    with pytest.raises(ValueError, match="NaN"):
        decode_report(encode_report([1.0, 1.0], [[], [(float("nan"), 0.0, 0.0, 1.0)]]), NUM_PARTS)
    with pytest.raises(ValueError, match="the group has 3"):
        decode_report(encode_report([1.0], [[]]), [0, 1, 2])


def test_a_part_is_discarded_when_most_of_its_judges_say_so():
    spans = [2, 2, 2, 2]
    honest = [None, [], [], []]
    assert discarded_parts({0: [None, [1], [], []], 2: honest, 3: honest}, spans) == {}  # 1 of 3 judges
    verdicts = {0: [None, [1], [], []], 2: [[], [1], None, []], 3: [[], [0, 1], [], None]}
    assert discarded_parts(verdicts, spans) == {1: [1]}  # span 1, part 1: 3 of 3; part 0: 1 of 3
    assert discarded_parts({1: [[0], None, [], []]}, spans) == {0: [0]}  # a lone judge decides
    assert discarded_parts({0: [None, [0], [], []], 1: [[], None, [], []]}, spans) == {1: [0]}
    assert discarded_parts({0: [None, [0]]}, spans) == {}, "a verdict on another number of spans is ignored"
    assert np.array_equal(direction(b"s" * 32, 1, 2, 5), direction(b"s" * 32, 1, 2, 5))
    assert not np.array_equal(direction(b"s" * 32, 1, 2, 5), direction(b"s" * 32, 1, 3, 5))
