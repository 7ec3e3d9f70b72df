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
the swarm is ready, runs the global step.

Staying in step. A peer's epoch only moves in a round it took part in (or alone, when it sees no
peers), and the tracker's view of the global epoch never falls below our own, so a peer whose
tracker shows a newer epoch has missed a step: it downloads the state (parameters, optimizer,
scheduler, epoch) and drops what it accumulated, instead of averaging its stale gradients into
the swarm's next epoch as hivemind tolerates for one epoch. As a second guard, gradient rounds
gather each member's epoch, and a member that finds a newer epoch in its group contributes with
weight 0 and then downloads the state: gradients of different epochs are never mixed. Peers that
start together see each other before their first step (the tracker publishes before the
constructor returns, and a peer about to step alone looks again), so they share epoch 0 instead
of running solo epochs; a peer that starts late downloads the state at its first step. With `use_local_updates`, every `step()` is a local
optimizer step and only the state is averaged at epoch boundaries. Delayed updates
(`delay_optimizer_step`, `delay_grad_averaging`) move the optimizer step and the averaging to the
background, one epoch stale, as in hivemind.

Differences from hivemind, on purpose: `client_mode` defaults to the DHT's and is honoured when
given (hivemind ignored it); loading state makes a bounded number of attempts (then training goes
on and the load is retried after `max_refresh_period`); peers one epoch behind resynchronise
instead of contributing stale gradients; a GradScaler requires `reuse_grad_buffers` (the only case
its scaling rules are correct for). The tutorial's status lines (`Step #N`, `Your current
contribution`, `Performance`, `Local loss`, `Averaged gradients/parameters with N peers`) are
logged at each epoch, at INFO with `verbose=True`.

Bad members. A batch whose local gradients are not finite is dropped before it is accumulated
(with a GradScaler, as torch's scaler does; without one, by a check of every gradient), so it
never reaches a round. In gradient rounds no member's weight counts for more than its progress
record justifies (`_gradient_weight_limits`), and rounds reject non-finite parts (the averagers'
defaults). `robust_aggregation` turns on CenteredClip and verified reducers in both averagers.
"""

import concurrent.futures
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..averaging.aggregation import RobustAggregation
from ..averaging.averager import AveragingError, LeftOutError
from ..averaging.control import AveragingStage, StepControl
from ..compression import CompressionBase, NoCompression
from ..dht.dht import DHT
from ..p2p.identity import PeerID
from ..utils.logging import RateLimitedLog, get_logger, use_default_log_handler
from ..utils.tensors import all_finite
from ..utils.timing import get_dht_time
from .epoch_policy import (
    EpochAction,
    after_gradient_round,
    gradient_weight,
    overtaken,
    should_load_state,
    state_weight,
)
from .grad_averager import GradientAverager, GradientAveragerFactory
from .grad_scaler import GradScaler
from .progress_tracker import ProgressTracker
from .state_averager import StateLoadError, TrainingStateAverager

logger = get_logger(__name__)
_dropped_batches = RateLimitedLog(logger)


class Optimizer(torch.optim.Optimizer):
    """A collaborative optimizer: `opt = plexus.Optimizer(dht=dht, run_id="my_run",
    target_batch_size=4096, batch_size_per_step=32, optimizer=partial(torch.optim.Adam, lr=1e-3),
    params=model.parameters())`, then `loss.backward(); opt.step(); opt.zero_grad()` as usual.

    Names and defaults are hivemind's. Every peer of a run passes the same `run_id`,
    `target_batch_size`, compression and robustness options; the rest is each peer's own choice.

    Args:
        dht: this peer's running `DHT`; progress, matchmaking and state downloads go through it.
        run_id: the swarm's name; peers with the same `run_id` train together. It prefixes the
            DHT keys of the progress tracker and of both averagers.
        target_batch_size: samples the whole swarm accumulates per global step (an *epoch*).
        batch_size_per_step: samples behind one call to `step()`, when `step()` is not told
            `batch_size`; counted toward the target and used to weigh this peer in gradient rounds.
        optimizer: the wrapped torch optimizer: an instance, or a factory called with `params`
            (`functools.partial(torch.optim.Adam, lr=1e-3)`). Offloading needs the factory.
        params: the parameters or parameter groups to hand to the `optimizer` factory.
        scheduler: a learning-rate scheduler, or a factory called with the optimizer; it steps once
            per global epoch, not per local step.
        matchmaking_time: how long before the epoch's expected end a peer starts looking for a
            group, and the least time it spends gathering one; raise it on slow links.
        averaging_timeout: the longest a whole averaging round may take; also the deadline of the
            first progress fetch in the constructor.
        allreduce_timeout: the deadline of the all-reduce itself, once the group is formed
            (default: `averaging_timeout`).
        next_chunk_timeout: the longest a reducer waits for a peer's next part before it goes on
            without that peer (default: `matchmaking_time`).
        load_state_timeout: the deadline of one state download from a peer.
        reuse_grad_buffers: accumulate in the parameters' own `.grad` (saves a copy of the
            gradients; then do not call `zero_grad()` yourself, the Optimizer clears them after each
            epoch). Required with a `plexus.GradScaler`.
        offload_optimizer: let the wrapped optimizer step float32 CPU copies of the parameters,
            copied back into the model after each step (default: on when `params` is given and
            `use_local_updates` is off).
        delay_optimizer_step: take the optimizer step in the background, so the next epoch's
            batches start at once on parameters one step stale (default: `delay_grad_averaging`;
            needs `offload_optimizer`).
        delay_grad_averaging: average gradients in the background as well (needs
            `delay_optimizer_step`).
        delay_state_averaging: average the state in the background instead of blocking `step()`.
        average_state_every: average parameters (and the chosen optimizer statistics) every this
            many epochs; at least 1.
        use_local_updates: every `step()` is a local optimizer step and no gradients are averaged;
            only the state is, at the epoch's end. Excludes `delay_grad_averaging` and
            `reuse_grad_buffers`.
        client_mode: this peer only dials out: it sends and receives but reduces no part of a
            round, so it works behind NAT (default: the DHT's mode).
        auxiliary: this peer has no model of its own to train and only helps reduce others' parts;
            call `step()` with no batch. Cannot be combined with `client_mode`.
        grad_compression: how gradients travel in gradient rounds.
        state_averaging_compression: how parameters and statistics travel in state rounds.
        load_state_compression: how the state travels when a newcomer downloads it.
        average_opt_statistics: optimizer state keys averaged along with the parameters, e.g.
            `("exp_avg_sq",)` for Adam.
        extra_tensors: more tensors averaged and shared with the state, e.g. batch-norm statistics.
        averager_opts: more keyword arguments for both averagers (`target_group_size`,
            `min_group_size`, `bandwidth`, `request_timeout`, ...).
        tracker_opts: more keyword arguments for the `ProgressTracker` (refresh periods,
            `bounds`, ...).
        grad_averager_factory: builds the gradient averager from (parameters, dht=, prefix=, ...),
            e.g. `functools.partial(PowerSGDGradientAverager, averager_rank=32)` (default:
            `GradientAverager`).
        performance_ema_alpha: smoothing factor of the samples-per-second estimate this peer
            reports, and of the measured delay before its rounds begin.
        shutdown_timeout: how long `shutdown()` waits for a round still under way.
        verbose: log the per-epoch status lines (`Step #N`, contribution, performance, averaged
            peers) at INFO instead of DEBUG.
        robust_aggregation: a `RobustAggregation` (CenteredClip per part, verified reducers) for
            the gradient and state rounds, for swarms with peers you cannot trust; every peer of a
            run must pass equal options (default None: plain means).
    """

    def __init__(
        self,
        *,
        dht: DHT,
        run_id: str,
        target_batch_size: int,
        batch_size_per_step: int | None = None,
        optimizer,
        params: Iterable | None = None,
        scheduler=None,
        matchmaking_time: float = 15.0,
        averaging_timeout: float = 60.0,
        allreduce_timeout: float | None = None,
        next_chunk_timeout: float | None = None,
        load_state_timeout: float = 600.0,
        reuse_grad_buffers: bool = False,
        offload_optimizer: bool | None = None,
        delay_optimizer_step: bool | None = None,
        delay_grad_averaging: bool = False,
        delay_state_averaging: bool = True,
        average_state_every: int = 1,
        use_local_updates: bool = False,
        client_mode: bool | None = None,
        auxiliary: bool = False,
        grad_compression: CompressionBase = NoCompression(),
        state_averaging_compression: CompressionBase = NoCompression(),
        load_state_compression: CompressionBase = NoCompression(),
        average_opt_statistics: Sequence[str] = (),
        extra_tensors: Sequence[torch.Tensor] = (),
        averager_opts: dict | None = None,
        tracker_opts: dict | None = None,
        grad_averager_factory: GradientAveragerFactory | None = None,
        performance_ema_alpha: float = 0.1,
        shutdown_timeout: float = 5,
        verbose: bool = False,
        robust_aggregation: RobustAggregation | None = None,
    ):
        client_mode = dht.client_mode if client_mode is None else client_mode
        delay_optimizer_step = delay_grad_averaging if delay_optimizer_step is None else delay_optimizer_step
        if offload_optimizer is None:
            offload_optimizer = params is not None and not use_local_updates
        _check_options(
            client_mode,
            auxiliary,
            offload_optimizer,
            delay_optimizer_step,
            delay_grad_averaging,
            use_local_updates,
            reuse_grad_buffers,
            average_state_every,
            params,
            optimizer,
        )
        self.dht, self.run_id, self.target_batch_size = dht, run_id, target_batch_size
        self.batch_size_per_step, self.client_mode, self.auxiliary = (
            batch_size_per_step,
            client_mode,
            auxiliary,
        )
        self.matchmaking_time, self.averaging_timeout = matchmaking_time, averaging_timeout
        self.load_state_timeout, self.shutdown_timeout = load_state_timeout, shutdown_timeout
        self.reuse_grad_buffers, self.offload_optimizer = reuse_grad_buffers, offload_optimizer
        self.delay_optimizer_step, self.delay_grad_averaging = delay_optimizer_step, delay_grad_averaging
        self.delay_state_averaging, self.average_state_every = delay_state_averaging, average_state_every
        self.use_local_updates = use_local_updates
        self.status_loglevel = logging.INFO if verbose else logging.DEBUG
        if verbose:
            use_default_log_handler()  # a script that configured no logging sees the status lines too
        averager_opts = dict(averager_opts or {})
        round_opts = dict(
            min_matchmaking_time=matchmaking_time,
            client_mode=client_mode,
            start=True,
            robust=robust_aggregation,
            allreduce_timeout=averaging_timeout if allreduce_timeout is None else allreduce_timeout,
            next_chunk_timeout=matchmaking_time if next_chunk_timeout is None else next_chunk_timeout,
            **averager_opts,
        )

        self.state_averager = TrainingStateAverager(
            dht=dht,
            prefix=f"{run_id}_state_averager",
            optimizer=optimizer,
            params=params,
            scheduler=scheduler,
            offload_optimizer=offload_optimizer,
            custom_gradients=offload_optimizer,
            delta_rule_averaging=use_local_updates and delay_state_averaging,
            auxiliary=auxiliary,
            compression=state_averaging_compression,
            state_compression=load_state_compression,
            average_opt_statistics=average_opt_statistics,
            extra_tensors=extra_tensors,
            performance_ema_alpha=performance_ema_alpha,
            status_loglevel=self.status_loglevel,
            **round_opts,
        )
        self.grad_averager: GradientAverager | None = None
        if not use_local_updates:
            averaged_grads = ()
            if offload_optimizer:  # the offloaded optimizer reads the averaged gradients in place
                copies = self.state_averager._optimized_parameters()
                for copy in copies:
                    if copy.grad is None:
                        copy.grad = torch.zeros_like(copy)
                averaged_grads = tuple(copy.grad for copy in copies)
            self.grad_averager = (grad_averager_factory or GradientAverager)(
                self.state_averager.main_parameters,
                dht=dht,
                prefix=f"{run_id}_grad_averager",
                reuse_grad_buffers=reuse_grad_buffers,
                averaged_grads=averaged_grads,
                auxiliary=auxiliary,
                compression=grad_compression,
                weight_limits=self._gradient_weight_limits,
                **round_opts,
            )
        # a peer's claim to be ahead of the swarm is checked against the state it serves (state_prefix)
        self.tracker = ProgressTracker(
            dht,
            run_id,
            target_batch_size,
            client_mode=client_mode,
            performance_ema_alpha=performance_ema_alpha,
            **{
                "status_loglevel": self.status_loglevel,
                "state_prefix": self.state_averager.prefix,
                **(tracker_opts or {}),
            },
        )
        self._gradient_epoch = 0  # the epoch of the last gradient round scheduled (weights: its samples)
        self._scheduled_grads: StepControl | None = None  # this epoch's pre-scheduled gradient round
        self._scheduled_state: tuple[int, StepControl] | None = None  # local updates: (epoch, state round)
        self._triggered_grads: StepControl | None = None  # the last round we triggered (may run on, delayed)
        self._state_round = None  # a background state round whose outcome is not logged yet
        self._must_load_state = False  # a gradient round showed that we are behind
        self._load_at_least = 0  # ...and at least which epoch the swarm reached
        self._next_load_attempt = 0.0  # time.monotonic() before which a failed catch-up is not retried
        self._samples_contributed = 0
        self._losses: list[float] = []
        self.state_loads = 0
        """How many times this peer replaced its state with the swarm's (it was behind)."""
        self.rounds_averaged = 0
        """How many gradient rounds succeeded with this peer's contribution."""
        self.rounds_failed = 0
        """How many gradient rounds failed, so that this peer stepped on its own gradients."""
        self.nonfinite_batches = 0
        """How many local batches were dropped because their gradients held NaN or inf."""
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
            groups.append(
                dict(group, params=list(self.state_averager.main_parameters[start : start + count]))
            )
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
    def scheduled_grads(self) -> StepControl | None:
        """This epoch's pre-scheduled gradient round, if any (hivemind's attribute)."""
        return self._scheduled_grads

    @property
    def use_gradient_averaging(self) -> bool:
        return self.grad_averager is not None

    def is_synchronized_with_peers(self) -> bool:
        return self.local_epoch >= self.tracker.global_progress.epoch

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.reuse_grad_buffers:
            raise ValueError(
                "with reuse_grad_buffers=True the gradient buffers accumulate between epochs; "
                "plexus.Optimizer zeroes them itself, so do not call zero_grad()"
            )
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

    def step(
        self,
        closure: Callable[[], Any] | None = None,
        batch_size: int | None = None,
        grad_scaler: GradScaler | None = None,
    ):
        """Accumulate this batch's gradients; take the global step when the swarm is ready."""
        if grad_scaler is not None and not isinstance(grad_scaler, GradScaler):
            raise ValueError(
                "use plexus.GradScaler with plexus.Optimizer: torch's scaler would step every batch"
            )
        if grad_scaler is not None and not self.reuse_grad_buffers:
            raise ValueError(
                "plexus.GradScaler needs reuse_grad_buffers=True (gradients stay scaled in .grad)"
            )
        if self.auxiliary and (closure is not None or batch_size is not None):
            raise ValueError("an auxiliary peer takes no batches: call step() without closure or batch_size")
        batch_size = self.batch_size_per_step if batch_size is None else batch_size
        if batch_size is None and not self.auxiliary:
            raise ValueError("pass batch_size to step() or batch_size_per_step to the constructor")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            if isinstance(loss, (int, float)) or (isinstance(loss, torch.Tensor) and loss.numel() == 1):
                self._losses.append(float(loss))
        self._log_finished_state_rounds()

        main_parameters = self.state_averager.main_parameters
        if not self.auxiliary and grad_scaler is None and not all_finite(_grads(main_parameters)):
            self._drop_nonfinite_batch()
            return loss
        if self.auxiliary:
            self._follow_swarm_epoch()
        elif self._should_load_state_from_peers():
            logger.log(self.status_loglevel, "Peer is out of sync with the swarm; downloading the state")
            self.load_state_from_peers()
            return loss

        if self.use_local_updates:
            self.state_averager.step(
                apply_delayed_updates=True, optimizer_step=True, zero_grad=False, delay_optimizer_step=False
            )
            self._samples_contributed += batch_size
            self._report(self.tracker.local_progress.samples_accumulated + batch_size)
        elif not self.auxiliary:
            if grad_scaler is not None and not grad_scaler.are_grads_finite(self, use_cached=True):
                logger.log(
                    self.status_loglevel,
                    "Non-finite gradients: this batch and the accumulated ones are dropped",
                )
                self.nonfinite_batches += 1
                self.grad_averager.reset_accumulated_grads_()
                self._report(0)
                return loss
            self.grad_averager.accumulate_grads_(batch_size)
            self._samples_contributed += batch_size
            self._report(self.grad_averager.local_samples_accumulated)
            self.state_averager.step(apply_delayed_updates=True)
        if self.use_gradient_averaging:
            self._maybe_schedule_gradient_averaging()
        elif self.use_local_updates:
            self._maybe_schedule_state_averaging()

        if self.tracker.ready_to_update_epoch and self._still_ready_after_a_fresh_look():
            self._update_global_epoch(grad_scaler)
        return loss

    def _drop_nonfinite_batch(self) -> None:
        """This batch's gradients hold NaN or inf: it is not accumulated (with reuse_grad_buffers the
        .grad buffers summed it into the earlier batches, so those go too), and nobody sees it."""
        self.nonfinite_batches += 1
        lost = "this batch"
        if self.use_gradient_averaging and self.reuse_grad_buffers:
            samples = self.grad_averager.local_samples_accumulated
            lost = f"this batch and the {samples} samples accumulated in .grad"
            self.grad_averager.reset_accumulated_grads_()
            self._report(0)
        else:
            for param in self.state_averager.main_parameters:
                param.grad = None  # a local optimizer step must not see them either
        _dropped_batches.warning(
            ("nonfinite gradients",),
            f"Non-finite local gradients (NaN or inf): {lost} dropped, nothing of it reaches the swarm",
        )

    def _gradient_weight_limits(self, peer_ids) -> dict[PeerID, float]:
        """A member of this epoch's gradient round weighs at most twice the samples its progress
        record extrapolates to now, but never less than two target batches: records lag by up to a
        refresh period (and know no speed at first), and an honest member must never be cut down,
        or the average would no longer be the mean over every sample. Members without a record of
        that epoch are bounded only by the averager's max_weight_ratio."""
        now, limits = get_dht_time(), {}
        for peer in peer_ids:
            record = self.tracker.peer_progress(peer.to_bytes())
            if record is not None and record.epoch == self._gradient_epoch:
                elapsed = max(0.0, now - record.time)
                extrapolated = record.samples_accumulated + record.samples_per_second * elapsed
                limits[peer] = 2 * max(extrapolated, self.target_batch_size)
        return limits

    def _still_ready_after_a_fresh_look(self) -> bool:
        """Before stepping alone, look again: peers that started with us may have appeared since."""
        if self.tracker.global_progress.num_peers > 1:
            return True
        self.tracker.fetch_global_progress_now(timeout=self.averaging_timeout)
        if self.auxiliary and self.tracker.global_progress.num_peers < 1:
            return False  # an auxiliary peer alone has nothing to help with
        return self.tracker.ready_to_update_epoch

    def _report(self, samples: int) -> None:
        self.tracker.report_local_progress(self.local_epoch, samples)

    def _should_load_state_from_peers(self) -> bool:
        """Behind the swarm's epoch means our parameters miss its steps: download them.

        Epochs are counted so that a peer that took part in a round is never behind after it (the
        tracker's estimate never falls below our own epoch), so any peer at a newer epoch means
        the swarm stepped without us. A load that left us behind (no donor yet, or a dead peer's
        record) is retried only after `max_refresh_period`, not at every batch."""
        return should_load_state(
            self.local_epoch,
            self.tracker.global_progress.epoch,
            must_load=self._must_load_state,
            now=time.monotonic(),
            next_attempt=self._next_load_attempt,
        )

    def _follow_swarm_epoch(self) -> None:
        """An auxiliary peer holds no model of its own to fix: it just moves to the swarm's epoch."""
        epoch = self.tracker.global_progress.epoch
        if epoch > self.local_epoch:
            self._release_scheduled_rounds()
            self.state_averager.local_epoch = epoch
            self.state_averager.step(apply_delayed_updates=True)  # catches the scheduler up
            self._set_epoch_everywhere()

    def _maybe_schedule_gradient_averaging(self) -> None:
        progress = self.tracker.global_progress
        eta = self.tracker.estimated_next_update_time - get_dht_time()
        if (
            progress.num_peers > 1
            and eta <= self.matchmaking_time
            and _idle(self._scheduled_grads)
            and _idle(self._triggered_grads)
        ):  # one round at a time (delayed rounds run on)
            self._scheduled_grads = self._schedule_gradient_round(
                max(self.tracker.estimated_next_update_time, get_dht_time() + 0.1)
            )

    def _maybe_schedule_state_averaging(self) -> None:
        """With local updates the state round is the swarm's only round: as for gradient rounds, its
        matchmaking starts ahead of the epoch's end, so the parameters are averaged at the boundary
        (and the result is applied within a batch), not a matchmaking time later while the peers
        drift on apart."""
        progress = self.tracker.global_progress
        next_epoch = self.local_epoch + 1
        eta = self.tracker.estimated_next_update_time - get_dht_time()
        if (
            progress.num_peers > 1
            and eta <= self.matchmaking_time
            and self._scheduled_state is None
            and next_epoch % self.average_state_every == 0
            and not self.state_averager.averaging_in_progress
        ):
            control = self.state_averager.schedule_step(
                max(self.tracker.estimated_next_update_time, get_dht_time() + 0.1),
                gather=[next_epoch, None],
                **self._state_round_options(next_epoch),
            )
            self._scheduled_state = (next_epoch, control)

    def _state_round_options(self, epoch: int) -> dict:
        """A state round for `epoch`: it meets only rounds for the same epoch, takes complete results
        only, weighs by `epoch_policy.state_weight`, and ends when nobody else is looking."""
        return dict(
            timeout=self.averaging_timeout,
            expected_group_size=self._expected_group_size(),
            accept_partial=False,
            weight_for_group=functools.partial(state_weight, epoch),
            round_tag=f"epoch {epoch}".encode(),
            alone_timeout=self.state_averager.request_timeout,
        )

    def _schedule_gradient_round(self, scheduled_time: float | None = None) -> StepControl:
        """Matchmaking for this epoch's gradients. Members gather their epoch; a peer that finds a
        member at a newer epoch contributes with weight 0 (`epoch_policy.gradient_weight`), so the
        gradients of peers at different epochs are never mixed. A round whose all-reduce lost a
        span is retried with whoever is left (every success is the same result for all members),
        and a round that finds nobody else looking one request_timeout after its scheduled time (a
        declaration may still be landing) ends then, rather than at its deadline."""
        epoch = self._gradient_epoch = self.local_epoch
        control = self.grad_averager.schedule_step(
            scheduled_time,
            timeout=self.averaging_timeout,
            gather=None if self.auxiliary else epoch,
            expected_group_size=self._expected_group_size(),
            accept_partial=False,
            alone_timeout=self.grad_averager.request_timeout,
        )
        control.weight_for_group = functools.partial(gradient_weight, epoch)
        return control

    def _expected_group_size(self) -> int:
        """Every peer the tracker sees trains this epoch: a round waits for them all until its
        scheduled time, instead of forming early with the first ones (the others would then find
        themselves an epoch behind)."""
        return max(2, self.tracker.global_progress.num_peers)

    def _release_scheduled_rounds(self) -> None:
        control, self._scheduled_grads = self._scheduled_grads, None
        self._release(control)
        scheduled, self._scheduled_state = self._scheduled_state, None
        if scheduled is not None:
            self._release(scheduled[1])

    def _release(self, control: StepControl | None) -> None:
        """Leave a pre-scheduled round without holding anyone up: a group that is formed gets our
        trigger with weight 0 (it averages without us); a search still running is cancelled."""
        if control is None or control.done():
            return
        if control.stage == AveragingStage.AWAITING_TRIGGER and not control.triggered:
            with contextlib.suppress(RuntimeError):
                control.weight = 0.0
                control.allow_allreduce()
                try:  # the group averages without us; its outcome only matters to it
                    control.result(self.averaging_timeout)
                except Exception as error:
                    logger.debug(f"the round we withdrew from ended with {error!r}")
                return
        control.cancel()
        control.wait_ended()

    def _update_global_epoch(self, grad_scaler: GradScaler | None) -> None:
        behind = False
        with self.tracker.pause_updates():
            progress = self.tracker.global_progress
            swarm_has_peers = progress.num_peers > 1
            wait_for_trigger = None
            if self.use_gradient_averaging:
                outcome = self._average_gradients(swarm_has_peers, grad_scaler)
                behind = outcome is _BEHIND
                wait_for_trigger = None if behind else outcome
            if not behind:
                self._step_state(swarm_has_peers, wait_for_trigger, grad_scaler)
        if behind:
            logger.log(
                self.status_loglevel,
                "Peers averaged gradients for a newer epoch: this peer is behind "
                "and downloads the state instead of stepping",
            )
            self.load_state_from_peers()
            return
        self._log_transition()

    def _step_state(self, swarm_has_peers: bool, wait_for_trigger, grad_scaler) -> None:
        next_epoch = self.local_epoch + 1
        # a state round of an earlier epoch that has not even found its group is of no use now, and
        # the optimizer step would wait for it (up to averaging_timeout, e.g. for a peer that died)
        self.state_averager.cancel_unstarted_rounds()
        average_state = (
            swarm_has_peers
            and next_epoch % self.average_state_every == 0
            and not self.state_averager.averaging_in_progress
        )
        scheduled, self._scheduled_state = self._scheduled_state, None
        control = scheduled[1] if scheduled is not None else None
        if control is not None and not (average_state and scheduled[0] == next_epoch and not control.done()):
            self._release(control)
            control = None
        output = self.state_averager.step(
            increment_epoch=True,
            wait_for_trigger=wait_for_trigger,
            optimizer_step=not self.auxiliary and not self.use_local_updates,
            zero_grad=self.reuse_grad_buffers and not self.offload_optimizer,
            delay_optimizer_step=self.delay_optimizer_step,
            averaging_round=average_state,
            delay_averaging=self.delay_state_averaging
            or self.delay_optimizer_step,  # auxiliary too: it only helps
            averaging_control=control,
            averaging_opts=dict(
                gather=functools.partial(_epoch_and_digest, next_epoch),
                **self._state_round_options(next_epoch),
            )
            if average_state and control is None
            else None,
            grad_scaler=grad_scaler,
        )
        self._log_finished_state_rounds()  # a new round waited for the previous one
        if average_state:
            self._state_round = self.state_averager._last_averaging_stage
        if self.offload_optimizer and self.use_gradient_averaging:
            self.grad_averager.notify_used_averaged_gradients()  # the offloaded step reads them in place
        if output:
            logger.log(self.status_loglevel, f"Averaged parameters with {len(output)} peers")
            self._state_round = None
        self._set_epoch_everywhere()
        if self.use_local_updates:
            self._report(0)

    def _set_epoch_everywhere(self) -> None:
        """The tracker and the gradient averager's priority follow our epoch (the state averager's
        priority follows the state it holds: see TrainingStateAverager)."""
        self.tracker.update_epoch(self.local_epoch)
        if self.grad_averager is not None:
            self.grad_averager.state_sharing_priority = self.local_epoch

    def _average_gradients(self, swarm_has_peers: bool, grad_scaler: GradScaler | None):
        """Start (or trigger) the gradient round; wait for it now or hand the wait to the state averager.

        Returns the hook for the state averager's optimizer stage, or `_BEHIND` when the group was
        at a newer epoch (then nothing was stepped)."""
        if self.delay_optimizer_step:
            self.state_averager.step(wait_for_delayed_updates=True)  # the previous step read the buffers
        if grad_scaler is not None:
            with grad_scaler.running_global_step():
                grad_scaler.unscale_(self)
        control, self._scheduled_grads = self._scheduled_grads, None
        if not swarm_has_peers:
            self._release(control)
            self.grad_averager.load_accumulators_into_averager_()
            self.grad_averager.reset_accumulated_grads_()
            return None if self.offload_optimizer else self._averaged_gradients_into_params()
        if control is None or control.done():  # none scheduled, or its search already gave up
            control = self._schedule_gradient_round()
        epoch = self.local_epoch
        self.grad_averager.step(control=control, reset_accumulators=True, wait=False)
        self._triggered_grads = control
        # with delay_grad_averaging we wait in the background after our epoch moved on, so peers
        # that averaged with us are one epoch ahead of this round too: only further means "without us"
        moved_on = epoch + 1 if self.delay_grad_averaging else epoch

        def wait_for_gradients() -> bool:
            """Wait for the round; True when it showed that this peer is behind and must not step."""
            gathered, reason, left_out = None, None, False
            try:
                gathered = self._wait_for_round(control, moved_on)
                if gathered is None:
                    reason, left_out = "the swarm averaged this epoch without us and moved on", True
            except LeftOutError as error:
                reason, left_out = str(error), True
            except (
                AveragingError,
                TimeoutError,
                ConnectionError,
                concurrent.futures.CancelledError,
            ) as error:
                reason = str(error) or f"no result within {self.averaging_timeout} s"
            except Exception as error:  # never let a broken round stop training
                logger.warning(f"The gradient round failed with {error!r}")
                reason = repr(error)
            swarm_moved_on = gathered is None and (left_out or overtaken(moved_on, self._fresh_swarm_epoch()))
            action = after_gradient_round(epoch, gathered, swarm_moved_on)
            if action is EpochAction.LOAD_STATE:
                self._must_load_state = True  # also read by step() when this ran in the background
                self._load_at_least = max(self._load_at_least, epoch + 1)  # where the group went
                return True
            if action is EpochAction.STEP_LOCAL:
                logger.log(self.status_loglevel, f"Proceeding with local gradients: {reason}")
                self.rounds_failed += 1
                return False
            logger.log(self.status_loglevel, f"Averaged gradients with {len(gathered)} peers")
            self.rounds_averaged += 1
            return False

        if self.delay_grad_averaging:
            return wait_for_gradients
        if wait_for_gradients():
            self.grad_averager.notify_used_averaged_gradients()
            return _BEHIND
        return None if self.offload_optimizer else self._averaged_gradients_into_params()

    def _fresh_swarm_epoch(self) -> int:
        """The swarm's epoch, read from the DHT now (the last estimate if that fails)."""
        try:
            return self.tracker.fetch_global_progress_now(timeout=self.averaging_timeout).epoch
        except Exception as error:  # the DHT may be briefly unreachable: the last estimate will do
            logger.debug(f"could not read the swarm's progress: {error!r}")
            return self.tracker.global_progress.epoch

    def _wait_for_round(self, control: StepControl, epoch: int) -> dict | None:
        """The round's result; None if, while we were still looking for a group, the tracker showed
        the swarm past `epoch` (a group formed without us: waiting out the
        timeout and stepping alone would only put us further apart). Raises the round's error,
        or AveragingError at once when the tracker shows that nobody else is left."""
        deadline = time.monotonic() + self.averaging_timeout
        while True:
            try:
                return control.result(min(POLL_INTERVAL, max(0.0, deadline - time.monotonic())))
            except concurrent.futures.TimeoutError:
                if time.monotonic() >= deadline:
                    raise
            if control.began_allreduce:
                continue
            progress = self.tracker.global_progress
            if overtaken(epoch, progress.epoch):
                control.cancel()
                control.wait_ended()
                return None
            if progress.num_peers < (1 if self.auxiliary else 2):
                control.cancel()
                control.wait_ended()
                raise AveragingError("no other peer is left in the swarm")

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

    # --- logs ---------------------------------------------------------------------------------------

    def _log_transition(self) -> None:
        level = self.status_loglevel
        logger.log(level, f"Step #{self.local_epoch}")
        if not self.auxiliary:
            logger.log(level, f"Your current contribution: {self._samples_contributed} samples")
            logger.log(
                level, f"Performance: {self.tracker.performance_ema.samples_per_second:.3f} samples/sec"
            )
        if self._losses:
            logger.log(level, f"Local loss: {sum(self._losses) / len(self._losses):.5f}")
            self._losses.clear()

    def _log_finished_state_rounds(self) -> None:
        """A background state round that ended since the last step: say how it went."""
        stage = self._state_round
        if stage is None or not stage.done():
            return
        self._state_round = None
        gathered = None if stage.cancelled() or stage.exception() is not None else stage.result()
        if gathered:
            logger.log(self.status_loglevel, f"Averaged parameters with {len(gathered)} peers")

    # --- state --------------------------------------------------------------------------------------

    def load_state_from_peers(self, **kwargs) -> None:
        """Download parameters, optimizer state and epoch from up-to-date peers (bounded attempts).

        Donors still at an older epoch than the swarm's (as the tracker knows it) are not adopted:
        the load fails and is retried later, rather than download a state that is behind already."""
        self._release_scheduled_rounds()
        self._must_load_state = False
        with self.tracker.pause_updates():
            kwargs.setdefault("min_epoch", max(self.tracker.global_progress.epoch, self._load_at_least))
            try:
                loaded = self.state_averager.load_state_from_peers(timeout=self.load_state_timeout, **kwargs)
            except StateLoadError as error:
                logger.warning(f"Could not load state from peers: {error}")
                loaded = False
            if loaded and self.grad_averager is not None:
                self.grad_averager.reset_accumulated_grads_()
                self.grad_averager.notify_used_averaged_gradients()
            self._set_epoch_everywhere()
        if loaded:
            self.state_loads += 1
            self._losses.clear()
            logger.log(self.status_loglevel, f"Loaded state from peers: now at epoch {self.local_epoch}")
        if self.local_epoch < self.tracker.global_progress.epoch:  # no up-to-date donor yet: retry later
            self._next_load_attempt = time.monotonic() + self.tracker.max_refresh_period

    def shutdown(self) -> None:
        """Leave the swarm: withdraw our progress record, finish or cancel background rounds (at
        most `shutdown_timeout` s; rounds still matchmaking are cancelled at once), stop averagers."""
        logger.log(self.status_loglevel, "Sending goodbye to peers...")
        for control in (self._scheduled_grads, self._scheduled_state and self._scheduled_state[1]):
            if control is not None:
                control.cancel()
        self._scheduled_grads = self._scheduled_state = None
        self.tracker.shutdown(self.shutdown_timeout)
        if not self.state_averager.finish_background_work(self.shutdown_timeout):
            logger.warning(f"background averaging did not finish within {self.shutdown_timeout} s; left it")
        self._log_finished_state_rounds()
        self.state_averager.shutdown()
        if self.grad_averager is not None:
            self.grad_averager.shutdown()
        logger.log(self.status_loglevel, f"{type(self).__name__} is shut down")

    def __repr__(self) -> str:
        return f"<plexus.Optimizer {self.run_id} epoch={self.local_epoch} wrapping {type(self.opt).__name__}>"


