"""One `LocalSwarm` peer: a spawned process that trains with `plexus.Optimizer` and reports to the harness.

The peer talks to the harness over its own pipe (one per process, so a peer killed in the middle of
a message can break only its own pipe, never a lock another peer needs). It reports `Ready` once its
DHT is up, a `Transition` at every change of its epoch (a global step, or a state download) with a
digest of its parameters, a `Heartbeat` every `HEARTBEAT_PERIOD` seconds, and `Finished` when it
leaves. It stops at the harness's word, when the harness goes away (the pipe closes), or after
`PeerSpec.max_lifetime` seconds, so it never outlives a crashed harness for long.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import re
import resource
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch

from .faults import Fault
from .tasks import RegressionTask, flat_parameters

LOCAL_MADDRS = ("/ip4/127.0.0.1/tcp/0",)
HEARTBEAT_PERIOD = 2.0
STOP = "stop"  # the harness's one message to a peer


@dataclass(frozen=True)
class PeerSpec:
    """Everything a peer process needs, sent to it when it is spawned."""

    index: int
    incarnation: int
    run_id: str
    task: RegressionTask
    optimizer_options: dict
    fault: Fault
    initial_peers: tuple[str, ...]
    report_parameters: bool = False
    log_level: str | None = None
    max_lifetime: float = 3600.0


@dataclass(frozen=True)
class Ready:
    index: int
    incarnation: int
    pid: int
    maddrs: tuple[str, ...]
    time: float


@dataclass(frozen=True)
class Transition:
    """The peer's epoch changed (`kind` "step" or "load"), or it started ("start")."""

    index: int
    incarnation: int
    time: float
    kind: str
    epoch: int
    digest: str
    state_loads: int
    rounds_averaged: int
    rounds_failed: int
    loss: float
    parameters: Any = None  # a float32 numpy vector with `report_parameters`


@dataclass(frozen=True)
class Heartbeat:
    index: int
    incarnation: int
    time: float
    epoch: int
    max_rss_kib: int


@dataclass(frozen=True)
class Silenced:
    index: int
    incarnation: int
    time: float


@dataclass(frozen=True)
class Finished:
    index: int
    incarnation: int
    time: float
    epoch: int
    state_loads: int
    rounds_averaged: int
    rounds_failed: int
    max_rss_kib: int
    children: tuple[int, ...]
    warnings: dict = field(default_factory=dict)
    error: str | None = None


class _WarningCounter(logging.Handler):
    """Counts the library's warnings and errors by message shape (numbers and ids masked)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.counts: collections.Counter = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        shape = re.sub(r"[0-9a-fA-F]{6,}|\d+(\.\d+)?", "#", record.getMessage())[:120]
        self.counts[f"{record.levelname} {shape}"] += 1


class PeerContext:
    """What a `Fault` sees of its peer."""

    def __init__(self, spec: PeerSpec, conn: Connection, dht, model: torch.nn.Module, optimizer):
        self.spec, self.index, self.incarnation = spec, spec.index, spec.incarnation
        self.dht, self.model, self.optimizer = dht, model, optimizer
        self._conn = conn
        self._started = time.monotonic()

    def elapsed(self) -> float:
        """Seconds since this peer started to train."""
        return time.monotonic() - self._started

    def report_silenced(self) -> None:
        """Tell the harness that this peer is about to stop answering on purpose."""
        self._conn.send(Silenced(self.index, self.incarnation, time.monotonic()))


def run_peer(spec: PeerSpec, conn: Connection) -> None:
    """The peer process's main function."""
    from ..dht.dht import DHT
    from ..optim.optimizer import Optimizer
    from ..utils.logging import use_plexus_log_handler

    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the harness decides when a peer stops
    if spec.log_level:
        use_plexus_log_handler(spec.log_level)
    counter = _WarningCounter()
    logging.getLogger("plexus").addHandler(counter)
    deadline = time.monotonic() + spec.max_lifetime
    task = spec.task
    try:
        dht = DHT(initial_peers=list(spec.initial_peers) or None, host_maddrs=LOCAL_MADDRS, start=True)
        conn.send(
            Ready(
                spec.index,
                spec.incarnation,
                os.getpid(),
                tuple(str(a) for a in dht.get_visible_maddrs()),
                time.monotonic(),
            )
        )
        model = task.make_model()
        opt = Optimizer(
            dht=dht,
            run_id=spec.run_id,
            params=model.parameters(),
            optimizer=task.make_optimizer(),
            batch_size_per_step=task.batch_size,
            **spec.optimizer_options,
        )
    except Exception:
        if conn.poll():  # told to stop while starting (its bootstrap peers may be gone): not a crash
            return
        raise
    peer = PeerContext(spec, conn, dht, model, opt)
    error = None
    try:
        spec.fault.install(peer)
        _report(conn, spec, opt, model, "start", float("nan"))
        next_heartbeat = time.monotonic() + HEARTBEAT_PERIOD
        for batch in task.batches(spec.index, spec.incarnation):
            if conn.poll() or time.monotonic() >= deadline:
                break  # the harness said stop, or went away (the pipe reads EOF)
            loss = task.loss(model, batch)
            loss.backward()
            spec.fault.before_step(peer)
            epoch, loads = opt.local_epoch, opt.state_loads
            opt.step()
            if not opt.reuse_grad_buffers:
                opt.zero_grad()
            spec.fault.after_step(peer)
            if task.step_delay:
                time.sleep(task.step_delay)  # stands for compute time, not synchronisation
            if opt.local_epoch != epoch or opt.state_loads != loads:
                _report(conn, spec, opt, model, "load" if opt.state_loads != loads else "step", loss.item())
            if time.monotonic() >= next_heartbeat:
                conn.send(
                    Heartbeat(spec.index, spec.incarnation, time.monotonic(), opt.local_epoch, _max_rss())
                )
                next_heartbeat = time.monotonic() + HEARTBEAT_PERIOD
    except (BrokenPipeError, EOFError):
        return  # the harness is gone: nobody to report to
    except Exception as error_:  # reported to the harness, which counts it as a crash
        error = repr(error_)
        logging.getLogger(__name__).exception("the peer's training loop failed")
    finally:
        opt.shutdown()
        dht.shutdown()
    children = tuple(_children(os.getpid()))
    try:
        conn.send(
            Finished(
                spec.index,
                spec.incarnation,
                time.monotonic(),
                opt.local_epoch,
                opt.state_loads,
                opt.rounds_averaged,
                opt.rounds_failed,
                _max_rss(),
                children,
                dict(counter.counts),
                error,
            )
        )
    except (BrokenPipeError, EOFError):
        pass  # the harness is gone


def _report(conn: Connection, spec: PeerSpec, opt, model: torch.nn.Module, kind: str, loss: float) -> None:
    flat = flat_parameters(model)
    conn.send(
        Transition(
            spec.index,
            spec.incarnation,
            time.monotonic(),
            kind,
            opt.local_epoch,
            hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16],
            opt.state_loads,
            opt.rounds_averaged,
            opt.rounds_failed,
            loss,
            flat.numpy() if spec.report_parameters else None,
        )
    )


def _max_rss() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # KiB on Linux


def _children(pid: int) -> list[int]:
    """Live child processes of `pid` (Linux /proc; empty elsewhere). A peer should have none."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as file:
            return [int(child) for child in file.read().split()]
    except OSError:
        return []
