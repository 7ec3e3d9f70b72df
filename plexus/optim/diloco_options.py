"""`DiLoCoOptions`: every knob of a `DiLoCoOptimizer`, each with its default and what it is for."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import UsageError

PSEUDO_GRADIENT_COMPRESSIONS = ("none", "fp16", "bf16", "int8", "int4")


def default_outer_optimizer(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """The paper's outer optimizer: SGD with Nesterov momentum 0.9 and learning rate 0.7."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


@dataclass(frozen=True)
class DiLoCoOptions:
    """How a `DiLoCoOptimizer` trains: when rounds end, how pseudo-gradients travel, what is overlapped.

    Exactly one of `target_batch_size` and `inner_steps` says when a round ends."""

    target_batch_size: int | None = None
    """A round ends when the whole swarm has processed this many samples since the last one
    (counted by the `ProgressTracker`, as `plexus.Optimizer` counts an epoch)."""
    inner_steps: int | None = None
    """A round ends after this many local inner steps (the paper's H). Needed for `fragments > 1`."""
    batch_size_per_step: int | None = None
    """Samples per `step()` when `step(batch_size=...)` is not given; they weigh this peer's
    pseudo-gradient in the average."""
    outer_optimizer: Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer] = default_outer_optimizer
    """Builds the outer optimizer from parameters (e.g. `functools.partial(torch.optim.SGD, lr=0.7)`)."""
    compression: str = "none"
    """How pseudo-gradients travel: "none" (float32), "fp16", "bf16", "int8" (blockwise 8-bit) or
    "int4" (blockwise 4-bit); see `pseudo_gradient.py`."""
    error_feedback: bool = True
    """Keep what compression lost of this peer's pseudo-gradient and add it to the next round's."""
    fragments: int = 1
    """Streaming DiLoCo: the parameters are cut into this many fragments whose rounds are staggered
    by `inner_steps / fragments` steps; each sends only its fragment's pseudo-gradient."""
    overlap: bool | None = None
    """Let a round's all-reduce run while inner steps go on, and apply its result when it arrives
    (at the latest before that fragment's next round: at most one round stale). Default: on when
    `fragments > 1`."""
    mixing: float = 0.5
    """When an overlapped round's result arrives, the fragment's parameters become
    `mixing * local + (1 - mixing) * global` (local: where inner steps took them meanwhile)."""
    matchmaking_time: float = 5.0
    """Seconds a peer that reached a round's end waits for the others to join its group."""
    averaging_timeout: float = 60.0
    """Seconds a round may take before the peer gives up and applies its own pseudo-gradient."""
    load_state_timeout: float = 60.0
    """Seconds for downloading parameters and outer optimizer state from a peer."""
    averager_opts: dict[str, Any] = field(default_factory=dict)
    """Passed on to every `DecentralizedAverager` (e.g. `robust=plexus.RobustAggregation()`,
    `target_group_size`, `request_timeout`)."""
    tracker_opts: dict[str, Any] = field(default_factory=dict)
    """Passed on to the `ProgressTracker` (e.g. `min_refresh_period`)."""

    def __post_init__(self):
        if (self.target_batch_size is None) == (self.inner_steps is None):
            raise UsageError("give exactly one of target_batch_size and inner_steps (when a round ends)")
        for name in ("target_batch_size", "inner_steps", "batch_size_per_step"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and value >= 1):
                raise UsageError(f"{name} must be a positive integer, got {value!r}")
        if self.compression not in PSEUDO_GRADIENT_COMPRESSIONS:
            raise UsageError(
                f"compression must be one of {', '.join(PSEUDO_GRADIENT_COMPRESSIONS)}, got {self.compression!r}"
            )
        if not (isinstance(self.fragments, int) and self.fragments >= 1):
            raise UsageError(f"fragments must be a positive integer, got {self.fragments!r}")
        if self.fragments > 1 and self.inner_steps is None:
            raise UsageError("fragments > 1 staggers rounds by inner steps: give inner_steps")
        if self.inner_steps is not None and self.fragments > self.inner_steps:
            raise UsageError(f"fragments ({self.fragments}) cannot exceed inner_steps ({self.inner_steps})")
        if not 0 <= self.mixing <= 1:
            raise UsageError(f"mixing must be in [0, 1], got {self.mixing!r}")
        for name in ("matchmaking_time", "averaging_timeout", "load_state_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise UsageError(f"{name} must be a positive number of seconds, got {value!r}")
        if not callable(self.outer_optimizer):
            raise UsageError("outer_optimizer must be a factory: params -> torch.optim.Optimizer")
        robust = self.averager_opts.get("robust")
        if robust is not None and getattr(robust, "verify", False):
            raise UsageError(
                "DiLoCoOptimizer does not support verified reducers yet: pass "
                "robust=RobustAggregation(verify=False) (CenteredClip stays on)"
            )
        reserved = {"prefix", "start", "dht", "averaged_tensors", "compression"} & set(self.averager_opts)
        if reserved:
            raise UsageError(f"averager_opts may not set {sorted(reserved)}: DiLoCoOptimizer sets them")

    @property
    def overlapped(self) -> bool:
        return self.fragments > 1 if self.overlap is None else self.overlap


def sgd_outer_optimizer(lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True):
    """A factory for an SGD outer optimizer with other hyper-parameters than the default."""
    return functools.partial(torch.optim.SGD, lr=lr, momentum=momentum, nesterov=nesterov)
