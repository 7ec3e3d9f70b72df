"""CenteredClip: a robust weighted average of a few vectors, as pure torch functions.

Theory of operation
-------------------
CenteredClip (Karimireddy, He and Jaggi, "Learning from History for Byzantine Robust
Optimization", 2021) looks for the point v where the clipped differences balance:

    sum_i w_i * clip(x_i - v, tau) = 0,   clip(d, tau) = d * min(1, tau / ||d||),

by the fixed-point iteration v <- v + sum_i w_i clip(x_i - v, tau) / sum_i w_i. A member
within tau of v pulls with its whole difference, a member farther away with a pull of length
tau, so one member moves v away from the others' mean by at most tau * w_i / (the others' total
weight) however far away it is, while the others stay within tau of v. When every
member lies within tau of the weighted mean, the mean itself is the fixed point and the result
is exactly the plain weighted mean (up to float rounding).

ButterflyClip ("Secure Distributed Training at Scale", Gorbunov et al., 2022) runs it inside a
butterfly all-reduce: each reducer applies CenteredClip to the parts of its own span. We do it per
part, so the reducer needs every member's values of one part at a time, never a whole span.

Radius. Either fixed (an absolute L2 radius per part), or adaptive: `factor` times the median
distance of the members to their coordinate-wise median, computed once per part before the
iteration (the coordinate-wise median is also where the iteration starts). The adaptive radius
scales with the part's size and the members' spread, so one default fits gradients and parameters
of any magnitude; a member must be `factor` times farther from the others than the median member
before it is clipped at all.

Stopping. The iteration stops when a step is shorter than `tolerance * tau` (plus the float
rounding floor of the accumulator, `eps * ||v||`: below it a step no longer changes v). Then the
residual `sum_i w_i clip(x_i - v, tau)` is at most that bound times the total weight, which is what
`verification.py` checks reducers against.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

MIN_RADIUS = 1e-20  # the adaptive radius never goes below this (members that coincide exactly)
SORTING_NETWORK_MAX = 8  # groups up to this size sort each coordinate by elementwise min/max


class ClipResult(NamedTuple):
    center: torch.Tensor
    radius: float
    iterations: int
    converged: bool


def norm(values: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """L2 norm (float64 result), again in float64 when the values' own precision overflows: float32
    squares overflow from about 1e19 on, and a member that sends 1e30 must be clipped, not ignored."""
    norms = torch.linalg.vector_norm(values, dim=dim, keepdim=keepdim)
    if not bool(torch.isfinite(norms).all()):
        norms = torch.linalg.vector_norm(values, dim=dim, keepdim=keepdim, dtype=torch.float64)
    return norms.double()


def clip_to_radius(differences: torch.Tensor, radius: float) -> torch.Tensor:
    """Each row of `differences` (n x d) scaled down to L2 norm at most `radius` (rows of norm 0 stay 0)."""
    norms = norm(differences, dim=1, keepdim=True)
    scale = torch.where(norms > radius, radius / norms.clamp_min(torch.finfo(norms.dtype).tiny), 1.0)
    return differences * scale.to(differences.dtype)


def coordinate_median(values: torch.Tensor) -> torch.Tensor:
    """The median of each column of `values` (n x d); the mean of the two middle values for even n."""
    n = values.shape[0]
    if n <= SORTING_NETWORK_MAX:  # odd-even transposition: ~n^2/2 elementwise passes, 5-10x faster
        ordered: list[torch.Tensor] | torch.Tensor = list(
            values.unbind(0)
        )  # than torch.sort along a short, strided dimension
        for step in range(n):
            for i in range(step % 2, n - 1, 2):
                ordered[i], ordered[i + 1] = (
                    torch.minimum(ordered[i], ordered[i + 1]),
                    torch.maximum(ordered[i], ordered[i + 1]),
                )
    else:
        ordered = values.sort(dim=0).values
    if n % 2:
        return ordered[n // 2].clone()
    return (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def median(values: torch.Tensor) -> float:
    """The median of a 1-D tensor (the mean of the two middle values for an even count)."""
    return float(coordinate_median(values[:, None])[0])


def adaptive_radius(values: torch.Tensor, center: torch.Tensor, factor: float) -> float:
    """`factor` x the median L2 distance of the rows of `values` to `center` (at least MIN_RADIUS)."""
    distances = norm(values - center, dim=1)
    return max(factor * median(distances), MIN_RADIUS)


def rounding_floor(center: torch.Tensor) -> float:
    """The shortest step that still moves `center` in its own precision: eps * ||center||."""
    return torch.finfo(center.dtype).eps * float(norm(center))


def centered_clip(
    values: torch.Tensor,
    weights: torch.Tensor,
    *,
    radius: float | None = None,
    radius_factor: float = 1.5,
    tolerance: float = 1e-6,
    max_iterations: int = 1000,
) -> ClipResult:
    """The CenteredClip fixed point of the rows of `values` (n x d, floating) with `weights` (n, > 0).

    Args:
        radius: a fixed clipping radius; None for the adaptive one (`radius_factor` x the median
            distance to the coordinate-wise median).
        tolerance: stop when a step is shorter than `tolerance * radius` (plus the rounding floor).
        max_iterations: stop anyway after this many steps (`converged` is then False).

    Returns the center (a new 1-D tensor of `values`' dtype), the radius used, the number of steps
    and whether the stopping rule was met.
    """
    if values.ndim != 2 or values.shape[0] != weights.shape[0] or values.shape[0] == 0:
        raise ValueError(
            f"need values of shape (n, d) with n >= 1 and n weights, got {tuple(values.shape)} "
            f"and {tuple(weights.shape)}"
        )
    weights = weights.to(values.dtype)
    if not bool((weights > 0).all()):
        raise ValueError("every weight must be positive (leave members of weight 0 out)")
    center = coordinate_median(values)
    if radius is None:
        radius = adaptive_radius(values, center, radius_factor)
    if not (math.isfinite(radius) and radius > 0):
        raise ValueError(f"the clipping radius must be finite and positive, got {radius}")
    shares = (weights / weights.sum())[:, None]
    for iteration in range(1, max_iterations + 1):
        step = (clip_to_radius(values - center, radius) * shares).sum(dim=0)
        center += step
        if float(norm(step)) <= tolerance * radius + rounding_floor(center):
            return ClipResult(center, radius, iteration, True)
    return ClipResult(center, radius, max_iterations, False)
