"""`DistributedOptimizer`: a peer of the swarm that is itself a `torch.distributed` job.

Inside the job, DDP keeps the ranks in step: after `backward()` every rank holds the same mean
gradient over the job's batch. Across the swarm the job is one peer with one identity. Rank 0,
the leader, owns a real `plexus.Optimizer` (DHT, progress, averaging, state sharing) and feeds it
that gradient with the whole job's batch size (`world_size x batch_size_per_step`). After each
of its steps it broadcasts what happened: the epoch, how many state downloads, and whether the
parameters changed. When they did (a global step, a state round's result, a download) it
broadcasts the new parameters, and the other ranks, the followers, copy them in. Followers hold
no optimizer state and never talk to the swarm: they mirror the leader bit for bit.

Failures. Every collective of this optimizer waits at most `timeout` seconds. A rank that dies
closes its connections and the others notice at once; one that stalls is given up on after
`timeout`. Either way the surviving ranks raise `RankFailed` from `step()`; the leader first
leaves the swarm (its progress record is withdrawn, its rounds cancelled), so the other peers
average without it. If the leader's own step fails, it tells the followers before raising, and
they raise `RankFailed` at once. A failed job does not recover: restart it, and its leader loads
the swarm's state. DDP's collectives run under the process group's own timeout
(`init_process_group(timeout=...)`): set it too, or a stalled rank blocks `backward()` for torch's
default (10 to 30 minutes).

Room for sharding: only the leader's role talks to the swarm today. Averaging each rank's shard
of the flattened tensors with the same shard of other peers would give every rank that role for
its shard; `step()`, the options and `RankFailed` would stay as they are.
"""

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..dht.dht import DHT
from ..errors import RankFailed, UsageError
from ..optim.optimizer import Optimizer
from ..optim.optimizer_state import optimizer_parameters
from ..utils.logging import get_logger
from .job import Job

logger = get_logger(__name__)

_OK, _ABORT = 0, 1  # the first field of the leader's report
# the second: what the leader is doing, so that ranks that call different methods fail, not mix up
PHASES = ("construction", "step", "load state", "load state dict", "shutdown")
_REPORT_FIELDS = 5  # status, phase, local epoch, state loads, whether the parameters changed
UNSUPPORTED = ("reuse_grad_buffers", "auxiliary")  # options whose gradients or role a job cannot share


