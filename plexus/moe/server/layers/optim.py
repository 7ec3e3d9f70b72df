"""Optimizer helpers for expert servers: global-norm clipping and the linear warm-up schedule."""

from collections.abc import Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR


class ClippingWrapper(torch.optim.Optimizer):
    """An optimizer that clips the global gradient norm of its parameters to `clip_grad_norm` first.

    It is an `Optimizer` (so LR schedulers accept it) whose groups and state are the wrapped one's.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, clip_grad_norm: float):
        # no super().__init__: every piece of state is the wrapped optimizer's
        self.optimizer, self.clip_grad_norm = optimizer, clip_grad_norm

    param_groups = property(lambda self: self.optimizer.param_groups)
    state = property(lambda self: self.optimizer.state)
    defaults = property(lambda self: self.optimizer.defaults)

    def _parameters(self) -> Iterable[torch.Tensor]:
        return (p for group in self.param_groups for p in group["params"])

    def step(self, closure=None):
        torch.nn.utils.clip_grad_norm_(list(self._parameters()), self.clip_grad_norm)
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict) -> None:
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"ClippingWrapper({self.optimizer!r}, clip_grad_norm={self.clip_grad_norm})"


def get_linear_schedule_with_warmup(
    optimizer: torch.optim.Optimizer, num_warmup_steps: int, num_training_steps: int
) -> LambdaLR:
    """LR rises linearly from 0 over `num_warmup_steps`, then falls linearly to 0 at `num_training_steps`."""
    if not 0 <= num_warmup_steps <= num_training_steps or num_training_steps <= 0:
        raise ValueError(
            f"need 0 <= num_warmup_steps ({num_warmup_steps}) <= num_training_steps "
            f"({num_training_steps}) and num_training_steps > 0"
        )

    def factor(step: int) -> float:
        if step < num_warmup_steps:
            return step / max(1, num_warmup_steps)
        return max(0.0, (num_training_steps - step) / max(1, num_training_steps - num_warmup_steps))

    return LambdaLR(optimizer, factor)


schedule_name_to_scheduler = {"linear": get_linear_schedule_with_warmup, "none": None}
