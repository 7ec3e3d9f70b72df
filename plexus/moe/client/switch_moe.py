"""RemoteSwitchMixtureOfExperts: a Switch-Transformer-style mixture with a load-balancing loss.

Differences from RemoteMixtureOfExperts (hivemind's variant, after Fedus et al., 2021):

- in training, the gate's input is jittered multiplicatively by U(1 - jitter_eps, 1 + jitter_eps),
  and each grid coordinate is kept with probability `grid_dropout` (at least one per dimension);
- each grid dimension has its own softmax; an expert's weight is the product of its coordinates'
  probabilities, with no renormalisation over the experts that answered (a missing expert just
  contributes nothing, so defaults allow zero answers: k_best=1, k_min=0, backward_k_min=0);
- an exponential moving average of how often each coordinate is used (`utilization_alpha`) feeds
  the balancing loss `sum over dims of size * sum_c mean_prob[c] * utilization[c]`, which is 1 per
  dimension when routing is uniform and grows as it concentrates. (Switch's `N * sum f_i * P_i`;
  the gradient flows through the probabilities.)
- forward returns `(output + input, balancing_loss)`: a residual connection around the experts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import cast

import torch

from .moe import RemoteMixtureOfExperts


class RemoteSwitchMixtureOfExperts(RemoteMixtureOfExperts):
    """A switch mixture over remote experts; see RemoteMixtureOfExperts for the shared arguments.

    Args:
        utilization_alpha: EMA factor of the per-coordinate utilisation.
        grid_dropout: probability of keeping each grid coordinate in training (1.0: no dropout).
        jitter_eps: multiplicative jitter of the gate's input in training (0: none).
    """

    def __init__(
        self,
        *,
        grid_size: Sequence[int],
        utilization_alpha: float = 0.9,
        grid_dropout: float = 1.0,
        jitter_eps: float = 1e-2,
        k_best: int = 1,
        k_min: int = 0,
        backward_k_min: int = 0,
        allow_zero_outputs: bool = True,
        **kwargs,
    ):
        super().__init__(
            grid_size=grid_size,
            k_best=k_best,
            k_min=k_min,
            backward_k_min=backward_k_min,
            allow_zero_outputs=allow_zero_outputs,
            **kwargs,
        )
        if not 0 < grid_dropout <= 1 or not 0 <= utilization_alpha <= 1 or jitter_eps < 0:
            raise ValueError("need 0 < grid_dropout <= 1, 0 <= utilization_alpha <= 1 and jitter_eps >= 0")
        self.utilization_alpha, self.grid_dropout = utilization_alpha, grid_dropout
        self.jitter_eps = jitter_eps
        for dim, size in enumerate(self.grid_size):
            self.register_buffer(f"grid_utilization_{dim}", torch.full((size,), 1.0 / size))

    @property
    def grid_utilization(self) -> list[torch.Tensor]:
        return [getattr(self, f"grid_utilization_{dim}") for dim in range(len(self.grid_size))]

    def forward(self, input: torch.Tensor, *args: torch.Tensor, **kwargs: torch.Tensor):
        deadline = None if self.forward_timeout is None else time.monotonic() + self.forward_timeout
        gating_input = self._gating_input(input)
        if self.training and self.jitter_eps > 0:
            gating_input = gating_input * torch.empty_like(gating_input).uniform_(
                1 - self.jitter_eps, 1 + self.jitter_eps
            )
        grid_scores = list(self.proj(gating_input).split(self.grid_size, dim=-1))
        if self.training and self.grid_dropout < 1:
            grid_scores = [self._drop_coordinates(scores) for scores in grid_scores]
        grid_probs = [torch.softmax(scores, dim=-1) for scores in grid_scores]

        chosen, schema = self._find_experts(grid_scores, deadline)
        mask, expert_outputs = self._call_experts(chosen, schema, deadline, input, args, kwargs)
        coordinates = self.chosen_coordinates(chosen, input.device)
        weights = mask.to(grid_probs[0].dtype)
        for dim, probs in enumerate(grid_probs):
            weights = weights * probs.gather(1, coordinates[..., dim])
        outputs = self._average(expert_outputs, weights)
        if self.training:
            self._update_utilization(coordinates, mask)
        balancing_loss = self.compute_balancing_loss(grid_probs)
        if outputs[0].shape == input.shape:
            outputs[0] = outputs[0] + input
        return (tuple(outputs) if schema.outputs_tuple else outputs[0]), balancing_loss

    def _drop_coordinates(self, scores: torch.Tensor) -> torch.Tensor:
        keep = torch.rand(scores.shape[-1], device=scores.device) < self.grid_dropout
        if not keep.any():
            keep[torch.randint(scores.shape[-1], (1,))] = True
        return torch.where(keep, scores, torch.full_like(scores, float("-inf")))

    @torch.no_grad()
    def _update_utilization(self, coordinates: torch.Tensor, mask: torch.Tensor) -> None:
        answered = int(mask.sum())
        if answered == 0:
            return
        for dim, (size, utilization) in enumerate(zip(self.grid_size, self.grid_utilization)):
            used = coordinates[..., dim][mask.to(coordinates.device)]
            counts = torch.bincount(used, minlength=size).to(utilization)
            utilization.mul_(self.utilization_alpha).add_(counts / answered, alpha=1 - self.utilization_alpha)

    def compute_balancing_loss(self, grid_probs: Sequence[torch.Tensor]) -> torch.Tensor:
        """sum over dims of size * <mean probability, utilisation>: 1 per dimension when balanced."""
        total = sum(
            size * (probs.mean(dim=0) * utilization.to(probs)).sum()
            for size, probs, utilization in zip(self.grid_size, grid_probs, self.grid_utilization)
        )
        return cast(torch.Tensor, total)  # a grid has at least one dimension, so never sum()'s 0
