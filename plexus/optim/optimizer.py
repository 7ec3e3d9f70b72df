"""`plexus.Optimizer`: wrap any torch optimizer so that a swarm of peers trains like one large batch.

Theory of operation
-------------------
An *epoch* is one optimizer step of the whole swarm: it ends when the peers together have
accumulated `target_batch_size` samples. Three parts cooperate:

- `ProgressTracker` publishes this peer's samples and reads everyone's, so each peer knows the
  global epoch, how close the target is and when it will be reached;
- `GradientAverager` accumulates local gradients between epochs and, at the end of an epoch,
  averages them with the peers (weighted by their samples). Matchmaking for that round starts
  ahead of time, when the epoch's end is less than `matchmaking_time` away, so the group is ready
  when the samples are;
- `TrainingStateAverager` holds the parameters, the wrapped optimizer and the scheduler: it takes
  the optimizer step with the averaged gradients, advances the epoch, averages parameters (and
  chosen optimizer statistics) every `average_state_every` epochs, and serves and downloads state.

`step()` is called after every local backward pass: it accumulates, reports progress, and when
the swarm is ready, runs the global step. A peer that falls behind (or joins late) downloads the
state and continues at the swarm's epoch. With `use_local_updates`, every `step()` is a local
optimizer step and only the state is averaged at epoch boundaries. Delayed updates
(`delay_optimizer_step`, `delay_grad_averaging`) move the optimizer step and the averaging to the
background, one epoch stale, as in hivemind.

Differences from hivemind, on purpose: `client_mode` defaults to the DHT's and is honoured when
given (hivemind ignored it); loading state retries a bounded number of times, then raises; a
GradScaler requires `reuse_grad_buffers` (the only case its scaling rules are correct for).
"""

import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..averaging.averager import AveragingError
from ..compression import CompressionBase, NoCompression
from ..dht.dht import DHT
from ..utils.logging import get_logger
from ..utils.timing import get_dht_time
from .grad_averager import GradientAverager
from .grad_scaler import GradScaler
from .progress_tracker import ProgressTracker
from .state_averager import StateLoadError, TrainingStateAverager

logger = get_logger(__name__)


