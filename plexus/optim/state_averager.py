"""`TrainingStateAverager`: a peer's training state (parameters, optimizer, scheduler, epoch), kept
weakly in sync with the swarm by averaging it and by downloading it from peers.

Theory of operation
-------------------
What is averaged: the parameters the optimizer updates, the optimizer statistics named in
`average_opt_statistics` (e.g. Adam's ``exp_avg``) and `extra_tensors`, in that order. The
averager (`DecentralizedAverager`) keeps its own copy of them: a round *loads* the local tensors
into that copy, averages it, and *applies* the result back, either by overwriting the local
tensors or, with `delta_rule_averaging`, by adding ``averaged - loaded`` so that local optimizer
steps taken while the round ran are kept.

Threads. `step()` is called by the training thread. Its background work runs on two
single-thread executors, one stage each:

- stage A, the optimizer stage: wait for `wait_for_trigger`, optimizer step, zero_grad, catch the
  scheduler up to the epoch the call asked for;
- stage B, the averaging stage: wait for A, load the local tensors, start matchmaking (or use a
  pre-scheduled `StepControl`), release the all-reduce, wait for the result, apply it. Matchmaking
  starts after the optimizer step so that what members gather may describe the stepped state
  (`gather` may be a function of `state_digest` of the loaded tensors).

Without the delta rule, stage A of a call waits for stage B of the call before it, so results are
never applied over a newer optimizer step; with it, A runs while B averages. Stage B runs one round
at a time (matchmaking looks for one group at a time).

Who writes what. One lock, the averager's tensor lock (`get_tensors()`), covers every change to
the local state (optimizer steps, applied rounds, loaded state) and `get_current_state()`, so a
newcomer always downloads a consistent state. The model's own parameters are written only from the
training thread, inside `step()` or `load_state_from_peers()`:

- with `offload_optimizer`, the optimizer works on float32 CPU copies; background stages write
  only those copies (and the optimizer's state), and `step()` copies them into the model when they
  changed (a version counter tells). Loading state writes both and marks the copies as already
  applied, so a stale copy can never overwrite the loaded parameters (hivemind #417);
- without it, the optimizer step runs while the training thread waits for it (a delayed optimizer
  step needs offloading), and a delayed round's result is kept aside and applied by the next
  `step()` (or by stage A just before its optimizer step, while the training thread waits).

Extra tensors are applied with the optimizer's tensors, so with offloading a round may change
them from the background: read them under `get_tensors()` if a torn read matters.

Blocking. `step()` blocks for what is not delayed, for earlier work when a new round starts
(`wait_for_delayed_updates`), and, offloading without `custom_gradients`, for the previous
optimizer step before it hands over new gradients. `load_state_from_peers()` blocks on the
network; `schedule_step()` does not. None may be called from the event loop's own thread.

Epochs. `local_epoch` counts global steps. What is shared names the epoch of the state it holds:
`step(increment_epoch=True)` moves `local_epoch` at once, but the shared epoch (the metadata and
the state-sharing priority, by which newcomers choose the most advanced donor) moves only with the
optimizer step of that epoch, under the lock that covers the step, so a newcomer never downloads
an epoch number with the parameters of the epoch before (it would then be one step short for
good). The scheduler is stepped until ``scheduler._step_count > epoch``: the k-th optimizer step
uses the learning rate of epoch k-1, and a peer that loads epoch e gets lr(e).

Loading state: parameters, extra tensors and the optimizer's state dict (tensors flattened out of
it, the rest in the metadata; see `optimizer_state`). A donor whose epoch is behind ours is refused;
a malformed state or a failed download is retried a bounded number of times, then `StateLoadError`
says why.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import logging
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..averaging.averager import AveragingError, DecentralizedAverager
from ..averaging.control import StepControl
from ..averaging.state_download import StateDownloadError
from ..compression import CompressionInfo, TensorRole
from ..compression.base import contiguous_cpu, tensor_bytes_view
from ..errors import PlexusError
from ..utils.logging import get_logger
from ..utils.performance_ema import PerformanceEMA
from ..utils.serializer import MSGPackSerializer, SerializationError
from .optimizer_state import (
    flatten_optimizer_state,
    initialize_optimizer_state,
    optimizer_parameters,
    unflatten_optimizer_state,
)

logger = get_logger(__name__)

OptimizerFactory = Callable[..., torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


class StateLoadError(PlexusError, RuntimeError):
    """Peers shared state, but none of the bounded attempts produced a usable one."""


class TrainingStateAverager(DecentralizedAverager):
    """Holds a peer's parameters, optimizer, scheduler and epoch; averages and shares them.

    The arguments keep hivemind's names and are all keyword-only.

    Args:
        optimizer: a `torch.optim.Optimizer`, or a factory called with `params` (required with
            `offload_optimizer`, which builds the optimizer on the offloaded copies).
        params: parameters or parameter groups, when `optimizer` is a factory.
        scheduler: an LR scheduler on this optimizer, or a factory called with the optimizer.
        initialize_optimizer: run one zero-gradient step so the statistics exist (default: when
            the optimizer has no state tensors yet). The model is left unchanged.
        offload_optimizer: the optimizer updates float32 CPU copies; `step()` copies them back.
        custom_gradients: with offloading, the caller (e.g. a GradientAverager) writes the
            copies' ``.grad`` itself; otherwise `step()` copies the model's gradients there.
        reuse_tensors: accepted for compatibility; the averager always rounds on its own copy, so
            the results are the same either way. Cannot be combined with the delta rule.
        delta_rule_averaging: apply rounds as ``local += averaged - loaded``.
        performance_ema_alpha: smoothing of `delay_before_averaging` (seconds from `step()` to
            the all-reduce), which callers use to pre-schedule matchmaking.
        sync_epoch_when_averaging: adopt the highest epoch among the group's members.
        parameter_names: names for compression infos and error messages.
        average_opt_statistics: optimizer state keys averaged along with the parameters.
        extra_tensors: more tensors to average and share (e.g. batch-norm statistics).
        status_loglevel: level of the routine progress messages.
        **averager_kwargs: `prefix`, `start`, `target_group_size`, ... for DecentralizedAverager.
    """

    def __init__(
        self,
        *,
        dht,
        optimizer: torch.optim.Optimizer | OptimizerFactory,
        params: Iterable[torch.Tensor] | Iterable[dict] | None = None,
        scheduler: Any | SchedulerFactory | None = None,
        initialize_optimizer: bool | None = None,
        offload_optimizer: bool = False,
        custom_gradients: bool = False,
        reuse_tensors: bool | None = None,
        delta_rule_averaging: bool = False,
        performance_ema_alpha: float = 0.1,
        sync_epoch_when_averaging: bool = False,
        parameter_names: Sequence[str] | None = None,
        average_opt_statistics: Sequence[str] = (),
        extra_tensors: Sequence[torch.Tensor] = (),
        status_loglevel: int = logging.DEBUG,
        **averager_kwargs,
    ):
        if reuse_tensors and delta_rule_averaging:
            raise ValueError(
                "reuse_tensors cannot be combined with delta_rule_averaging: the delta rule "
                "needs the averaged tensors apart from the local ones"
            )
        if custom_gradients and not offload_optimizer:
            logger.warning("custom_gradients=True has no effect without offload_optimizer")
        self.offload_optimizer, self.custom_gradients = offload_optimizer, custom_gradients
        self.delta_rule_averaging = delta_rule_averaging
        self.reuse_tensors = (
            (offload_optimizer and not delta_rule_averaging) if reuse_tensors is None else reuse_tensors
        )
        self.sync_epoch_when_averaging, self.status_loglevel = sync_epoch_when_averaging, status_loglevel
        self.optimizer, self.main_parameters = self._make_optimizer(optimizer, params)
        if parameter_names is None:
            parameter_names = tuple(f"param{i}" for i in range(len(self.main_parameters)))
        if len(parameter_names) != len(self.main_parameters):
            raise ValueError(
                f"{len(parameter_names)} parameter_names for {len(self.main_parameters)} parameters"
            )
        self.parameter_names = tuple(parameter_names)
        self.opt_keys_for_averaging = tuple(average_opt_statistics)
        self.extra_tensors = tuple(extra_tensors)
        if initialize_optimizer is None:
            initialize_optimizer = not any(
                isinstance(value, torch.Tensor)
                for state in self.optimizer.state.values()
                for value in state.values()
            )
        if initialize_optimizer:
            initialize_optimizer_state(self.optimizer)
        self._check_optimizer_state()
        self.scheduler = self._make_scheduler(scheduler)

        self._local_epoch = 0
        self._state_epoch = 0  # the epoch of the state as shared (see "Epochs" above)
        self.delay_before_averaging = PerformanceEMA(alpha=performance_ema_alpha)
        self._opt_versions = [0, 0]  # [changes to the optimizer's copies, of them applied to the model]
        self._pending_result: tuple[str, list[torch.Tensor]] | None = None  # a round not applied yet
        self._optimizer_executor = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="state-optimizer"
        )
        self._averaging_executor = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="state-averaging"
        )
        self._last_optimizer_stage: concurrent.futures.Future | None = None
        self._last_averaging_stage: concurrent.futures.Future | None = None
        self._pending: set[concurrent.futures.Future] = set()
        self._controls: set[StepControl] = set()
        self._load_lock = threading.Lock()

        with torch.no_grad():
            # the averager's own CPU copies, loaded from the local tensors before each round
            averaged_tensors = [tensor.detach().to("cpu", copy=True) for tensor in self._local_tensors()]
        super().__init__(averaged_tensors, dht, tensor_infos=self._tensor_infos(), **averager_kwargs)
        self.state_sharing_priority = self._local_epoch

    # --- construction ------------------------------------------------------------------------------

    def _make_optimizer(self, optimizer, params) -> tuple[torch.optim.Optimizer, tuple[torch.Tensor, ...]]:
        if isinstance(optimizer, torch.optim.Optimizer):
            if self.offload_optimizer:
                raise ValueError(
                    "offload_optimizer needs an optimizer factory (e.g. "
                    "functools.partial(torch.optim.Adam, lr=1e-3)) to build it on the offloaded copies"
                )
            main = tuple(optimizer_parameters(optimizer))
            if params is not None and {id(p) for p in params} != {id(p) for p in main}:
                raise ValueError("params differ from the optimizer's parameters; pass one or the other")
            return optimizer, main
        if not callable(optimizer):
            raise TypeError(
                f"optimizer must be a torch optimizer or a factory, got {type(optimizer).__name__}"
            )
        if params is None:
            raise ValueError("params are required when optimizer is a factory")
        groups = list(params)
        if groups and isinstance(groups[0], dict):
            groups = [{**group, "params": list(_as_params(group["params"]))} for group in groups]
        else:
            groups = [{"params": groups}]
        main = tuple(param for group in groups for param in group["params"])
        if self.offload_optimizer:
            copies = {}
            for param in main:
                copy = param.detach().to("cpu", torch.float32, copy=True).requires_grad_(param.requires_grad)
                copy.grad = torch.zeros_like(copy)  # kept in place: custom_gradients writers hold it
                copies[id(param)] = copy
            groups = [{**group, "params": [copies[id(p)] for p in group["params"]]} for group in groups]
        built = optimizer(groups[0]["params"] if len(groups) == 1 and len(groups[0]) == 1 else groups)
        if not isinstance(built, torch.optim.Optimizer):
            raise TypeError(f"the optimizer factory returned {type(built).__name__}, not a torch optimizer")
        return built, main

    def _make_scheduler(self, scheduler):
        if scheduler is None:
            return None
        if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            if not callable(scheduler):
                raise TypeError(
                    f"scheduler must be an LR scheduler or a factory, got {type(scheduler).__name__}"
                )
            scheduler = scheduler(self.optimizer)
        if getattr(scheduler, "optimizer", None) is not self.optimizer:
            raise ValueError(
                "the scheduler drives another optimizer; pass a factory (e.g. "
                "functools.partial(LambdaLR, lr_lambda=...)) so it is built on this one"
            )
        return scheduler

    def _check_optimizer_state(self) -> None:
        for key in self.opt_keys_for_averaging:
            for param, name in zip(optimizer_parameters(self.optimizer), self.parameter_names):
                if not isinstance(self.optimizer.state.get(param, {}).get(key), torch.Tensor):
                    raise ValueError(
                        f"the optimizer has no statistic {key!r} for {name}; check "
                        f"average_opt_statistics or pass initialize_optimizer=True"
                    )
        try:
            MSGPackSerializer.dumps(flatten_optimizer_state(self.optimizer)[0])
        except SerializationError as error:
            raise TypeError(
                f"{type(self.optimizer).__name__}'s state dict cannot be shared with peers: {error}"
            ) from None

    def _tensor_infos(self) -> list[CompressionInfo]:
        infos = [
            CompressionInfo.from_tensor(param, key=name, role=TensorRole.PARAMETER)
            for param, name in zip(self._optimized_parameters(), self.parameter_names)
        ]
        for key in self.opt_keys_for_averaging:
            for param, name in zip(optimizer_parameters(self.optimizer), self.parameter_names):
                infos.append(
                    CompressionInfo.from_tensor(
                        self.optimizer.state[param][key], key=(name, key), role=TensorRole.OPTIMIZER
                    )
                )
        infos.extend(
            CompressionInfo.from_tensor(tensor, key=i, role=TensorRole.UNSPECIFIED)
            for i, tensor in enumerate(self.extra_tensors)
        )
        return infos

    # --- local tensors -----------------------------------------------------------------------------

    def _optimized_parameters(self) -> list[torch.Tensor]:
        """The tensors the optimizer updates: offloaded copies, or the model's own parameters."""
        return optimizer_parameters(self.optimizer)

    def _local_tensors(self) -> list[torch.Tensor]:
        """What is averaged, in order; looked up afresh because loading state replaces statistics."""
        params = self._optimized_parameters()
        statistics = [
            self.optimizer.state[param][key] for key in self.opt_keys_for_averaging for param in params
        ]
        return [*params, *statistics, *self.extra_tensors]

    @property
    def local_epoch(self) -> int:
        return self._local_epoch

    @local_epoch.setter
    def local_epoch(self, epoch: int) -> None:
        """Set the epoch of the state as it is now (a loaded state, a caller's own count)."""
        self._local_epoch = self._state_epoch = int(epoch)
        self.state_sharing_priority = self._local_epoch

    def _set_state_epoch(self, epoch: int) -> None:
        """The state now holds `epoch`'s optimizer step (call with the lock held)."""
        self._state_epoch = max(self._state_epoch, epoch)
        self.state_sharing_priority = self._state_epoch

    @property
    def averaging_in_progress(self) -> bool:
        """A round was submitted and has not ended (do not `schedule_step` another meanwhile)."""
        stage = self._last_averaging_stage
        return stage is not None and not stage.done()

    def _state_changed(self) -> None:
        """Tell state sharing that a snapshot taken before now is stale."""
        sharing = getattr(self, "_state_sharing", None)
        if sharing is not None:
            sharing.state_changed()

    def _update_scheduler(self, epoch: int | None = None) -> None:
        """Step the scheduler until it reached `epoch` (call with the lock held, or before start)."""
        if self.scheduler is None:
            return
        epoch = self._local_epoch if epoch is None else epoch
        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": catching up is meant
            warnings.simplefilter("ignore", UserWarning)
            while self.scheduler._step_count <= epoch:
                self.scheduler.step()

    def _locked_update_scheduler(self, epoch: int) -> None:
        with self.get_tensors():
            self._update_scheduler(epoch)

    @torch.no_grad()
    def _sync_model_parameters(self) -> None:
        """Offloading: copy the optimizer's parameters into the model if they changed (training thread)."""
        if not self.offload_optimizer or self._opt_versions[0] == self._opt_versions[1]:
            return
        with self.get_tensors():
            for main, copy in zip(self.main_parameters, self._optimized_parameters()):
                main.copy_(copy)
            self._opt_versions[1] = self._opt_versions[0]

    @torch.no_grad()
    def _apply_result_locked(self, kind: str, tensors: Sequence[torch.Tensor]) -> None:
        """Fold an averaging result into the local tensors; the caller holds the lock."""
        for local, new in zip(self._local_tensors(), tensors):
            if kind == "delta":
                local.add_(new.to(local.device, local.dtype))
            else:
                local.copy_(new)
        if self.offload_optimizer:
            self._opt_versions[0] += 1
        self._state_changed()

    def _apply_pending_result(self) -> None:
        """Apply a finished round kept aside (no offloading); only while the training thread waits."""
        if self._pending_result is None:
            return
        with self.get_tensors():
            pending, self._pending_result = self._pending_result, None
            if pending is not None:
                self._apply_result_locked(*pending)
                logger.log(self.status_loglevel, "Applied parameters from a background averaging round")

    # --- step --------------------------------------------------------------------------------------

    def schedule_step(self, scheduled_time: float | None = None, **kwargs) -> StepControl:
        """Start matchmaking now for a round whose all-reduce `step(averaging_control=...)` releases.

        Only one round looks for a group at a time: do not schedule while a round is in progress.
        """
        if kwargs.get("weight") is not None:
            raise ValueError("the weight of a scheduled round is set through control.weight, not here")
        kwargs.pop("weight", None)
        kwargs.setdefault("gather", self.local_epoch)
        return DecentralizedAverager.step(
            self, scheduled_time=scheduled_time, wait=False, require_trigger=True, **kwargs
        )

    def step(
        self,
        wait_for_delayed_updates: bool | None = None,
        apply_delayed_updates: bool = True,
        increment_epoch: bool = False,
        optimizer_step: bool = False,
        zero_grad: bool = False,
        delay_optimizer_step: bool = False,
        averaging_round: bool = False,
        delay_averaging: bool | None = None,
        averaging_control: StepControl | None = None,
        wait_for_trigger: Callable[[], Any] | None = None,
        grad_scaler: Any = None,
        averaging_opts: dict | None = None,
    ):
        """Do the requested actions in this order (each optional):

        1. wait for background work (`wait_for_delayed_updates`, default: when a round starts) and
           apply what finished (`apply_delayed_updates`);
        2. `increment_epoch` (now, whatever else is delayed);
        3. in the background: `wait_for_trigger()`, the optimizer step, zero_grad, the scheduler,
           then an averaging round (`averaging_round`, `averaging_control`, `averaging_opts` for
           `DecentralizedAverager.step`, e.g. timeout; its `gather` may be a function, called
           with the `state_digest` of the tensors about to be averaged, that returns the gather);
        4. wait for the optimizer step unless `delay_optimizer_step` (offloading only), and for the
           round unless `delay_averaging` (default: `delay_optimizer_step`).

        Returns the round's {peer_id: epoch} when it was waited for and succeeded, else None.
        Raises the optimizer step's own error when it was waited for.
        """
        averaging_opts = dict(averaging_opts or {})
        if delay_averaging is None:
            delay_averaging = delay_optimizer_step
        if delay_optimizer_step and not self.offload_optimizer:
            raise ValueError(
                "delay_optimizer_step needs offload_optimizer: otherwise the background step "
                "would change the model's parameters while the training loop uses them"
            )
        if delay_optimizer_step and averaging_round and not delay_averaging:
            raise ValueError(
                "a round after a delayed optimizer step must be delayed too (delay_averaging=True)"
            )
        if averaging_control is not None and not averaging_round:
            raise ValueError("averaging_control is only used with averaging_round=True")
        if wait_for_trigger is not None and not (optimizer_step or zero_grad or averaging_round):
            raise ValueError("wait_for_trigger only gates an optimizer step, zero_grad or a round")
        if averaging_opts and not averaging_round:
            logger.warning(f"averaging_opts are ignored without averaging_round: {averaging_opts}")
        if wait_for_delayed_updates is None:
            wait_for_delayed_updates = averaging_round

        if wait_for_delayed_updates:
            self._wait_for_pending()
        self._collect_finished()
        if apply_delayed_updates:
            self._apply_pending_result()
            self._sync_model_parameters()

        if increment_epoch:  # shared once the state holds it: with the optimizer step, or now
            self._local_epoch += 1
            if not optimizer_step:
                with self.get_tensors():
                    self._set_state_epoch(self._local_epoch)
        target_epoch = self.local_epoch
        if not optimizer_step and self.scheduler is not None:
            previous = self._last_optimizer_stage
            if previous is not None and not previous.done():  # keep the order of the queued steps' rates
                self._optimizer_executor.submit(self._locked_update_scheduler, target_epoch)
            else:
                self._locked_update_scheduler(target_epoch)
        if not (optimizer_step or zero_grad or averaging_round):
            return None

        if self.offload_optimizer and (optimizer_step or zero_grad):
            self._prepare_offloaded_gradients(optimizer_step, zero_grad)
        optimizer_stage = None
        if optimizer_step or zero_grad or wait_for_trigger is not None:
            after = None if self.delta_rule_averaging else self._last_averaging_stage
            optimizer_stage = self._optimizer_executor.submit(
                self._optimizer_stage,
                after,
                wait_for_trigger,
                optimizer_step,
                zero_grad,
                grad_scaler,
                target_epoch,
            )
            self._last_optimizer_stage = optimizer_stage
            self._pending.add(optimizer_stage)
        averaging_stage = None
        if averaging_round:
            if averaging_control is not None:
                self._controls.add(averaging_control)
            averaging_stage = self._averaging_executor.submit(
                self._averaging_stage, optimizer_stage, averaging_control, time.monotonic(), averaging_opts
            )
            self._last_averaging_stage = averaging_stage
            self._pending.add(averaging_stage)

        output, waited = None, False
        if optimizer_stage is not None and (optimizer_step or zero_grad) and not delay_optimizer_step:
            self._pending.discard(optimizer_stage)
            optimizer_stage.result()
            waited = True
        if averaging_stage is not None and not delay_averaging:
            self._pending.discard(averaging_stage)
            output = averaging_stage.result()
            waited = True
        if waited:  # delayed work shows in the model at the next step(), never at a random moment
            self._apply_pending_result()
            self._sync_model_parameters()
        return output

    @torch.no_grad()
    def _prepare_offloaded_gradients(self, optimizer_step: bool, zero_grad: bool) -> None:
        """Offloading, in the training thread: hand the model's gradients to the optimizer's copies."""
        if optimizer_step and not self.custom_gradients:
            previous = self._last_optimizer_stage
            if previous is not None:  # its step may still read the copies' gradients
                concurrent.futures.wait([previous])
            for main, copy in zip(self.main_parameters, self._optimized_parameters()):
                if main.grad is None:
                    copy.grad = None
                elif copy.grad is None:
                    copy.grad = main.grad.detach().to("cpu", torch.float32, copy=True)
                else:
                    copy.grad.copy_(main.grad)
        if zero_grad:
            for main in self.main_parameters:
                main.grad = None

    def _optimizer_stage(
        self, after, wait_for_trigger, optimizer_step, zero_grad, grad_scaler, epoch
    ) -> None:
        if after is not None:
            concurrent.futures.wait([after])
        if wait_for_trigger is not None:
            wait_for_trigger()
        if not self.offload_optimizer and (optimizer_step or zero_grad):
            self._apply_pending_result()  # the training thread is waiting for us
        with torch.no_grad(), self.get_tensors():
            if optimizer_step:
                logger.debug("Running the optimizer step")
                if grad_scaler is None:
                    self.optimizer.step()
                else:
                    running = getattr(grad_scaler, "running_global_step", contextlib.nullcontext)
                    with running():
                        grad_scaler.step(self.optimizer)
                if self.offload_optimizer:
                    self._opt_versions[0] += 1
            if zero_grad:
                if self.offload_optimizer:  # in place: custom-gradient writers keep these buffers
                    for param in self._optimized_parameters():
                        if param.grad is not None:
                            param.grad.zero_()
                else:
                    self.optimizer.zero_grad()
            self._update_scheduler(epoch)
            if optimizer_step:
                self._set_state_epoch(epoch)
                self._state_changed()

    def _averaging_stage(self, optimizer_stage, control: StepControl | None, started: float, opts: dict):
        if control is not None and (control.triggered or control.done()):
            logger.log(
                self.status_loglevel, f"Discarding a pre-scheduled round that already ended: {control}"
            )
            self._controls.discard(control)
            control = None
        try:
            if optimizer_stage is not None:
                try:
                    optimizer_stage.result()
                except BaseException as error:
                    logger.error(
                        f"Cancelled the state averaging round: the optimizer stage failed with {error!r}"
                    )
                    if control is not None:
                        control.cancel()
                    return None
            with torch.no_grad(), self.get_tensors() as averaged:
                for buffer, local in zip(averaged, self._local_tensors()):
                    buffer.copy_(local)
                loaded = [buffer.clone() for buffer in averaged] if self.delta_rule_averaging else None
                gather = opts.get("gather", self.local_epoch)
                if callable(gather):  # what members exchange may depend on the state itself
                    opts["gather"] = gather(state_digest(averaged))
            if control is None:
                opts.setdefault("gather", self.local_epoch)
                control = DecentralizedAverager.step(self, require_trigger=True, wait=False, **opts)
                self._controls.add(control)
            self.delay_before_averaging.timestamp = started
            self.delay_before_averaging.update(1)
            control.allow_allreduce()
            try:
                gathered = control.result()  # bounded by the step's own timeout (averaging_opts)
            except (AveragingError, concurrent.futures.CancelledError, TimeoutError) as error:
                logger.log(self.status_loglevel, f"State averaging round failed: {error!r}")
                return None
            except Exception as error:
                logger.warning(f"State averaging round failed: {error!r}")
                return None
            logger.log(self.status_loglevel, f"Averaged the training state with {len(gathered)} peers")
            with torch.no_grad(), self.get_tensors() as averaged:
                if self.delta_rule_averaging:
                    result = ("delta", [buffer - old for buffer, old in zip(averaged, loaded)])
                else:
                    result = ("copy", averaged if self.offload_optimizer else [b.clone() for b in averaged])
                if self.offload_optimizer:  # the optimizer's copies are ours alone: apply now
                    self._apply_result_locked(*result)
                else:
                    self._pending_result = result
                if self.sync_epoch_when_averaging:
                    epochs = [e for e in gathered.values() if isinstance(e, int) and not isinstance(e, bool)]
                    if epochs and max(epochs) > self.local_epoch:
                        logger.log(self.status_loglevel, f"Found a peer with a newer epoch ({max(epochs)})")
                        self.local_epoch = max(epochs)
                        self._update_scheduler()
            return gathered
        finally:
            if control is not None:
                self._controls.discard(control)
                control.wait_ended()

    def finish_background_work(self, timeout: float) -> bool:
        """Before leaving: cancel rounds that have not begun their all-reduce (nobody waits for a
        member that never sent), wait up to `timeout` s for the rest (optimizer steps, all-reduces
        under way) and apply what finished. Returns False if work was still running at the deadline."""
        self._cancel_rounds_and_wait(timeout)
        self._collect_finished()
        self._apply_pending_result()
        self._sync_model_parameters()
        return not any(not future.done() for future in self._pending)

    def cancel_unstarted_rounds(self) -> None:
        """Cancel the rounds still looking for a group (their all-reduce has not begun); returns at once."""
        for control in list(self._controls):
            if not control.began_allreduce:
                control.cancel()

    def _cancel_rounds_and_wait(self, timeout: float | None = None) -> None:
        """Cancel rounds that have not begun their all-reduce, and wait (up to `timeout` s) for every
        background stage; a stage may start its round late (after its optimizer step), so look again
        while waiting."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.cancel_unstarted_rounds()
            pending = [future for future in self._pending if not future.done()]
            left = None if deadline is None else deadline - time.monotonic()
            if not pending or (left is not None and left <= 0):
                return
            concurrent.futures.wait(pending, timeout=0.1 if left is None else min(left, 0.1))

    def _wait_for_pending(self) -> None:
        """Wait for every background stage (each is bounded: rounds by their timeout)."""
        if self._pending:
            logger.log(self.status_loglevel, "Waiting for delayed updates to finish...")
            concurrent.futures.wait(list(self._pending))

    def _collect_finished(self) -> None:
        for future in [f for f in self._pending if f.done()]:
            self._pending.discard(future)
            if not future.cancelled() and future.exception() is not None:
                logger.error(f"A background state update failed: {future.exception()!r}")

    # --- state sharing -----------------------------------------------------------------------------

    def get_current_state(self):
        """(metadata, tensors, infos): parameters, extra tensors, optimizer state. Lock held by the caller."""
        optimizer_metadata, optimizer_tensors = flatten_optimizer_state(self.optimizer)
        metadata = dict(
            epoch=self._state_epoch, group_bits=self.get_group_bits(), optimizer_metadata=optimizer_metadata
        )
        params = self._optimized_parameters()
        infos = [
            CompressionInfo.from_tensor(p, key=n, role=TensorRole.PARAMETER)
            for p, n in zip(params, self.parameter_names)
        ]
        infos += [
            CompressionInfo.from_tensor(t, key=i, role=TensorRole.UNSPECIFIED)
            for i, t in enumerate(self.extra_tensors)
        ]
        infos += [
            CompressionInfo.from_tensor(t, key=i, role=TensorRole.OPTIMIZER)
            for i, t in enumerate(optimizer_tensors)
        ]
        return metadata, [*params, *self.extra_tensors, *optimizer_tensors], infos

    def load_state_from_peers(
        self,
        wait: bool = True,
        timeout: float | None = None,
        *,
        max_attempts: int = 3,
        retry_backoff: float = 1.0,
        min_epoch: int | None = None,
    ):
        """Download the state of the most advanced peer and adopt it; blocking (training thread).

        Background work is finished first (a round not yet in its all-reduce is cancelled). Each
        attempt is one `DecentralizedAverager.load_state_from_peers(timeout=timeout)`; a failed or
        unusable download is retried after `retry_backoff` seconds, doubling, `max_attempts` times.
        With `min_epoch` (the swarm's epoch, when known), a donor whose state is older is never
        adopted: an attempt that finds only such donors fails and is retried like any other.

        Returns True when state was loaded; False when nobody shares state, or when every donor's
        epoch is behind ours (our state is kept). With `wait=False`, a future of that.

        Raises:
            StateLoadError: every attempt failed; the message names each failure.
        """
        if not wait:
            executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="state-loader")
            future = executor.submit(
                self.load_state_from_peers,
                True,
                timeout,
                max_attempts=max_attempts,
                retry_backoff=retry_backoff,
                min_epoch=min_epoch,
            )
            executor.shutdown(wait=False)
            return future
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        with self._load_lock:
            self._cancel_rounds_and_wait()
            self._collect_finished()
            failures = []
            for attempt in range(1, max_attempts + 1):
                try:
                    loaded = DecentralizedAverager.load_state_from_peers(
                        self, wait=True, timeout=timeout, min_priority=min_epoch
                    )
                    if loaded is None:
                        logger.info(
                            f"Nobody shares state under {self.prefix!r}; "
                            f"keeping ours (epoch {self.local_epoch})"
                        )
                        return False
                    return self._adopt_state(*loaded)
                except (StateDownloadError, ValueError) as error:
                    failures.append(f"attempt {attempt}: {error}")
                    logger.warning(
                        f"Loading state from peers failed (attempt {attempt}/{max_attempts}): {error}"
                    )
                if attempt < max_attempts:
                    time.sleep(retry_backoff * 2 ** (attempt - 1))
            raise StateLoadError(
                f"could not load the training state under {self.prefix!r} after {max_attempts} "
                f"attempts: {'; '.join(failures)}. Check that peers are online and train the "
                f"same model with the same optimizer."
            )

    @torch.no_grad()
    def _adopt_state(self, metadata: Any, tensors: Sequence[torch.Tensor]) -> bool:
        if not isinstance(metadata, dict):
            raise ValueError(f"the donor sent metadata of type {type(metadata).__name__}, not a dict")
        epoch = metadata.get("epoch")
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"the donor sent an invalid epoch {epoch!r}")
        if epoch < self.local_epoch:
            logger.warning(
                f"Refusing to load state from a peer at epoch {epoch}: we are at epoch {self.local_epoch}"
            )
            return False
        params = self._optimized_parameters()
        num_params, num_extra = len(params), len(self.extra_tensors)
        if len(tensors) < num_params + num_extra:
            raise ValueError(
                f"the donor sent {len(tensors)} tensors, fewer than our {num_params} parameters "
                f"and {num_extra} extra tensors"
            )
        loaded_params, loaded_extra = tensors[:num_params], tensors[num_params : num_params + num_extra]
        for name, ours, theirs in [
            *zip(self.parameter_names, params, loaded_params),
            *((f"extra tensor {i}", t, l) for i, (t, l) in enumerate(zip(self.extra_tensors, loaded_extra))),
        ]:
            if ours.shape != theirs.shape:
                raise ValueError(
                    f"the donor's {name} has shape {tuple(theirs.shape)}, ours is {tuple(ours.shape)}"
                )
        optimizer_state = unflatten_optimizer_state(
            metadata.get("optimizer_metadata"), tensors[num_params + num_extra :], self.optimizer
        )
        group_bits = metadata.get("group_bits")
        with self.get_tensors():
            for main, param, new in zip(self.main_parameters, params, loaded_params):
                param.copy_(new)
                if self.offload_optimizer:
                    main.copy_(new)
            for extra, new in zip(self.extra_tensors, loaded_extra):
                extra.copy_(new)
            self.optimizer.load_state_dict(optimizer_state)
            self._pending_result = None  # a round of the state we just replaced
            self._opt_versions[1] = self._opt_versions[0]  # the model already holds the loaded values
            self.local_epoch = epoch
            self._update_scheduler(epoch)
            if isinstance(group_bits, str) and self.is_alive():
                self.set_group_bits(group_bits)
            self._state_changed()
        logger.log(self.status_loglevel, f"Loaded the training state of epoch {epoch} from peers")
        return True

    # --- life cycle --------------------------------------------------------------------------------

    def shutdown(self) -> None:
        for control in list(self._controls):
            control.cancel()
        self._optimizer_executor.shutdown(wait=False, cancel_futures=True)
        self._averaging_executor.shutdown(wait=False, cancel_futures=True)
        super().shutdown()

    def __repr__(self) -> str:
        return (
            f"<TrainingStateAverager {self.prefix} epoch={self.local_epoch} "
            f"offload={self.offload_optimizer} delta={self.delta_rule_averaging}>"
        )


def _as_params(params) -> Iterable[torch.Tensor]:
    return [params] if isinstance(params, torch.Tensor) else params


def state_digest(tensors: Sequence[torch.Tensor]) -> str:
    """A short hash of CPU tensors' bytes: peers whose states have the same digest hold the same state."""
    hasher = hashlib.blake2b(digest_size=16)
    for tensor in tensors:
        hasher.update(tensor_bytes_view(contiguous_cpu(tensor)))
    return hasher.hexdigest()
