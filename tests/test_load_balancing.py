"""Load balancing: the LP split, its tie-breaking, min_size and exact integer apportionment."""

import math

import numpy as np
import pytest

from plexus.averaging.load_balancing import apportion, load_balance_peers, optimal_fractions

pytestmark = pytest.mark.timeout(30)


def busy_time(parts, bandwidths):
    """The LP's cost model: the slowest reducer's (1 + (n - 2) w_i) / b_i."""
    n, total = len(parts), sum(parts)
    return max((1 + (n - 2) * part / total) / b for part, b in zip(parts, bandwidths) if b > 0)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 16])
def test_equal_bandwidths_split_equally(n):
    assert load_balance_peers(n * 1000, [5.0] * n) == (1000,) * n
    parts = load_balance_peers(1001, [5.0] * n)
    assert sum(parts) == 1001 and max(parts) - min(parts) <= 1
    # ties go to the lower index, so every peer computes the same split
    assert list(parts) == sorted(parts, reverse=True)


def test_scale_does_not_matter():
    assert load_balance_peers(10_000, [1e9, 2e9, 3e9]) == load_balance_peers(10_000, [1, 2, 3])


def test_client_peers_get_nothing():
    parts = load_balance_peers(999, [1.0, 0.0, 1.0, 1.0])
    assert parts[1] == 0 and sum(parts) == 999 and sorted(parts) == [0, 333, 333, 333]
    assert load_balance_peers(10, [0, 0, 3]) == (0, 0, 10)


def test_faster_peer_gets_more():
    parts = load_balance_peers(100_000, [1.0, 1.0, 1.0, 4.0])
    assert parts[3] > max(parts[:3]) and parts[0] == parts[1] == parts[2]
    # the split is optimal for the LP: moving elements either way does not lower the busy time
    optimum = busy_time(parts, [1, 1, 1, 4])
    for shift in (-500, 500):
        moved = (parts[0] - shift, parts[1], parts[2], parts[3] + shift)
        assert busy_time(moved, [1, 1, 1, 4]) >= optimum - 1e-9


def test_two_peers_split_by_bandwidth():
    # with two peers every split costs the same in the model; we take the proportional one
    assert load_balance_peers(900, [2.0, 1.0]) == (600, 300)


def test_slow_bottleneck_does_not_dump_everything_on_one_peer():
    # peer 0 alone sets the round time; the others share the rest equally, not at a solver vertex
    assert load_balance_peers(900, [1.0, 100.0, 100.0, 100.0]) == (0, 300, 300, 300)


def test_matches_water_filling_when_optimum_is_unique():
    bandwidths = [4.0, 5.0, 6.0, 7.0]
    n, fractions = len(bandwidths), optimal_fractions(np.array(bandwidths))
    # unique optimum: every peer busy for the same time xi, w_i = (xi b_i - 1) / (n - 2) > 0,
    # and sum(w) = 1 gives xi = (2n - 2) / sum(b)
    xi = (2 * n - 2) / sum(bandwidths)
    expected = [(xi * b - 1) / (n - 2) for b in bandwidths]
    assert min(expected) > 0 and np.allclose(fractions, expected, atol=1e-8)


def test_missing_bandwidth_takes_mean_of_known():
    assert load_balance_peers(1200, [None, 2.0, 4.0]) == load_balance_peers(1200, [3.0, 2.0, 4.0])
    assert load_balance_peers(1200, [None, None, None]) == (400, 400, 400)
    assert load_balance_peers(1000, [None, 0.0]) == (1000, 0)


@pytest.mark.parametrize("vector_size", [0, 1, 2, 3, 17, 1000, 10**12 + 7])
def test_parts_sum_exactly(vector_size):
    for bandwidths in ([1.0], [1.0, 2.0], [0.3, 1.7, 2.9, 0.0, None], list(range(1, 20))):
        parts = load_balance_peers(vector_size, bandwidths)
        assert sum(parts) == vector_size and all(isinstance(p, int) and p >= 0 for p in parts)


def test_min_size_respected():
    parts = load_balance_peers(100, [1.0, 1.0, 1.0, 10.0], min_size=20)
    assert sum(parts) == 100 and all(p == 0 or p >= 20 for p in parts)
    parts = load_balance_peers(1000, [1.0] * 8, min_size=100)
    assert parts == (125,) * 8
    # everything under min_size: the first largest share takes it all
    assert load_balance_peers(10, [1.0, 1.0, 1.0, 1.0], min_size=20) == (10, 0, 0, 0)
    assert load_balance_peers(10, [0.0, 1.0, 3.0], min_size=20) == (0, 0, 10)


def test_single_peer():
    assert load_balance_peers(12345, [7.0]) == (12345,)
    assert load_balance_peers(12345, [None]) == (12345,)


def test_deterministic():
    bandwidths = [0.37, 1.91, 2.45, None, 0.0, 5.5]
    first = load_balance_peers(10**7 + 3, bandwidths, min_size=1000)
    assert all(load_balance_peers(10**7 + 3, bandwidths, min_size=1000) == first for _ in range(5))


@pytest.mark.parametrize(
    "bandwidths", [[1.0, -1.0], [math.nan, 1.0], [math.inf], [0.0, 0.0], [0], [], ["fast"], [True]]
)
def test_bad_bandwidths_rejected(bandwidths):
    with pytest.raises(ValueError):
        load_balance_peers(100, bandwidths)


def test_all_clients_error_says_why():
    with pytest.raises(ValueError, match="client mode"):
        load_balance_peers(100, [0.0, 0.0, 0.0])


@pytest.mark.parametrize("vector_size, min_size", [(-1, 0), (10, -1), (1.5, 0), (10, 2.0)])
def test_bad_sizes_rejected(vector_size, min_size):
    with pytest.raises(ValueError):
        load_balance_peers(vector_size, [1.0, 1.0], min_size=min_size)


def test_apportion_largest_remainder():
    assert apportion(10, np.array([1 / 3, 1 / 3, 1 / 3])) == (4, 3, 3)
    assert apportion(7, np.array([0.5, 0.0, 0.5])) == (4, 0, 3)
    assert apportion(10**15, np.array([0.1, 0.2, 0.7])) == (10**14, 2 * 10**14, 7 * 10**14)
