"""`GradientAverager`: accumulate gradients over local micro-batches, then average them with peers.

Theory of operation
-------------------
Three sets of buffers:

* **the parameters' `.grad`**, written by the user's `backward()`;
* **accumulators**: float32 sums of those gradients over this peer's micro-batches since the last
  reset. `accumulate_grads_(batch_size)` adds `(batch_size / first_batch_size) * grad`, so after
  micro-batches of sizes b_1..b_K the accumulator holds `sum b_k g_k / b_1` and the "number of
  accumulation steps" is `sum b_k / b_1` (K when all batches are equal). With
  `reuse_grad_buffers=True` the `.grad` buffers *are* the accumulators (autograd sums into them;
  the user must not zero them) and the number of steps is K;
* **averaged gradients**: the averager's tensors (CPU, the parameters' dtype), which a round
  averages in place.

A round: `schedule_step()` starts matchmaking ahead of time and parks the step before the
all-reduce (`require_trigger`). `step()` writes accumulators / steps, this peer's mean gradient
per sample, into the averaged gradients, sets the round's weight to the samples accumulated, and
pulls the trigger. The all-reduce then computes `sum_i S_i mean_i / sum_i S_i`, which is exactly the
mean gradient over every sample in the group. If no group is found, or the round fails, `step`
raises `AveragingError` and the averaged gradients still hold this peer's own mean gradient: the
caller can go on with local gradients (the round never writes a half-averaged result; see
`DecentralizedAverager`).

Threads: the accumulate/load/reset/use calls run on the training thread and are not meant to be
called from two threads at once; the round runs on the DHT's event loop and touches only the
averaged gradients, under the averager's lock.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from ..averaging.allreduce import AveragingMode
from ..averaging.averager import DecentralizedAverager
from ..averaging.control import StepControl
from ..compression import CompressionInfo, TensorRole
from ..dht.dht import DHT
from ..utils.logging import get_logger

logger = get_logger(__name__)


class GradientAverager(DecentralizedAverager):
    """Averages the gradients of `parameters` with peers under `prefix` (weighted by samples).

    A subclass rather than a wrapper: the Optimizer, load_state_from_peers, state sharing and the
    StepControl all speak DecentralizedAverager, and a gradient averager *is* one whose tensors are
    gradients.

    Args:
        parameters: the model's parameters, in a fixed order (tensor keys are their indices).
        dht: a running `plexus.DHT`; prefix: the DHT prefix peers meet under (no '.').
        reuse_grad_buffers: accumulate in the parameters' `.grad` (saves memory; never zero_grad).
        accumulate_grads_on: device of the float32 accumulators (default: each gradient's device).
        client_mode: connect out only (default: the DHT's mode).
        warn: log when accumulators or averaged gradients look misused.
        averaged_grads: CPU tensors (one per parameter, contiguous, floating, no requires_grad) to
            average into, used as they are (not copied), e.g. the `.grad` of an offloaded
            optimizer's parameters.
        **averager_kwargs: to DecentralizedAverager (start, target_group_size, compression, ...).
    """

    def __init__(
        self,
        parameters: Iterable[torch.nn.Parameter],
        *,
        dht: DHT,
        prefix: str,
        reuse_grad_buffers: bool = False,
        accumulate_grads_on: torch.device | None = None,
        client_mode: bool | None = None,
        warn: bool = True,
        averaged_grads: Sequence[torch.Tensor] = (),
        **averager_kwargs,
    ):
        self.parameters = tuple(parameters)
        if not self.parameters:
            raise ValueError("GradientAverager needs at least one parameter")
        self.reuse_grad_buffers, self.warn = reuse_grad_buffers, warn
        if reuse_grad_buffers and accumulate_grads_on is not None:
            logger.warning(
                "accumulate_grads_on is ignored with reuse_grad_buffers=True: the .grad buffers accumulate"
            )
        if reuse_grad_buffers:
            for param in self.parameters:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
            self._accumulators: list[torch.Tensor] = []
        else:
            self._accumulators = [
                torch.zeros(param.shape, dtype=torch.float32, device=accumulate_grads_on or param.device)
                for param in self.parameters
            ]
        self._samples, self._times, self._steps = 0, 0, 0.0
        self._anchor_batch_size: int | None = None
        self._accumulators_used_in_step = False
        self._new_averaged_grads = False

        averaged_grads = list(averaged_grads or ())
        if averaged_grads:
            self._check_averaged_grads(averaged_grads)
        buffers = averaged_grads or [torch.zeros(param.shape, dtype=param.dtype) for param in self.parameters]
        infos = [
            CompressionInfo.from_tensor(buffer, key=index, role=TensorRole.GRADIENT)
            for index, buffer in enumerate(buffers)
        ]
        super().__init__(
            buffers, dht, prefix=prefix, client_mode=client_mode, tensor_infos=infos, **averager_kwargs
        )

    def _check_averaged_grads(self, averaged_grads: list[torch.Tensor]) -> None:
        if len(averaged_grads) != len(self.parameters):
            raise ValueError(
                f"averaged_grads has {len(averaged_grads)} tensors for {len(self.parameters)} parameters"
            )
        for index, (buffer, param) in enumerate(zip(averaged_grads, self.parameters)):
            if (
                buffer.shape != param.shape
                or buffer.device.type != "cpu"
                or not buffer.is_contiguous()
                or not buffer.is_floating_point()
                or buffer.requires_grad
            ):
                raise ValueError(
                    f"averaged_grads[{index}] must be a contiguous floating CPU tensor of shape "
                    f"{tuple(param.shape)}, got {buffer.dtype} {tuple(buffer.shape)} "
                    f"on {buffer.device}"
                )

    # --- accumulation (training thread) ----------------------------------------------------------

    @property
    def local_samples_accumulated(self) -> int:
        """Samples added by accumulate_grads_ since the last reset (the round's default weight)."""
        return self._samples

    @property
    def local_times_accumulated(self) -> int:
        """Number of accumulate_grads_ calls since the last reset."""
        return self._times

    def _grads(self) -> list[torch.Tensor | None]:
        return [param.grad for param in self.parameters]

    @torch.no_grad()
    def accumulate_grads_(self, batch_size: int) -> None:
        """Add the current `.grad` (the mean over a micro-batch of `batch_size` samples)."""
        if not batch_size > 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if self._accumulators_used_in_step and self.warn:
            logger.warning(
                "accumulating gradients on top of those already sent to an averaging round "
                "(step(reset_accumulators=False)); call reset_accumulated_grads_() first "
                "if unintended"
            )
            self._accumulators_used_in_step = False  # warn once per round
        if self._anchor_batch_size is None:
            self._anchor_batch_size = batch_size
        alpha = batch_size / self._anchor_batch_size
        self._samples += batch_size
        self._times += 1
        self._steps += alpha
        if self.reuse_grad_buffers:
            return  # autograd already summed this micro-batch into .grad
        for grad, accumulator in zip(self._grads(), self._accumulators):
            if grad is not None:
                accumulator.add_(grad.to(accumulator.device, non_blocking=True), alpha=alpha)

    @torch.no_grad()
    def load_accumulators_into_averager_(self) -> None:
        """Write this peer's mean gradient per sample (accumulators / steps) into the averaged grads."""
        if self._new_averaged_grads and self.warn:
            logger.warning(
                "overwriting averaged gradients that were never used; call "
                "use_averaged_gradients() or notify_used_averaged_gradients() after each round"
            )
        sources = self._grads() if self.reuse_grad_buffers else self._accumulators
        steps = self._times if self.reuse_grad_buffers else self._steps
        with self.get_tensors() as averaged:
            for source, target in zip(sources, averaged):
                if source is None or steps == 0:
                    target.zero_()
                else:
                    target.copy_(
                        source.to(torch.float32).div_(steps)
                        if source.dtype != torch.float32
                        else source / steps
                    )

    @torch.no_grad()
    def reset_accumulated_grads_(self) -> None:
        """Zero the accumulators (the `.grad` buffers with reuse_grad_buffers) and the counters."""
        for buffer in self._grads() if self.reuse_grad_buffers else self._accumulators:
            if buffer is not None:
                buffer.zero_()
        self._samples, self._times, self._steps = 0, 0, 0.0
        self._anchor_batch_size = None
        self._accumulators_used_in_step = False

    # --- averaging -------------------------------------------------------------------------------

    def schedule_step(self, scheduled_time: float | None = None, **kwargs) -> StepControl:
        """Start matchmaking now for a round that waits for `step(control=...)` to begin.

        kwargs go to DecentralizedAverager.step (timeout, gather, allow_retries, ...)."""
        return super().step(scheduled_time=scheduled_time, wait=False, require_trigger=True, **kwargs)

    def step(
        self,
        weight: float | None = None,
        reset_accumulators: bool = True,
        control: StepControl | None = None,
        timeout: float | None = None,
        wait: bool = True,
        **kwargs,
    ):
        """Average the accumulated gradients with a group; the result lands in the averaged grads.

        Args:
            weight: this peer's weight (default: local_samples_accumulated).
            reset_accumulators: zero the accumulators once they are loaded into the round.
            control: a StepControl from schedule_step (default: schedule one now).
            timeout: the whole step's deadline when scheduling here (default 60 s); with `control`,
                how long to wait for its result (its deadline was set by schedule_step).
            wait: block for the result, or return the StepControl.
            **kwargs: to schedule_step, when `control` is None.

        Returns {peer_id: gathered} of the group (or the StepControl with wait=False).
        Raises AveragingError (from `result()` with wait=False) if no round succeeded; the averaged
        gradients then hold this peer's own mean gradient.
        """
        scheduled_here = control is None
        if scheduled_here:
            control = self.schedule_step(timeout=timeout, **kwargs)
        elif kwargs:
            raise TypeError(f"{sorted(kwargs)} belong to schedule_step; this control was scheduled already")
        if control.triggered:
            raise RuntimeError("this StepControl was already triggered: schedule a new step for each round")
        if weight is None:
            weight = float(self._samples)
        if self.mode == AveragingMode.AUX:
            weight = 0.0
        self.load_accumulators_into_averager_()
        self._accumulators_used_in_step = True
        self._new_averaged_grads = True
        if not control.done():
            with contextlib.suppress(RuntimeError):  # it finished (failed) meanwhile; result() says why
                control.weight = weight
        control.allow_allreduce()
        if reset_accumulators:
            self.reset_accumulated_grads_()
        if not wait:
            return control
        return control.result(None if scheduled_here else timeout)  # the step's own deadline bounds it

    # --- using the result (training thread) ------------------------------------------------------

    def notify_used_averaged_gradients(self) -> None:
        """Tell the averager the averaged gradients were consumed (silences the overwrite warning)."""
        self._new_averaged_grads = False

    @contextlib.contextmanager
    def use_averaged_gradients(self) -> Iterator[list[torch.Tensor]]:
        """Put the averaged gradients into `param.grad` inside the block; the old grads come back after.

        Parameters on the CPU with the buffers' dtype get the buffers themselves; others get a copy
        on their device and dtype (changes to it do not reach the averager). The averager's lock is
        held throughout: do not wait for an averaging round inside the block.
        """
        self._new_averaged_grads = False
        with self.get_tensors() as averaged:
            old_grads = self._grads()
            try:
                for param, grad in zip(self.parameters, averaged):
                    if grad.device != param.device or grad.dtype != param.dtype:
                        grad = grad.to(device=param.device, dtype=param.dtype)
                    param.grad = grad
                yield averaged
            finally:
                for param, old in zip(self.parameters, old_grads):
                    param.grad = old

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.prefix} {self.mode.name} peer={self.dht.peer_id.short()} "
            f"samples={self._samples} times={self._times}>"
        )


GradientAveragerFactory = Callable[..., GradientAverager]
"""Builds the Optimizer's gradient averager: `factory(parameters, dht=..., prefix=..., **options)`,
e.g. `GradientAverager` itself or `functools.partial(PowerSGDGradientAverager, averager_rank=32)`."""
