"""`DiLoCoOptimizer`: many local steps, then one averaged outer step (DiLoCo), on a swarm with no master.

Theory of operation
-------------------
Each peer trains with its own inner optimizer (e.g. AdamW), one `step()` per batch. A *round* ends
when the swarm has processed `target_batch_size` samples since the last one (counted by a
`ProgressTracker`, as `plexus.Optimizer` counts an epoch) or after `inner_steps` local steps. Then
each peer computes its pseudo-gradient, the parameters at the round's start minus the current
ones, and a `DecentralizedAverager` averages them over whoever is there, weighted by the samples
each peer processed in the round. The outer optimizer (default: SGD, Nesterov momentum 0.9, lr 0.7)
takes the averaged pseudo-gradient as the gradient of the round-start parameters; the result is
the next round's start, the same on every peer of the round.

Streaming (`fragments=P`): the parameters are cut into P fragments of similar size; fragment p's
rounds end at inner steps `k * H + p * H // P`, so at any moment at most one fragment's
pseudo-gradient is on the wire and peak traffic drops about P-fold. With `overlap` (the default
when P > 1) a round's all-reduce runs while inner steps go on; its result is applied as soon as
it has arrived, at the latest before the same fragment's next round: an outer update is at most
one round stale. The fragment's parameters then become `mixing * local + (1 - mixing) * global`.

Peers and faults. A peer that sees nobody else (or finds no group) applies its own
pseudo-gradient. A pseudo-gradient holding NaN or inf is never sent: that peer contributes
nothing and drops its round's local progress. The averager excludes members that send NaN or inf,
bounds weights, and with `averager_opts=dict(robust=RobustAggregation(...))` clips outliers. A
member that dies mid-round leaves a span unanswered; rounds take complete results only
(`accept_partial=False`), so the others retry without it and still apply one identical update. A peer whose tracker shows the
swarm at a later round (a newcomer, or one that missed a round) downloads the round-start
parameters, the outer optimizer state and the round number from a peer (state sharing, as
`plexus.Optimizer.load_state_from_peers` does) and contributes from there on.

`last_round` describes the latest round: peers, bytes this host sent and received while it ran
(`Host.traffic`: everything on the wire, DHT included), duration.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..averaging.averager import AveragingError, DecentralizedAverager
from ..averaging.control import StepControl
from ..compression import CompressionInfo
from ..dht.dht import DHT
from ..errors import UsageError
from ..utils.logging import get_logger
from ..utils.tensors import all_finite
from .diloco_options import DiLoCoOptions
from .optimizer_state import flatten_optimizer_state, initialize_optimizer_state, unflatten_optimizer_state
from .progress_tracker import ProgressTracker
from .pseudo_gradient import PseudoGradientCodec

logger = get_logger(__name__)


@dataclass(frozen=True)
class RoundStats:
    """What one round of one fragment cost and who took part."""

    epoch: int
    """The round's number (the fragment's rounds completed before it)."""
    fragment: int
    peers: int
    """Members of the group that averaged (1: this peer applied its own pseudo-gradient)."""
    bytes_sent: int
    """Bytes this host sent on all its connections while the round ran."""
    bytes_received: int
    duration: float
    """Seconds from the round's start to its result being applied."""
    weight: float
    """Samples this peer contributed (0 if its pseudo-gradient was not finite)."""


class _StateSharingAverager(DecentralizedAverager):
    """Averages one fragment's pseudo-gradients; the first one also serves the optimizer's state
    (round-start parameters, outer optimizer state, round numbers) to peers that download it."""

    def __init__(self, *args, state_source=None, **kwargs):
        self._state_source = state_source
        super().__init__(*args, **kwargs)

    def get_current_state(self):
        if self._state_source is None:
            return super().get_current_state()
        return self._state_source()


