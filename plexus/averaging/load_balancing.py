"""How much of the averaged vector each peer of a group reduces, given their bandwidths.

Theory of operation
-------------------
In a butterfly all-reduce of a vector of size V among n peers, peer i reduces a share w_i of it:
it receives w_i*V from each of the other n-1 peers and sends the result back, while it sends (and
gets back) its own (1 - w_i)*V to the others. Counting its traffic in units of V over its
bandwidth b_i, peer i is busy for about (1 + (n - 2) * w_i) / b_i. The round ends when the slowest
peer does, so we solve the linear program

    minimise xi  subject to  xi >= (1 + (n - 2) * w_i) / b_i  for every peer with b_i > 0,
                             sum(w) = 1,  w >= 0,  w_i = 0 where b_i = 0 (client-mode peers),

with scipy's HiGHS solver. Its optimum is often not unique: with n = 2 every split costs the same,
and when one slow peer sets xi on its own, the others have slack. A solver then returns any vertex,
which can hand the whole vector to one peer. So a second LP picks, among the optimal splits, the
one closest to proportional to bandwidth (it minimises the largest w_i / b_i); that choice is
unique, so equal bandwidths always give equal shares.

Shares under `min_size` elements are dropped and the rest re-normalised (if every share is under
it, the largest takes everything). The fractions are rounded to 9 decimals and turned into
integers by the largest-remainder method in exact integer arithmetic, so the parts sum to V
exactly, each is within one element of its exact quota, and ties go to the lower index: the result
is the same on every peer.

Missing bandwidths (None) take the mean of the positive ones given (1.0 when none is given).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import numpy as np

logger = logging.getLogger(__name__)

DECIMALS = 9  # fractions are rounded to this many decimals before apportionment
SCALE = 10**DECIMALS
_HIGHS_OPTIONS = {"primal_feasibility_tolerance": 1e-10, "dual_feasibility_tolerance": 1e-10}
_OPTIMUM_SLACK = 1e-9  # relative slack on xi when choosing among optimal splits
_NEGLIGIBLE = 1e-7  # fractions below this are solver tolerance at work and become 0


def load_balance_peers(
    vector_size: int, bandwidths: Sequence[float | None], min_size: int = 0
) -> tuple[int, ...]:
    """Split `vector_size` elements among peers so that the slowest one finishes soonest.

    Args:
        vector_size: total number of elements to split.
        bandwidths: one per peer, in the group's order: a positive speed (any unit), 0 for a peer
            that reduces nothing (client mode), or None when unknown.
        min_size: a peer whose share would be smaller than this gets nothing.

    Returns:
        one int per peer, summing to `vector_size`.

    Raises:
        ValueError: on a negative, NaN or infinite bandwidth, an empty group, negative sizes, or when
            every bandwidth is 0 (nobody can reduce: a group needs at least one non-client peer).
    """
    if isinstance(vector_size, bool) or not isinstance(vector_size, (int, np.integer)) or vector_size < 0:
        raise ValueError(f"vector_size must be a non-negative int, got {vector_size!r}")
    if isinstance(min_size, bool) or not isinstance(min_size, (int, np.integer)) or min_size < 0:
        raise ValueError(f"min_size must be a non-negative int, got {min_size!r}")
    speeds = _fill_missing(bandwidths)
    fractions = optimal_fractions(speeds)
    if vector_size == 0:
        return (0,) * len(speeds)
    small = fractions * vector_size < min_size
    if small.all():
        winner = int(np.argmax(fractions))  # the first of the largest shares
        fractions = np.zeros_like(fractions)
        fractions[winner] = 1.0
    else:
        fractions = np.where(small, 0.0, fractions)
    return apportion(vector_size, fractions)


def _fill_missing(bandwidths: Sequence[float | None]) -> np.ndarray:
    if len(bandwidths) == 0:
        raise ValueError("cannot split a vector among zero peers")
    known = []
    for index, value in enumerate(bandwidths):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise ValueError(f"bandwidth of peer {index} must be a number or None, got {value!r}")
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"bandwidth of peer {index} must be finite and >= 0, got {value!r}")
        known.append(float(value))
    positive = [value for value in known if value > 0]
    default = float(np.mean(positive)) if positive else 1.0
    speeds = np.array([default if value is None else float(value) for value in bandwidths])
    if not (speeds > 0).any():
        raise ValueError(
            f"all {len(speeds)} peers have bandwidth 0 (client mode), so nobody can reduce; "
            "a group needs at least one peer that accepts incoming connections"
        )
    return speeds


def optimal_fractions(speeds: np.ndarray) -> np.ndarray:
    """The fraction of the vector each peer reduces (sums to 1; 0 where the speed is 0)."""
    n = len(speeds)
    reducers = np.flatnonzero(speeds > 0)
    if len(reducers) == 1:
        fractions = np.zeros(n)
        fractions[reducers[0]] = 1.0
        return fractions
    # imported here: scipy.optimize takes ~0.4 s, paid when a group first forms, not by `import plexus`
    from scipy.optimize import linprog

    b = speeds / speeds.max()  # the LP is scale-free; keep its numbers near 1
    bounds = [(0.0, None) if speed > 0 else (0.0, 0.0) for speed in b] + [(0.0, None)]
    a_eq, b_eq = np.append(np.ones(n), 0.0)[None, :], [1.0]

    # Stage 1: the least time of the slowest peer, xi*.
    a_ub = np.zeros((len(reducers), n + 1))
    a_ub[np.arange(len(reducers)), reducers] = (n - 2) / b[reducers]
    a_ub[:, n] = -1.0
    cost = np.append(np.zeros(n), 1.0)
    b_ub = -1.0 / b[reducers]
    first = linprog(cost, a_ub, b_ub, a_eq, b_eq, bounds, method="highs", options=_HIGHS_OPTIONS)
    if first.status != 0:
        return _proportional(speeds, f"stage 1: {first.message}")
    xi = first.x[n] * (1 + _OPTIMUM_SLACK)

    # Stage 2: among splits that keep every peer within xi*, the one closest to proportional.
    rows, limits = [], []
    for i in reducers:
        share_row = np.zeros(n + 1)
        share_row[i], share_row[n] = 1.0, -b[i]  # w_i <= lambda * b_i
        rows.append(share_row)
        limits.append(0.0)
        if n > 2:
            time_row = np.zeros(n + 1)
            time_row[i] = n - 2  # (1 + (n - 2) w_i) / b_i <= xi*
            rows.append(time_row)
            limits.append(xi * b[i] - 1.0 + _OPTIMUM_SLACK)
    second = linprog(cost, np.array(rows), limits, a_eq, b_eq, bounds, method="highs", options=_HIGHS_OPTIONS)
    if second.status != 0:
        return _proportional(speeds, f"stage 2: {second.message}")
    fractions = second.x[:n]
    fractions = np.where(fractions < _NEGLIGIBLE, 0.0, fractions)  # solver residue, not a share
    return fractions / fractions.sum()


def _proportional(speeds: np.ndarray, reason: str) -> np.ndarray:
    logger.warning("load balancing LP failed (%s); splitting in proportion to bandwidth instead", reason)
    return speeds / speeds.sum()


def apportion(total: int, fractions: np.ndarray) -> tuple[int, ...]:
    """Integer parts summing to `total`, by largest remainder over fractions rounded to 9
    decimals (exact integer arithmetic; ties to the lower index)."""
    quotas = [int(q) for q in np.round(np.asarray(fractions, dtype=np.float64) * SCALE)]
    denominator = sum(quotas)
    if denominator <= 0:
        raise ValueError("cannot apportion: every fraction is zero")
    parts = [total * q // denominator for q in quotas]
    remainders = [total * q % denominator for q in quotas]
    leftover = total - sum(parts)
    for index in sorted(range(len(quotas)), key=lambda i: (-remainders[i], i))[:leftover]:
        parts[index] += 1
    return tuple(parts)
