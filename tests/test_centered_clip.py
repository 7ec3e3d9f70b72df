"""CenteredClip and the weight bounds, as pure functions: exact means for honest members, bounded pull
for a bad one, and the fixed point the reducers are verified against."""

import pytest
import torch

from plexus.averaging.aggregation import ClippedPart, RobustAggregation, bounded_weights, lower_median
from plexus.averaging.centered_clip import (
    MIN_RADIUS,
    adaptive_radius,
    centered_clip,
    clip_to_radius,
    coordinate_median,
)

pytestmark = pytest.mark.timeout(60)
HONEST_TOLERANCE = 1e-5  # of the members' median distance to their mean; the docstrings state it
EPS32 = torch.finfo(torch.float32).eps


def residual(values, weights, center, radius) -> float:
    pulls = clip_to_radius(values - center, radius) * weights[:, None]
    return float(torch.linalg.vector_norm(pulls.sum(0)))


def test_clip_to_radius_shortens_only_the_long_rows():
    rows = torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]])
    clipped = clip_to_radius(rows, 1.0)
    torch.testing.assert_close(clipped, torch.tensor([[0.6, 0.8], [0.3, 0.4], [0.0, 0.0]]))


def test_coordinate_median_of_odd_and_even_counts():
    values = torch.tensor([[1.0, 10.0], [3.0, -5.0], [2.0, 0.0], [100.0, 1.0]])
    assert torch.equal(coordinate_median(values[:3]), torch.tensor([2.0, 0.0]))
    assert torch.equal(coordinate_median(values), torch.tensor([2.5, 0.5]))


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("numel", [64, 256, 4096])
def test_honest_members_get_their_plain_mean(n, numel):
    """Parts of >= 64 elements: exactly the weighted mean up to float rounding, whatever the scale and
    offset of the values: within HONEST_TOLERANCE of the spread (measured: < 2e-7) plus the float32
    rounding of the values themselves, which the plain float32 mean has too."""
    generator = torch.Generator().manual_seed(n * 1000 + numel)
    for trial in range(30):
        scale, offset = 10.0 ** (trial % 7 - 3), float(trial)
        values = torch.randn(n, numel, generator=generator) * scale + offset
        weights = torch.rand(n, generator=generator) + 0.5
        result = centered_clip(values, weights)
        mean = (values.double() * weights.double()[:, None]).sum(0) / weights.double().sum()
        spread = float(torch.linalg.vector_norm(values.double() - mean, dim=1).median())
        assert result.converged
        rounding = 8 * EPS32 * float(torch.linalg.vector_norm(mean))
        error = float(torch.linalg.vector_norm(result.center.double() - mean))
        assert error <= HONEST_TOLERANCE * spread + rounding


@pytest.mark.parametrize("attack", [1e3, 1e30, -1e3])
def test_one_far_member_moves_the_result_by_at_most_its_share_of_the_radius(attack):
    generator = torch.Generator().manual_seed(7)
    honest = torch.randn(3, 512, generator=generator) + 1.0
    values = torch.cat([honest, honest.mean(0, keepdim=True) * attack])
    result = centered_clip(values, torch.ones(4))
    honest_mean = honest.double().mean(0)
    shift = float(torch.linalg.vector_norm(result.center.double() - honest_mean))
    assert shift <= result.radius / 3 * 1.01  # one of four equal weights: tau / the others' weight
    assert torch.isfinite(result.center).all()
    assert (
        residual(values.double(), torch.ones(4, dtype=torch.float64), result.center.double(), result.radius)
        <= 4 * 1e-6 * result.radius * 10
    )


def test_the_result_is_a_fixed_point_and_the_radius_is_the_rule():
    generator = torch.Generator().manual_seed(3)
    values = torch.cat([torch.randn(5, 100, generator=generator), torch.full((2, 100), 50.0)]).double()
    weights = torch.tensor([1.0, 2.0, 1.0, 1.0, 3.0, 1.0, 1.0], dtype=torch.float64)
    result = centered_clip(values, weights, radius_factor=2.0, tolerance=1e-9)
    assert result.radius == pytest.approx(adaptive_radius(values, coordinate_median(values), 2.0))
    default = adaptive_radius(values, coordinate_median(values), 1.5)
    assert centered_clip(values, weights).radius == pytest.approx(default)
    assert result.converged and result.iterations > 2  # members were clipped: more than the mean's one step
    assert residual(values, weights, result.center, result.radius) <= 1e-8 * result.radius * weights.sum()
    fixed = centered_clip(values, weights, radius=0.5)
    assert fixed.radius == 0.5


def test_coinciding_members_and_a_fixed_radius_below_the_spread():
    same = torch.zeros(3, 16)
    assert torch.equal(centered_clip(same, torch.ones(3)).center, torch.zeros(16))
    assert adaptive_radius(same, torch.zeros(16), 4.0) == MIN_RADIUS
    values = torch.cat([torch.zeros(2, 16), torch.ones(1, 16)])
    capped = centered_clip(values, torch.ones(3), radius=1e-3, max_iterations=3)
    assert not capped.converged and capped.iterations == 3


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="positive"):
        centered_clip(torch.ones(2, 3), torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="shape"):
        centered_clip(torch.ones(3), torch.ones(3))
    with pytest.raises(ValueError, match="radius"):
        RobustAggregation(clip_radius=-1.0)
    with pytest.raises(ValueError, match="min_contributors"):
        RobustAggregation(min_contributors=0)


def test_weights_are_bounded_by_limits_and_by_the_groups_median():
    declared = {0: 1.0, 1: 2.0, 2: 1e9, 3: 0.0}
    assert lower_median([3, 1, 2, 4]) == 2
    assert bounded_weights(declared, {}, 8.0) == {0: 1.0, 1: 2.0, 2: 16.0, 3: 0.0}  # 8 x the lower median 2
    assert bounded_weights(declared, {1: 1.5, 2: 3.0}, 8.0) == {0: 1.0, 1: 1.5, 2: 3.0, 3: 0.0}
    assert bounded_weights({0: 0.0, 1: 0.0}, {}, 8.0) == {0: 0.0, 1: 0.0}


def test_a_clipped_part_forgets_an_excluded_member_and_skips_zero_weights():
    two = ClippedPart(RobustAggregation())
    two.add(0, torch.ones(8), 1.0, None)
    two.add(1, torch.full((8,), 3.0), 1.0, None)
    assert two.average() == (None, None), "two members cannot outvote each other: nobody's values move"
    part = ClippedPart(RobustAggregation(min_contributors=1))
    part.add(0, torch.ones(8), 1.0, None)
    part.add(1, torch.full((8,), 3.0), 1.0, None)
    part.add(2, torch.full((8,), 1e6), 0.0, None)
    assert torch.equal(part.average()[0], torch.full((8,), 2.0))
    part.drop(1)
    assert torch.equal(part.average()[0], torch.ones(8))
    part.drop(0)
    assert part.average() == (None, None)