_BEHIND = object()  # _average_gradients: the group showed that this peer is behind the swarm
POLL_INTERVAL = 0.1  # how often a peer waiting for its gradient round looks whether the swarm moved on


def _grads(parameters) -> list[torch.Tensor]:
    return [param.grad for param in parameters if param.grad is not None]


def _idle(control) -> bool:
    return control is None or control.done()


def _epoch_and_digest(epoch: int, digest: str) -> list:
    """What a state round gathers (see `epoch_policy.state_weight`)."""
    return [epoch, digest]


def _check_options(
    client_mode,
    auxiliary,
    offload_optimizer,
    delay_optimizer_step,
    delay_grad_averaging,
    use_local_updates,
    reuse_grad_buffers,
    average_state_every,
    params,
    optimizer,
) -> None:
    if client_mode and auxiliary:
        raise ValueError("a client-mode peer cannot be auxiliary: auxiliary peers reduce others' parts")
    if delay_grad_averaging and not delay_optimizer_step:
        raise ValueError("delay_grad_averaging requires delay_optimizer_step")
    if delay_optimizer_step and not offload_optimizer:
        raise ValueError(
            "delay_optimizer_step requires offload_optimizer (pass params and an optimizer factory)"
        )
    if use_local_updates and (delay_grad_averaging or reuse_grad_buffers):
        raise ValueError(
            "use_local_updates averages no gradients: delay_grad_averaging and reuse_grad_buffers "
            "do not apply"
        )
    if offload_optimizer and params is None:
        raise ValueError(
            "offload_optimizer needs params and an optimizer factory, "
            "e.g. optimizer=functools.partial(torch.optim.Adam, lr=1e-3), params=model.parameters()"
        )
    if average_state_every < 1:
        raise ValueError(f"average_state_every must be at least 1, got {average_state_every}")
    if isinstance(optimizer, torch.optim.Optimizer) and params is not None:
        raise ValueError("pass either an optimizer instance, or params with an optimizer factory, not both")