class DistributedOptimizer:
    """`plexus.Optimizer` for a job of several ranks: construct it on every rank, with the same
    arguments as `plexus.Optimizer` plus `process_group`; call `step()` and `zero_grad()` on every
    rank after each `backward()`.

    `dht` is needed on rank 0 only (the other ranks may pass None). `batch_size_per_step` (or
    `step(batch_size=)`) is one rank's batch: the swarm counts `world_size` times it per step,
    which assumes equal batches on every rank (as DDP's mean gradient does).
    `process_group`: the job's group (default: the whole world). `timeout`: the most seconds any
    rank waits for the others inside this optimizer (default: the longest step the leader may take,
    a state download and two rounds, `load_state_timeout + 2 * averaging_timeout`, plus 60 s).
    `reuse_grad_buffers`, `auxiliary` and `GradScaler` are not supported.
    """

    def __init__(
        self,
        *,
        dht: DHT | None = None,
        optimizer,
        params: Iterable | None = None,
        process_group=None,
        timeout: float | None = None,
        **options: Any,
    ):
        for name in UNSUPPORTED:
            if options.get(name):
                raise UsageError(f"DistributedOptimizer does not support {name}=True")
        if timeout is None:
            timeout = (
                options.get("load_state_timeout", 600.0) + 2 * options.get("averaging_timeout", 60.0) + 60
            )
        self.job = Job(process_group, timeout=timeout)
        self.batch_size_per_step = options.get("batch_size_per_step")
        params = _materialise(params)
        self.parameters = _parameters_of(params, optimizer)
        self.optimizer: Optimizer | None = None
        """The swarm's optimizer: on rank 0 only (None on the other ranks)."""
        self.local_epoch = 0
        """The leader's epoch as of the last step, on every rank."""
        self.state_loads = 0
        """How often the leader replaced the state with the swarm's, on every rank."""
        self._failed = False  # a collective failed or the leader aborted: no more collectives
        if self.job.is_leader:
            if dht is None:
                self._report(_ABORT, changed=False, phase="construction")
                raise UsageError("rank 0 talks to the swarm: pass dht=plexus.DHT(...) there")
            try:
                self.optimizer = Optimizer(dht=dht, optimizer=optimizer, params=params, **options)
            except BaseException:
                self._report(_ABORT, changed=False, phase="construction")
                raise
            self._report(_OK, changed=True, phase="construction")  # the job starts from rank 0's values
        else:
            self._follow("construction")

    # --- what every rank calls --------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        return self.job.is_leader

    def step(self, closure: Callable[[], Any] | None = None, batch_size: int | None = None, grad_scaler=None):
        """Rank 0 takes the swarm's step with the job's gradients; the others take its outcome."""
        if grad_scaler is not None:
            raise UsageError("DistributedOptimizer does not support a GradScaler")
        batch_size = self.batch_size_per_step if batch_size is None else batch_size
        if batch_size is None:
            raise UsageError("pass batch_size to step() or batch_size_per_step to the constructor")
        if not self.is_leader:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            self._follow("step")
            return loss
        return self._lead(
            "step", lambda: self._swarm_optimizer.step(closure, batch_size=batch_size * self.job.world_size)
        )

    def load_state_from_peers(self, **kwargs) -> None:
        """Rank 0 downloads the swarm's state and hands the parameters to the others (every rank
        calls this; the keyword arguments matter on rank 0)."""
        if self.is_leader:
            self._lead("load state", lambda: self._swarm_optimizer.load_state_from_peers(**kwargs))
        else:
            self._follow("load state")

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.is_leader:
            self._swarm_optimizer.zero_grad(set_to_none)
            return
        for param in self.parameters:
            if param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.detach_().zero_()

    def state_dict(self) -> dict:
        """The optimizer's state (with its epoch), which lives on rank 0: save checkpoints there."""
        if not self.is_leader:
            raise UsageError("rank 0 holds the optimizer state: call state_dict() on rank 0")
        return self._swarm_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict | None) -> None:
        """Every rank calls this; rank 0's `state_dict` is loaded (the others may pass None) and its
        epoch reaches every rank. Parameters are the model's: load them on every rank."""
        if self.is_leader:
            if state_dict is None:
                self._report(_ABORT, changed=False, phase="load state dict")
                raise UsageError("rank 0 needs the state dict to load")
            self._lead("load state dict", lambda: self._swarm_optimizer.load_state_dict(state_dict))
        else:
            self._follow("load state dict")

    def shutdown(self) -> None:
        """Leave the swarm; every rank calls this. Rank 0 finishes its background rounds, whose
        results reach the other ranks too. After a failure of the job it only leaves (no collective)."""
        if self._failed:
            if self.optimizer is not None:
                self.optimizer.shutdown()
            return
        if self.is_leader:
            self._lead("shutdown", self._swarm_optimizer.shutdown)
        else:
            self._follow("shutdown")

    def __enter__(self) -> "DistributedOptimizer":
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        if exc_type is not None:  # the other ranks may not be leaving with us: only leave the swarm
            self._failed = True
        self.shutdown()

    def __repr__(self) -> str:
        role = f"rank {self.job.rank} of {self.job.world_size}"
        return f"<plexus.distributed.DistributedOptimizer {role} epoch={self.local_epoch}>"

    # --- leader and followers ---------------------------------------------------------------------

    @property
    def _swarm_optimizer(self) -> Optimizer:
        """Rank 0's `plexus.Optimizer` (the other ranks have none)."""
        if self.optimizer is None:
            raise RuntimeError(f"rank {self.job.rank} has no swarm optimizer: only rank 0 drives one")
        return self.optimizer

    def _lead(self, phase: str, action: Callable[[], Any]):
        """Run `action` on the swarm's optimizer, then tell the followers what it changed."""
        before = self._parameters_version()
        try:
            result = action()
        except BaseException:
            self._report(_ABORT, changed=False, phase=phase)
            raise
        self.local_epoch, self.state_loads = (
            self._swarm_optimizer.local_epoch,
            self._swarm_optimizer.state_loads,
        )
        try:
            self._report(_OK, changed=self._parameters_version() != before, phase=phase)
        except RankFailed:
            if phase != "shutdown":  # (which has left already)
                logger.warning(f"A rank of this job failed during {phase}: leaving the swarm")
                self._swarm_optimizer.shutdown()
            raise
        return result

    def _report(self, status: int, changed: bool, phase: str) -> None:
        """The leader's side of a step: its outcome, then the parameters if they changed.

        An abort is best effort: the followers may be the ones that are gone."""
        fields = [status, PHASES.index(phase), self.local_epoch, self.state_loads, int(changed)]
        report = torch.tensor(fields, dtype=torch.int64, device=self.job.device)
        if status == _ABORT:
            self._failed = True
            try:
                self.job.broadcast([report], phase)
            except RankFailed as error:
                logger.warning(f"Could not tell the other ranks that rank 0 failed: {error}")
            return
        with self._failing():
            self.job.broadcast([report], phase)
            if changed:
                self.job.broadcast(self.parameters, phase)

    def _follow(self, phase: str) -> None:
        report = torch.zeros(_REPORT_FIELDS, dtype=torch.int64, device=self.job.device)
        with self._failing():
            self.job.broadcast([report], phase)
            status, leader_phase, epoch, state_loads, changed = report.tolist()
            if status != _OK:
                raise RankFailed(
                    f"rank 0 (the leader) failed during {phase}: see its log", rank=0, phase=phase
                )
            if PHASES[leader_phase] != phase:
                raise RankFailed(
                    f"rank 0 is in {PHASES[leader_phase]} while rank {self.job.rank} is in {phase}: "
                    "every rank must call the same methods in the same order",
                    rank=0,
                    phase=phase,
                )
            self.local_epoch, self.state_loads = epoch, state_loads
            if changed:
                self.job.broadcast(self.parameters, phase)

    @contextlib.contextmanager
    def _failing(self):
        """A collective that raises leaves the job unusable: remember it (shutdown() then only leaves)."""
        try:
            yield
        except RankFailed:
            self._failed = True
            raise

    def _parameters_version(self) -> int:
        """Grows whenever a parameter is written in place (torch's version counter): how the leader
        knows, without a copy, that a step changed the parameters and the followers need them."""
        return sum(param._version for param in self.parameters)


def _materialise(params: Iterable | None) -> list | None:
    """A list that both the leader's Optimizer and our parameter list can read (an iterator only once)."""
    if params is None:
        return None
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    if params and isinstance(params[0], dict):
        return [dict(group, params=_materialise(group["params"])) for group in params]
    return params


def _parameters_of(params: list | None, optimizer) -> list[torch.Tensor]:
    """The parameters in the order the swarm's optimizer holds them (its `main_parameters`)."""
    if params is None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise UsageError("pass params with an optimizer factory, or an optimizer instance")
        return list(optimizer_parameters(optimizer))
    if params and isinstance(params[0], dict):
        return [param for group in params for param in group["params"]]
    return list(params)
