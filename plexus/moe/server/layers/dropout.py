"""`det_dropout`: dropout whose mask is an input, so a recomputed forward (as in backward) is exact."""

import torch
from torch import nn

from .registry import register_expert_class


def _det_dropout_input(batch_size: int, hidden_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(batch_size, hidden_dim), torch.ones(batch_size, hidden_dim, dtype=torch.bool)


def deterministic_dropout(x: torch.Tensor, keep_mask: torch.Tensor, drop_prob: float) -> torch.Tensor:
    """Inverted dropout with a given mask: kept units are scaled by 1 / (1 - drop_prob)."""
    return x * keep_mask.to(x.dtype) / (1.0 - drop_prob)


@register_expert_class("det_dropout", _det_dropout_input)
class DeterministicDropoutNetwork(nn.Module):
    """Dropout (mask given by the caller), Linear(h, 2h), ReLU, Linear(2h, h).

    The client draws the mask (`torch.rand(batch, h) >= drop_prob`), so the server's stateless
    backward, which reruns the forward, sees the same mask and the gradients are exact.
    """

    def __init__(self, hidden_dim: int, drop_prob: float = 0.2):
        super().__init__()
        self.drop_prob = drop_prob
        self.linear_in = nn.Linear(hidden_dim, 2 * hidden_dim)
        self.linear_out = nn.Linear(2 * hidden_dim, hidden_dim)

    def forward(self, x: torch.Tensor, keep_mask: torch.Tensor) -> torch.Tensor:
        if self.training:
            x = deterministic_dropout(x, keep_mask, self.drop_prob)
        return self.linear_out(torch.relu(self.linear_in(x)))