class Optimizer(torch.optim.Optimizer):
    """A collaborative optimizer: `opt = plexus.Optimizer(dht=dht, run_id="my_run",
    target_batch_size=4096, batch_size_per_step=32, optimizer=partial(torch.optim.Adam, lr=1e-3),
    params=model.parameters())`, then `loss.backward(); opt.step(); opt.zero_grad()` as usual.

    See hivemind's documentation for every argument; the names and defaults are the same.
    """

    def __init__(self, *, dht: DHT, run_id: str, target_batch_size: int, batch_size_per_step: int | None = None,
                 optimizer, params: Iterable | None = None, scheduler=None, matchmaking_time: float = 15.0,
                 averaging_timeout: float = 60.0, allreduce_timeout: float | None = None,
                 next_chunk_timeout: float | None = None, load_state_timeout: float = 600.0,
                 reuse_grad_buffers: bool = False, offload_optimizer: bool | None = None,
                 delay_optimizer_step: bool | None = None, delay_grad_averaging: bool = False,
                 delay_state_averaging: bool = True, average_state_every: int = 1, use_local_updates: bool = False,
                 client_mode: bool | None = None, auxiliary: bool = False,
                 grad_compression: CompressionBase = NoCompression(),
                 state_averaging_compression: CompressionBase = NoCompression(),
                 load_state_compression: CompressionBase = NoCompression(),
                 average_opt_statistics: Sequence[str] = (), extra_tensors: Sequence[torch.Tensor] = (),
                 averager_opts: dict | None = None, tracker_opts: dict | None = None,
                 performance_ema_alpha: float = 0.1, shutdown_timeout: float = 5, verbose: bool = False):
        client_mode = dht.client_mode if client_mode is None else client_mode
        delay_optimizer_step = delay_grad_averaging if delay_optimizer_step is None else delay_optimizer_step
        if offload_optimizer is None:
            offload_optimizer = params is not None and not use_local_updates
        _check_options(client_mode, auxiliary, offload_optimizer, delay_optimizer_step, delay_grad_averaging,
                       use_local_updates, reuse_grad_buffers, average_state_every, params, optimizer)
        self.dht, self.run_id, self.target_batch_size = dht, run_id, target_batch_size
        self.batch_size_per_step, self.client_mode, self.auxiliary = batch_size_per_step, client_mode, auxiliary
        self.matchmaking_time, self.averaging_timeout = matchmaking_time, averaging_timeout
        self.load_state_timeout, self.shutdown_timeout = load_state_timeout, shutdown_timeout
        self.reuse_grad_buffers, self.offload_optimizer = reuse_grad_buffers, offload_optimizer
        self.delay_optimizer_step, self.delay_grad_averaging = delay_optimizer_step, delay_grad_averaging
        self.delay_state_averaging, self.average_state_every = delay_state_averaging, average_state_every
        self.use_local_updates = use_local_updates
        self.status_loglevel = logging.INFO if verbose else logging.DEBUG
        averager_opts = dict(averager_opts or {})
        round_opts = dict(min_matchmaking_time=matchmaking_time, client_mode=client_mode, start=True,
                          allreduce_timeout=averaging_timeout if allreduce_timeout is None else allreduce_timeout,
                          next_chunk_timeout=matchmaking_time if next_chunk_timeout is None else next_chunk_timeout,
                          **averager_opts)

        self.state_averager = TrainingStateAverager(
            dht=dht, prefix=f"{run_id}_state_averager", optimizer=optimizer, params=params, scheduler=scheduler,
            offload_optimizer=offload_optimizer, custom_gradients=offload_optimizer,
            delta_rule_averaging=use_local_updates and delay_state_averaging, auxiliary=auxiliary,
            compression=state_averaging_compression, state_compression=load_state_compression,
            average_opt_statistics=average_opt_statistics, extra_tensors=extra_tensors,
            performance_ema_alpha=performance_ema_alpha, status_loglevel=self.status_loglevel, **round_opts)
        self.grad_averager: GradientAverager | None = None
        if not use_local_updates:
            averaged_grads = ()
            if offload_optimizer:  # the offloaded optimizer reads the averaged gradients in place
                copies = self.state_averager._optimized_parameters()
                for copy in copies:
                    if copy.grad is None:
                        copy.grad = torch.zeros_like(copy)
                averaged_grads = tuple(copy.grad for copy in copies)
            self.grad_averager = GradientAverager(
                self.state_averager.main_parameters, dht=dht, prefix=f"{run_id}_grad_averager",
                reuse_grad_buffers=reuse_grad_buffers, averaged_grads=averaged_grads, auxiliary=auxiliary,
                compression=grad_compression, **round_opts)
        self.tracker = ProgressTracker(
            dht, run_id, target_batch_size, client_mode=client_mode, performance_ema_alpha=performance_ema_alpha,
            status_loglevel=self.status_loglevel, **(tracker_opts or {}))
        self._scheduled_grads = None
        self._fetch_count_at_epoch = None  # set at each epoch change: check synchronization once after it
        self._last_loss: float | None = None
        # torch's own set-up (hooks, profiling); the real groups and state belong to the wrapped optimizer
        super().__init__([{"params": []}], {})
        self.tracker.fetch_global_progress_now(timeout=averaging_timeout)

    # --- what torch and the user see --------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict]:
        """The wrapped optimizer's groups, with the model's own parameters (not offloaded copies)."""
        groups, start = [], 0
        for group in self.state_averager.optimizer.param_groups:
            count = len(group["params"])
            groups.append(dict(group, params=list(self.state_averager.main_parameters[start:start + count])))
            start += count
        return groups

    @param_groups.setter
    def param_groups(self, value) -> None:
        pass  # torch.optim.Optimizer.__init__ assigns it; the wrapped optimizer owns the real groups

    @property
    def state(self):
        return self.state_averager.optimizer.state

    @state.setter
    def state(self, value) -> None:
        pass  # as for param_groups

    @property
    def opt(self) -> torch.optim.Optimizer:
        return self.state_averager.optimizer

    @property
    def local_epoch(self) -> int:
        return self.state_averager.local_epoch

    @property
    def local_progress(self):
        return self.tracker.local_progress

    @property
    def use_gradient_averaging(self) -> bool:
        return self.grad_averager is not None

    def is_synchronized_with_peers(self) -> bool:
        return self.local_epoch >= self.tracker.global_progress.epoch - 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.reuse_grad_buffers:
            raise ValueError("with reuse_grad_buffers=True the gradient buffers accumulate between epochs; "
                             "plexus.Optimizer zeroes them itself, so do not call zero_grad()")
        for param in self.state_averager.main_parameters:
            if param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.detach_().zero_()

    def state_dict(self) -> dict:
        state = self.state_averager.optimizer.state_dict()
        state["state"]["local_epoch"] = self.local_epoch
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict, state=dict(state_dict["state"]))
        if "local_epoch" in state_dict["state"]:
            self.state_averager.local_epoch = state_dict["state"].pop("local_epoch")
        self.state_averager.optimizer.load_state_dict(state_dict)

    # --- the step ----------------------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None, batch_size: int | None = None,
             grad_scaler: GradScaler | None = None):
        """Accumulate this batch's gradients; take the global step when the swarm is ready."""
        if grad_scaler is not None and not isinstance(grad_scaler, GradScaler):
            raise ValueError("use plexus.GradScaler with plexus.Optimizer: torch's scaler would step every batch")
        if grad_scaler is not None and not self.reuse_grad_buffers:
            raise ValueError("plexus.GradScaler needs reuse_grad_buffers=True (gradients stay scaled in .grad)")
        if self.auxiliary and (closure is not None or batch_size is not None):
            raise ValueError("an auxiliary peer takes no batches: call step() without closure or batch_size")
        batch_size = self.batch_size_per_step if batch_size is None else batch_size
        if batch_size is None and not self.auxiliary:
            raise ValueError("pass batch_size to step() or batch_size_per_step to the constructor")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        if not self.auxiliary and self._should_load_state_from_peers():
            logger.log(self.status_loglevel, "Peer is out of sync with the swarm; downloading the state")
            self.load_state_from_peers()
            return loss

        if self.use_local_updates:
            self.state_averager.step(apply_delayed_updates=True, optimizer_step=True, zero_grad=False,
                                     delay_optimizer_step=False)
            self._report(self.tracker.local_progress.samples_accumulated + batch_size)
        elif not self.auxiliary:
            if grad_scaler is not None and not grad_scaler.are_grads_finite(self, use_cached=True):
                logger.log(self.status_loglevel, "Non-finite gradients: this batch and the accumulated ones are dropped")
                self.grad_averager.reset_accumulated_grads_()
                self._report(0)
                return loss
            self.grad_averager.accumulate_grads_(batch_size)
            self._report(self.grad_averager.local_samples_accumulated)
            self.state_averager.step(apply_delayed_updates=True)
            self._maybe_schedule_gradient_averaging()

        if self.tracker.ready_to_update_epoch and self._still_ready_after_a_fresh_look():
            self._update_global_epoch(grad_scaler)
        return loss

    def _still_ready_after_a_fresh_look(self) -> bool:
        """Before stepping alone, look again: peers that started with us may have appeared since."""
        if self.tracker.global_progress.num_peers > 1:
            return True
        self.tracker.fetch_global_progress_now(timeout=self.averaging_timeout)
        return self.tracker.ready_to_update_epoch

    def _report(self, samples: int) -> None:
        self.tracker.report_local_progress(self.local_epoch, samples)

    def _should_load_state_from_peers(self) -> bool:
        """Exactly in step once per epoch (after a fresh look at the swarm), else at most one behind."""
        global_epoch = self.tracker.global_progress.epoch
        if self._fetch_count_at_epoch is not None and self.tracker.fetch_count > self._fetch_count_at_epoch:
            self._fetch_count_at_epoch = None
            return self.local_epoch != global_epoch
        return self.local_epoch < global_epoch - 1

    def _maybe_schedule_gradient_averaging(self) -> None:
        progress = self.tracker.global_progress
        eta = self.tracker.estimated_next_update_time - get_dht_time()
        if progress.num_peers > 1 and eta <= self.matchmaking_time and _idle(self._scheduled_grads):
            scheduled_time = max(self.tracker.estimated_next_update_time, get_dht_time() + 0.1)
            self._scheduled_grads = self.grad_averager.schedule_step(scheduled_time, timeout=self.averaging_timeout)

    def _update_global_epoch(self, grad_scaler: GradScaler | None) -> None:
        with self.tracker.pause_updates():
            progress = self.tracker.global_progress
            swarm_has_peers = progress.num_peers > 1
            wait_for_trigger = None
            if self.use_gradient_averaging:
                wait_for_trigger = self._average_gradients(swarm_has_peers, grad_scaler)
            next_epoch = max(self.local_epoch + 1, progress.epoch)
            average_state = swarm_has_peers and next_epoch % self.average_state_every == 0
            output = self.state_averager.step(
                increment_epoch=True, wait_for_trigger=wait_for_trigger,
                optimizer_step=not self.auxiliary and not self.use_local_updates,
                zero_grad=self.reuse_grad_buffers and not self.offload_optimizer,
                delay_optimizer_step=self.delay_optimizer_step, averaging_round=average_state,
                delay_averaging=(self.delay_state_averaging or self.delay_optimizer_step) and not self.auxiliary,
                averaging_opts=dict(timeout=self.averaging_timeout) if average_state else None,
                grad_scaler=grad_scaler)
            if self.offload_optimizer and self.use_gradient_averaging:
                self.grad_averager.notify_used_averaged_gradients()  # the offloaded step reads them in place
            if output:
                logger.log(self.status_loglevel, f"Averaged parameters with {len(output)} peers")
            if self.state_averager.local_epoch < progress.epoch:  # a late peer catches up on the count
                self.state_averager.local_epoch = progress.epoch
            self.tracker.update_epoch(self.local_epoch)
            self._fetch_count_at_epoch = self.tracker.fetch_count
            self.state_averager.state_sharing_priority = self.local_epoch
            if self.grad_averager is not None:
                self.grad_averager.state_sharing_priority = self.local_epoch
            if self.use_local_updates:
                self._report(0)
        logger.log(self.status_loglevel, f"Transitioned to epoch {self.local_epoch}")

    def _average_gradients(self, swarm_has_peers: bool, grad_scaler: GradScaler | None):
        """Start (or trigger) the gradient round; wait for it now or hand the wait to the state averager."""
        if self.delay_optimizer_step:
            self.state_averager.step(wait_for_delayed_updates=True)  # the previous step read the buffers
        if grad_scaler is not None:
            with grad_scaler.running_global_step():
                grad_scaler.unscale_(self)
        control, self._scheduled_grads = self._scheduled_grads, None
        if not swarm_has_peers:
            if control is not None:
                control.cancel()
            self.grad_averager.load_accumulators_into_averager_()
            self.grad_averager.reset_accumulated_grads_()
            return None if self.offload_optimizer else self._averaged_gradients_into_params()
        if control is None:
            control = self.grad_averager.schedule_step(timeout=self.averaging_timeout)
        self.grad_averager.step(control=control, reset_accumulators=True, wait=False)

        def wait_for_gradients() -> None:
            try:
                group = control.result(self.averaging_timeout)
                logger.log(self.status_loglevel, f"Averaged gradients with {len(group)} peers")
            except (AveragingError, TimeoutError, ConnectionError) as error:
                reason = str(error) or f"no result within {self.averaging_timeout} s"
                logger.log(self.status_loglevel, f"Proceeding with local gradients: {reason}")

        if self.delay_grad_averaging:
            return wait_for_gradients
        wait_for_gradients()
        return None if self.offload_optimizer else self._averaged_gradients_into_params()

    def _averaged_gradients_into_params(self):
        """Without offloading, the optimizer reads `.grad`: a hook that puts the averaged gradients
        there, run by the state averager just before its optimizer step."""
        grad_averager = self.grad_averager

        def swap_in() -> None:
            with grad_averager.get_tensors() as averaged:
                for param, grad in zip(self.state_averager.main_parameters, averaged):
                    if param.grad is None:
                        param.grad = grad.to(param.device, param.dtype, copy=True)
                    else:
                        param.grad.copy_(grad)
            grad_averager.notify_used_averaged_gradients()

        return swap_in

    # --- state --------------------------------------------------------------------------------------

    def load_state_from_peers(self, **kwargs) -> None:
        """Download parameters, optimizer state and epoch from up-to-date peers (bounded attempts)."""
        if self._scheduled_grads is not None:  # tag along with weight 0 so our group is not left waiting
            self._scheduled_grads.weight = 0
        with self.tracker.pause_updates():
            try:
                self.state_averager.load_state_from_peers(timeout=self.load_state_timeout, **kwargs)
            except StateLoadError as error:
                logger.warning(f"Could not load state from peers: {error}")
                return
            if self.grad_averager is not None:
                self.grad_averager.reset_accumulated_grads_()
                if self._scheduled_grads is not None:
                    self._scheduled_grads.cancel()
                    self._scheduled_grads = None
            self.tracker.update_epoch(self.local_epoch)
            self._fetch_count_at_epoch = self.tracker.fetch_count
            self.state_averager.state_sharing_priority = self.local_epoch
        logger.log(self.status_loglevel, f"Loaded state from peers: now at epoch {self.local_epoch}")

    def shutdown(self) -> None:
        logger.log(self.status_loglevel, "Sending goodbye to peers...")
        if self._scheduled_grads is not None:
            self._scheduled_grads.cancel()
        self.tracker.shutdown(self.shutdown_timeout)
        self.state_averager.step(wait_for_delayed_updates=True)
        self.state_averager.shutdown()
        if self.grad_averager is not None:
            self.grad_averager.shutdown()
        logger.log(self.status_loglevel, f"{type(self).__name__} is shut down")

    def __repr__(self) -> str:
        return f"<plexus.Optimizer {self.run_id} epoch={self.local_epoch} wrapping {type(self.opt).__name__}>"


