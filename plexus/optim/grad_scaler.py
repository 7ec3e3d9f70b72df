"""`GradScaler`: torch's AMP loss scaler, taught that a collaborative optimizer steps only sometimes.

With `plexus.Optimizer`, `scaler.step(opt)` after each micro-batch only *accumulates*; the real
(global) step happens when the swarm has gathered its target batch, maybe many calls later, and
the gradients may live in `.grad` the whole time (`reuse_grad_buffers`). A plain torch scaler would
unscale the same `.grad` buffers after every micro-batch (dividing them by the scale again and
again) and count each call as a successful step towards growing the scale. So:

* between global steps, `unscale_` and `step` never change gradients: they only check them for
  inf/NaN and record what they found, and `step` hands the plexus Optimizer itself (which looks at
  `are_grads_finite` to throw away poisoned accumulators);
* `update` after such a call grows nothing. If infs were recorded it backs the scale off at once
  (hivemind waits for the next global step, but with every micro-batch overflowing there would
  never be one; backing off now is what lets training recover) and resets the growth counter;
* inside `running_global_step()` (entered by the Optimizer), `unscale_` unscales for real, once
  per global step (typically the accumulated `.grad` before they are averaged), and `step` is
  torch's step on the inner optimizer: it unscales the inner optimizer's gradients itself unless
  `unscale_` already ran in this global step (since the last `update`), and skips the step if that
  found infs. The Optimizer may enter the block twice (unscale, average outside, step). The next
  `update` is a real one: backoff on infs, growth after `growth_interval` consecutive real steps;
* unscaling fp16 gradients is allowed (`allow_fp16`): fp16 master weights are the point of using
  reuse_grad_buffers with AMP.

Works for any device torch.amp supports, including "cpu" (used by the tests).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from ..utils.logging import get_logger

logger = get_logger(__name__)


class GradScaler(torch.amp.GradScaler):
    """Same constructor as `torch.amp.GradScaler(device, init_scale, growth_factor, backoff_factor,
    growth_interval, enabled)`; the behaviour between global steps is described above."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._lock = threading.RLock()  # the Optimizer may run its global step on another thread
        self._running_global_step = False
        self._stepped_globally = False  # a real step happened since the last update()
        self._infs_between_steps = False  # some local check since the last update() saw inf/NaN
        self._finite: dict[int, bool] = {}  # id(optimizer) -> result of its last local check
        self._global_found_inf: dict | None = None  # what this global step's unscale_ found, per device

    @contextlib.contextmanager
    def running_global_step(self) -> Iterator[None]:
        """Inside this block unscale_/step act for real (the Optimizer's global step).

        The block holds the scaler's lock, so keep it short: enter it once to unscale_ and again
        to step the inner optimizer, and average in between, outside it. What unscale_ found
        holds until update()."""
        with self._lock:
            was_running, self._running_global_step = self._running_global_step, True
            try:
                yield
            finally:
                self._running_global_step = was_running

    @property
    def is_running_global_step(self) -> bool:
        return self._running_global_step

    def are_grads_finite(self, optimizer: torch.optim.Optimizer, use_cached: bool = False) -> bool:
        """Whether every gradient of `optimizer` is finite (`use_cached`: the last check's answer)."""
        if not self._enabled:
            return True
        with self._lock:
            if use_cached and id(optimizer) in self._finite:
                return self._finite[id(optimizer)]
            grads = [
                param.grad
                for group in optimizer.param_groups
                for param in group["params"]
                if param.grad is not None
            ]
            grads = [grad.coalesce()._values() if grad.is_sparse else grad for grad in grads]
            finite = all(
                bool(torch.stack([torch.isfinite(g).all() for g in same_device]).all())
                for same_device in _by_device(grads).values()
            )
            self._finite[id(optimizer)] = finite
            if not finite:
                self._infs_between_steps = True
            return finite

    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """During a global step, unscale `optimizer`'s gradients (once) and return True; otherwise
        only check them for inf/NaN, leave them scaled, and return False."""
        if not self._enabled:
            return False
        with self._lock:
            if self._running_global_step:
                if self._global_found_inf is not None:
                    raise RuntimeError(
                        "unscale_() was already called during this global step: gradients "
                        "are unscaled once per global step (until update())"
                    )
                super().unscale_(optimizer)
                self._global_found_inf = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
                return True
            self.are_grads_finite(optimizer)
            return False

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """During a global step: torch's step (skipped on infs; the next update is a real one).
        Otherwise: record whether the gradients are finite and call `optimizer.step(grad_scaler=self)`
        on a plexus Optimizer, which decides whether this micro-batch ends an epoch."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        with self._lock:
            if self._running_global_step:
                state = self._per_optimizer_states[id(optimizer)]
                if self._global_found_inf is not None and state["stage"] is OptState.READY:
                    # the gradients were unscaled already this global step (e.g. through the plexus
                    # Optimizer, before averaging): the inner optimizer steps on them as they are
                    state["stage"], state["found_inf_per_device"] = OptState.UNSCALED, self._global_found_inf
                result = super().step(optimizer, *args, **kwargs)
                self._stepped_globally = True
                return result
            if not _takes_grad_scaler(optimizer):
                raise TypeError(
                    f"plexus.GradScaler steps a plexus.Optimizer (whose step takes "
                    f"grad_scaler=), got {type(optimizer).__name__}; for purely local "
                    f"training use torch.amp.GradScaler"
                )
            self._check_scale_growth_tracker("step")
            if id(optimizer) not in self._finite:
                self.are_grads_finite(optimizer)
        return optimizer.step(*args, grad_scaler=self, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> bool:
        """After a global step: torch's update (returns True). Otherwise: back off if infs were seen
        since the last update, never grow (returns False). Either way the per-step records clear."""
        if not self._enabled:
            return False
        with self._lock:
            try:
                if self._stepped_globally or new_scale is not None:
                    super().update(new_scale)
                    return True
                if self._infs_between_steps:
                    scale, growth_tracker = self._check_scale_growth_tracker("update")
                    scale.mul_(self._backoff_factor)
                    growth_tracker.fill_(0)
                    logger.debug(
                        f"non-finite gradients between global steps: loss scale backs off to {scale.item()}"
                    )
                return False
            finally:
                self._stepped_globally = self._infs_between_steps = False
                self._global_found_inf = None
                self._finite.clear()
                self._per_optimizer_states.clear()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_lock", None)  # locks do not pickle; a copy gets its own
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._lock = threading.RLock()

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        # fp16 master weights (reuse_grad_buffers with AMP) hold fp16 gradients: unscaling them is fine
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)

    def __repr__(self) -> str:
        scale = self.get_scale() if self._enabled else None
        return f"<plexus.GradScaler scale={scale} global_step={self._running_global_step}>"


def _takes_grad_scaler(optimizer: Any) -> bool:
    try:
        return "grad_scaler" in inspect.signature(optimizer.step).parameters
    except (TypeError, ValueError):
        return False


def _by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    grouped: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        grouped.setdefault(tensor.device, []).append(tensor)
    return grouped


__all__ = ["GradScaler", "OptState"]
