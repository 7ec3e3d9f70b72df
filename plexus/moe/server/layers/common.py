"""Built-in experts: `ffn`, `transformer`, `nop` and `nop_delay`."""

import time

import torch
from torch import nn

from .registry import register_expert_class


def _ffn_input(batch_size: int, hidden_dim: int) -> torch.Tensor:
    return torch.empty(batch_size, hidden_dim)


@register_expert_class("ffn", _ffn_input)
class FeedforwardBlock(nn.Module):
    """Linear(h, 4h) -> GELU (tanh approximation) -> Linear(4h, h), plus the input, then LayerNorm."""

    def __init__(self, hidden_dim: int):
        super().__init__()
        self.ffn = nn.Linear(hidden_dim, 4 * hidden_dim)
        self.ffn_output = nn.Linear(4 * hidden_dim, hidden_dim)
        self.layer_norm = nn.LayerNorm(hidden_dim, eps=1e-12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = nn.functional.gelu(self.ffn(x), approximate="tanh")
        return self.layer_norm(x + self.ffn_output(hidden))


def _transformer_input(batch_size: int, hidden_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(batch_size, 128, hidden_dim), torch.zeros(batch_size, 128, dtype=torch.bool)


@register_expert_class("transformer", _transformer_input)
class TransformerEncoderLayer(nn.Module):
    """A post-norm transformer encoder layer: 16 heads, feed-forward 4h, dropout 0.1.

    Inputs: `x` of shape (batch, seq, h) and a bool `mask` of shape (batch, seq), True at padding.
    Note: with dropout active, the server's backward (which recomputes the forward) draws a new
    dropout mask, so its gradients belong to a slightly different network than the forward that
    produced the outputs; use `det_dropout`-style explicit masks when that matters.
    """

    def __init__(self, hidden_dim: int, num_heads: int = 16, dropout: float = 0.1):
        super().__init__()
        if hidden_dim % num_heads:
            raise ValueError(
                f"the transformer expert needs hidden_dim divisible by {num_heads}, got {hidden_dim}"
            )
        self.layer = nn.TransformerEncoderLayer(
            hidden_dim, num_heads, dim_feedforward=4 * hidden_dim, dropout=dropout, batch_first=True
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.layer(x, src_key_padding_mask=mask)


@register_expert_class("nop", _ffn_input)
class NopExpert(nn.Module):
    """Returns its input; for measuring the network and the runtime alone."""

    def __init__(self, hidden_dim: int):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()


@register_expert_class("nop_delay", _ffn_input)
class DelayedNopExpert(NopExpert):
    """Returns its input after `delay` seconds of (blocking) sleep; for testing timeouts and load."""

    def __init__(self, hidden_dim: int, delay: float = 0.5):
        super().__init__(hidden_dim)
        self.delay = delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay)  # stands in for a slow computation on the compute thread
        return x.clone()