def _idle(control) -> bool:
    return control is None or control.done()


def _check_options(client_mode, auxiliary, offload_optimizer, delay_optimizer_step, delay_grad_averaging,
                   use_local_updates, reuse_grad_buffers, average_state_every, params, optimizer) -> None:
    if client_mode and auxiliary:
        raise ValueError("a client-mode peer cannot be auxiliary: auxiliary peers reduce others' parts")
    if delay_grad_averaging and not delay_optimizer_step:
        raise ValueError("delay_grad_averaging requires delay_optimizer_step")
    if delay_optimizer_step and not offload_optimizer:
        raise ValueError("delay_optimizer_step requires offload_optimizer (pass params and an optimizer factory)")
    if use_local_updates and (delay_grad_averaging or reuse_grad_buffers):
        raise ValueError("use_local_updates averages no gradients: delay_grad_averaging and reuse_grad_buffers "
                         "do not apply")
    if offload_optimizer and params is None:
        raise ValueError("offload_optimizer needs params and an optimizer factory, "
                         "e.g. optimizer=functools.partial(torch.optim.Adam, lr=1e-3), params=model.parameters()")
    if average_state_every < 1:
        raise ValueError(f"average_state_every must be at least 1, got {average_state_every}")
    if isinstance(optimizer, torch.optim.Optimizer) and params is not None:
        raise ValueError("pass either an optimizer instance, or params with an optimizer factory, not both")