class _Fragment:
    """One fragment's parameters, its round-start copy, buffers, outer optimizer and averager."""

    def __init__(self, index: int, params: list[torch.Tensor], codec: PseudoGradientCodec, options):
        self.index, self.params = index, params
        self.start = [param.detach().clone().float() for param in params]
        self.buffers = [torch.zeros(param.shape, dtype=codec.buffer_dtype) for param in params]
        self.residuals = [torch.zeros_like(start) for start in self.start] if codec.error_feedback else None
        self.outer = options.outer_optimizer(params)
        initialize_optimizer_state(self.outer)
        self.epoch = 0
        self.samples = 0  # this round's, so far
        self.averager: _StateSharingAverager | None = None
        self.pending: tuple[StepControl, float, tuple[int, int], float] | None = None


class DiLoCoOptimizer:
    """Low-communication training: `opt = DiLoCoOptimizer(dht=dht, run_id="run", params=model.parameters(),
    inner_optimizer=functools.partial(torch.optim.AdamW, lr=1e-3), options=DiLoCoOptions(inner_steps=100,
    batch_size_per_step=32))`, then `loss.backward(); opt.step(); opt.zero_grad()` per batch.

    See the module docstring for how rounds work, and `DiLoCoOptions` for every knob.
    """

    def __init__(
        self,
        *,
        dht: DHT,
        run_id: str,
        params: Iterable[torch.Tensor],
        inner_optimizer,
        options: DiLoCoOptions,
        client_mode: bool | None = None,
    ):
        if not isinstance(options, DiLoCoOptions):
            raise UsageError(f"options must be a DiLoCoOptions, got {type(options).__name__}")
        if not isinstance(run_id, str) or not run_id or "." in run_id:
            raise UsageError(f"run_id must be a non-empty string without '.', got {run_id!r}")
        self.params = [param for param in params]
        if not self.params or not all(
            isinstance(p, torch.Tensor) and p.is_floating_point() for p in self.params
        ):
            raise UsageError(
                "params must be a non-empty sequence of floating-point tensors (model.parameters())"
            )
        if options.fragments > len(self.params):
            raise UsageError(
                f"fragments={options.fragments} but there are only {len(self.params)} parameter tensors"
            )
        if isinstance(inner_optimizer, torch.optim.Optimizer):
            self.inner = inner_optimizer
        elif callable(inner_optimizer):
            self.inner = inner_optimizer(self.params)
        else:
            raise UsageError("inner_optimizer must be a torch optimizer or a factory: params -> optimizer")
        self.dht, self.run_id, self.options = dht, run_id, options
        self.client_mode = dht.client_mode if client_mode is None else client_mode
        self.codec = PseudoGradientCodec(options.compression, options.error_feedback)
        self.fragments = [
            _Fragment(index, group, self.codec, options)
            for index, group in enumerate(split_into_fragments(self.params, options.fragments))
        ]
        self.local_steps = 0
        """Inner steps taken since this peer started (or since it last loaded state)."""
        self.rounds: list[RoundStats] = []
        """Every round so far, oldest first."""
        self.state_loads = 0
        """How many times this peer replaced its state with the swarm's."""
        self.dropped_rounds = 0
        """Rounds whose local pseudo-gradient was not finite (this peer contributed nothing)."""
        self.nonfinite_batches = 0
        self._next_load_attempt = 0.0
        averager_opts = dict(
            min_matchmaking_time=options.matchmaking_time,
            allreduce_timeout=options.averaging_timeout,
            client_mode=self.client_mode,
        )
        averager_opts.update(options.averager_opts)
        for fragment in self.fragments:
            fragment.averager = _StateSharingAverager(
                fragment.buffers,
                dht,
                prefix=f"{run_id}_diloco{fragment.index}" if options.fragments > 1 else f"{run_id}_diloco",
                compression=self.codec.wire_compression,
                state_source=self._current_state if fragment.index == 0 else None,
                shared_lossy_answers=self.codec.loses_on_the_wire,
                compression_residuals=fragment.residuals if self.codec.loses_on_the_wire else None,
                allow_state_sharing=False if fragment.index else None,
                start=True,
                **averager_opts,
            )
        tracker_target = options.target_batch_size or options.inner_steps * (options.batch_size_per_step or 1)
        self.tracker = ProgressTracker(
            dht,
            run_id,
            tracker_target,
            client_mode=self.client_mode,
            **{"state_prefix": self.fragments[0].averager.prefix, **options.tracker_opts},
        )
        self.tracker.fetch_global_progress_now(timeout=options.averaging_timeout)

    # --- what the training loop calls --------------------------------------------------------------

    @property
    def local_epoch(self) -> int:
        """Rounds completed by the first fragment (every fragment, without streaming)."""
        return self.fragments[0].epoch

    @property
    def last_round(self) -> RoundStats | None:
        return self.rounds[-1] if self.rounds else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, batch_size: int | None = None) -> None:
        """One inner step on this batch's gradients; an outer round when one is due."""
        batch_size = self.options.batch_size_per_step if batch_size is None else batch_size
        if not (isinstance(batch_size, int) and batch_size >= 1):
            raise UsageError(
                f"pass a positive batch_size to step() or batch_size_per_step, got {batch_size!r}"
            )
        if self._behind_the_swarm():
            self.load_state_from_peers()
        grads = [param.grad for param in self.params if param.grad is not None]
        if not all_finite(grads):
            self.nonfinite_batches += 1
            logger.warning("Non-finite local gradients: this batch is skipped")
            return
        self.inner.step()
        self.local_steps += 1
        for fragment in self.fragments:
            fragment.samples += batch_size
        self._apply_arrived_results()
        self.tracker.report_local_progress(self.local_epoch, self.fragments[0].samples)
        for fragment in self._due_fragments():
            self._start_round(fragment)

    def _due_fragments(self) -> list[_Fragment]:
        if self.options.inner_steps is None:
            ready = self.tracker.ready_to_update_epoch
            return list(self.fragments) if ready else []
        steps, period = self.local_steps, self.options.inner_steps
        offsets = [fragment.index * period // len(self.fragments) for fragment in self.fragments]
        return [
            f
            for f, offset in zip(self.fragments, offsets)
            if steps > offset and (steps - offset) % period == 0
        ]

    # --- rounds --------------------------------------------------------------------------------------

    def _start_round(self, fragment: _Fragment) -> None:
        if fragment.pending is not None:  # its previous round must land first: at most one round stale
            self._finish_round(fragment)
        weight = float(fragment.samples)
        with torch.no_grad():
            deltas = [start - param.detach().float() for start, param in zip(fragment.start, fragment.params)]
            finite = all_finite(deltas)
            if not finite:
                self.dropped_rounds += 1
                weight = 0.0
                logger.warning(
                    f"Fragment {fragment.index}: the pseudo-gradient holds NaN or inf; it is not sent, "
                    f"and this round's local progress is dropped"
                )
                for param, start in zip(fragment.params, fragment.start):
                    param.copy_(start)
                for buffer in fragment.buffers:
                    buffer.zero_()
            else:
                residuals = fragment.residuals or [None] * len(deltas)
                for delta, buffer, residual in zip(deltas, fragment.buffers, residuals):
                    self.codec.encode(delta, buffer, residual)
        fragment.samples = 0
        began, traffic = time.monotonic(), self.dht.host.traffic.snapshot()
        peers = self._swarm_size()
        if peers <= 1:
            logger.info(f"Fragment {fragment.index} round {fragment.epoch}: no other peer in the swarm")
            control = None
        else:
            control = fragment.averager.step(
                weight=weight,
                wait=False,
                timeout=self.options.averaging_timeout,
                expected_group_size=max(peers, 2),
                alone_timeout=fragment.averager.request_timeout + self.options.matchmaking_time,
                round_tag=f"diloco {fragment.index} {fragment.epoch}".encode(),
                accept_partial=False,  # a member that died mid-round: retry without it, all alike
            )
        fragment.pending = (control, began, traffic, weight)
        if not self.options.overlapped:
            self._finish_round(fragment)

    def _swarm_size(self) -> int:
        """Peers that train (this one included); before concluding that it is alone, look again."""
        progress = self.tracker.global_progress
        if progress.num_peers - progress.num_clients <= 1:
            progress = self.tracker.fetch_global_progress_now(timeout=self.options.averaging_timeout)
        return max(progress.num_peers - progress.num_clients + (1 if self.client_mode else 0), 1)

    def _apply_arrived_results(self) -> None:
        for fragment in self.fragments:
            if fragment.pending is not None and (fragment.pending[0] is None or fragment.pending[0].done()):
                self._finish_round(fragment)

    def _finish_round(self, fragment: _Fragment) -> None:
        """Wait for the fragment's round; take the outer step with what it averaged (or alone)."""
        control, began, (sent, received), weight = fragment.pending
        fragment.pending = None
        peers = 1
        if control is not None:
            try:
                peers = len(control.result())
            except AveragingError as error:
                logger.info(f"Fragment {fragment.index} round {fragment.epoch}: alone ({error})")
        mixing = self.options.mixing if self.options.overlapped else 0.0
        with fragment.averager.get_tensors() as averaged:
            pseudo_gradients = [
                buffer.to(param.dtype, copy=True) for buffer, param in zip(averaged, fragment.params)
            ]
        with torch.no_grad(), self._state_lock():
            local = [param.detach().clone() for param in fragment.params] if mixing else None
            saved_grads = [param.grad for param in fragment.params]
            for param, start, pseudo_gradient in zip(fragment.params, fragment.start, pseudo_gradients):
                param.copy_(start)
                param.grad = pseudo_gradient
            fragment.outer.step()
            for index, (param, start) in enumerate(zip(fragment.params, fragment.start)):
                start.copy_(param)
                param.grad = saved_grads[index]
                if local is not None:
                    param.mul_(1 - mixing).add_(local[index], alpha=mixing)
            fragment.epoch += 1
        now_sent, now_received = self.dht.host.traffic.snapshot()
        stats = RoundStats(
            fragment.epoch - 1,
            fragment.index,
            peers,
            now_sent - sent,
            now_received - received,
            time.monotonic() - began,
            weight,
        )
        self.rounds.append(stats)
        if fragment.index == 0:
            self.tracker.update_epoch(fragment.epoch)
            fragment.averager.state_sharing_priority = fragment.epoch
            self.tracker.report_local_progress(fragment.epoch, fragment.samples)
        logger.debug(f"DiLoCo round done: {stats}")

    def _state_lock(self):
        """Held while the round-start state changes, so that a peer downloading it sees it whole (the
        state-sharing averager holds it while it reads `_current_state`)."""
        return self.fragments[0].averager._lock

    # --- state sharing -------------------------------------------------------------------------------

    def _current_state(self) -> tuple[Any, Sequence[torch.Tensor], Sequence]:
        """What a newcomer downloads (the lock is held): round numbers, outer optimizer metadata, and
        the tensors: every fragment's round-start parameters, then its outer optimizer state."""
        tensors, outer = [], []
        for fragment in self.fragments:
            metadata, state_tensors = flatten_optimizer_state(fragment.outer)
            outer.append(metadata)
            tensors.extend(fragment.start)
            tensors.extend(state_tensors)
        metadata = dict(epochs=[fragment.epoch for fragment in self.fragments], outer=outer)
        return (
            metadata,
            tensors,
            [CompressionInfo.from_tensor(tensor, key=i) for i, tensor in enumerate(tensors)],
        )

    def _behind_the_swarm(self) -> bool:
        if any(fragment.pending is not None for fragment in self.fragments):
            return False
        return (
            self.tracker.global_progress.epoch > self.local_epoch
            and time.monotonic() >= self._next_load_attempt
        )

    def load_state_from_peers(self) -> bool:
        """Adopt a peer's round-start parameters, outer optimizer state and round numbers; True if
        one was adopted. The inner optimizer is this peer's own and is kept."""
        swarm_epoch = self.tracker.global_progress.epoch
        averager = self.fragments[0].averager
        try:
            loaded = averager.load_state_from_peers(
                timeout=self.options.load_state_timeout, min_priority=swarm_epoch
            )
        except Exception as error:  # a donor that fails or lies must not stop training
            logger.warning(f"Could not load state from peers: {error!r}")
            loaded = None
        if loaded is None:
            self._next_load_attempt = time.monotonic() + self.tracker.max_refresh_period
            return False
        try:
            self._adopt_state(*loaded)
        except (ValueError, TypeError) as error:
            logger.warning(f"A peer's state does not fit this model: {error}")
            self._next_load_attempt = time.monotonic() + self.tracker.max_refresh_period
            return False
        self.state_loads += 1
        return True

    def _adopt_state(self, metadata, tensors) -> None:
        if not (
            isinstance(metadata, dict)
            and isinstance(metadata.get("epochs"), list)
            and isinstance(metadata.get("outer"), list)
            and len(metadata["epochs"]) == len(metadata["outer"]) == len(self.fragments)
            and all(isinstance(epoch, int) and epoch >= 0 for epoch in metadata["epochs"])
        ):
            raise ValueError(f"malformed DiLoCo state metadata {metadata!r:.100}")
        remaining, plans = list(tensors), []
        for fragment, outer_metadata in zip(self.fragments, metadata["outer"]):
            starts, remaining = remaining[: len(fragment.start)], remaining[len(fragment.start) :]
            if len(starts) != len(fragment.start) or any(
                a.shape != b.shape for a, b in zip(starts, fragment.start)
            ):
                raise ValueError(f"fragment {fragment.index}: the parameters' shapes differ from ours")
            entries = outer_metadata.get("state") if isinstance(outer_metadata, dict) else None
            count = sum(1 for e in entries if isinstance(e, list) and e[2:3] == [True]) if entries else 0
            state_tensors, remaining = remaining[:count], remaining[count:]
            outer_state = unflatten_optimizer_state(outer_metadata, state_tensors, fragment.outer)
            if not all_finite(starts):
                raise ValueError("the parameters hold NaN or inf")
            plans.append((fragment, starts, outer_state))
        if remaining:
            raise ValueError(f"{len(remaining)} tensors more than this model's state has")
        with torch.no_grad(), self._state_lock():
            for (fragment, starts, outer_state), epoch in zip(plans, metadata["epochs"]):
                for param, start, loaded in zip(fragment.params, fragment.start, starts):
                    start.copy_(loaded)
                    param.copy_(loaded)
                fragment.outer.load_state_dict(outer_state)
                fragment.epoch, fragment.samples = epoch, 0
                if fragment.residuals is not None:
                    for residual in fragment.residuals:
                        residual.zero_()
        self.fragments[0].averager.state_sharing_priority = self.local_epoch
        self.tracker.update_epoch(self.local_epoch)
        self._align_with_the_swarm()
        logger.info(f"Loaded DiLoCo state from peers: now at round {self.local_epoch}")

    def _align_with_the_swarm(self) -> None:
        """With `inner_steps`, a newcomer starts counting where the swarm's peers are in the round."""
        if self.options.inner_steps is None:
            return
        progress = self.tracker.global_progress
        batch = self.options.batch_size_per_step or 1
        workers = max(1, progress.num_peers - progress.num_clients - 1)
        done = min(self.options.inner_steps - 1, round(progress.samples_accumulated / workers / batch))
        self.local_steps = self.local_epoch * self.options.inner_steps + done

    # --- life cycle ----------------------------------------------------------------------------------

    def finish_rounds(self) -> None:
        """Wait for overlapped rounds still on the wire and apply them."""
        for fragment in self.fragments:
            if fragment.pending is not None:
                self._finish_round(fragment)

    def shutdown(self) -> None:
        for fragment in self.fragments:
            if fragment.pending is not None and fragment.pending[0] is not None:
                fragment.pending[0].cancel()
            fragment.pending = None
        self.tracker.shutdown()
        for fragment in self.fragments:
            fragment.averager.shutdown()

    def __repr__(self) -> str:
        return f"<DiLoCoOptimizer {self.run_id} round={self.local_epoch} fragments={len(self.fragments)}>"


def split_into_fragments(params: Sequence[torch.Tensor], count: int) -> list[list[torch.Tensor]]:
    """`count` groups of consecutive parameters with similar numbers of elements (none empty)."""
    total = sum(param.numel() for param in params)
    groups: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    seen = 0
    for index, param in enumerate(params):
        current.append(param)
        seen += param.numel()
        groups_after = count - len(groups) - 1
        params_after = len(params) - index - 1
        if groups_after > 0 and (seen * count >= (len(groups) + 1) * total or params_after == groups_after):
            groups.append(current)
            current = []
    groups.append(current)
    return groups
