"""Faulty swarm members for `LocalSwarm`: what a peer does wrong, as small picklable dataclasses.

A fault runs inside the peer's own process, at three hooks of its training loop: `install` once
the Optimizer is built, `before_step` between `backward()` and `Optimizer.step()` (where the
gradients can be spoiled), and `after_step`. Each fault starts `after` seconds into the peer's
training, so a swarm can first settle. A new kind is a subclass defined in an importable module
(peer processes are spawned, so they unpickle it by name), e.g.::

    @dataclass(frozen=True)
    class ZeroGradients(Fault):
        def before_step(self, peer):
            if self.active(peer):
                for param in peer.model.parameters():
                    param.grad.zero_()

Kinds that ship here: `NaNGradients`, `ScaledGradients`, `Silent` (joins, then never answers),
`Slow` and `ForgedProgress`. Whether the swarm survives a fault is for the averagers and the
progress tracker to ensure; the harness only injects it and reports what happened.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .swarm_peer import PeerContext


@dataclass(frozen=True)
class Fault:
    """Base of the fault kinds: no misbehaviour at all (an honest peer).

    Args:
        after: seconds into the peer's training before it starts to misbehave.
    """

    after: float = 0.0
    honest = True
    """Whether the peer's parameters should agree with the others' (reports compare only those)."""

    @property
    def name(self) -> str:
        return type(self).__name__

    def active(self, peer: PeerContext) -> bool:
        return peer.elapsed() >= self.after

    def install(self, peer: PeerContext) -> None:
        """Called once, after the peer's Optimizer is built and before it trains."""

    def before_step(self, peer: PeerContext) -> None:
        """Called after each `backward()`, before `Optimizer.step()`."""

    def after_step(self, peer: PeerContext) -> None:
        """Called after each `Optimizer.step()` (and `zero_grad()`)."""


@dataclass(frozen=True)
class NaNGradients(Fault):
    """Every gradient this peer contributes is NaN."""

    honest = False

    def before_step(self, peer: PeerContext) -> None:
        if self.active(peer):
            with torch.no_grad():
                for param in peer.model.parameters():
                    if param.grad is not None:
                        param.grad.fill_(float("nan"))


@dataclass(frozen=True)
class ScaledGradients(Fault):
    """This peer's gradients are multiplied by `factor` (a large one stands for a poisoner)."""

    honest = False

    factor: float = 1000.0

    def before_step(self, peer: PeerContext) -> None:
        if self.active(peer):
            with torch.no_grad():
                for param in peer.model.parameters():
                    if param.grad is not None:
                        param.grad.mul_(self.factor)


@dataclass(frozen=True)
class Silent(Fault):
    """Joins and trains, then from `after` seconds on never answers again: the process stops itself
    (SIGSTOP), so its connections stay open but nothing is read or sent, as with a frozen machine
    or a network that drops everything. The harness kills it when the swarm closes."""

    after: float = 10.0
    honest = False

    def after_step(self, peer: PeerContext) -> None:
        if self.active(peer):
            peer.report_silenced()
            os.kill(os.getpid(), signal.SIGSTOP)


@dataclass(frozen=True)
class Slow(Fault):
    """Each batch takes `delay` seconds more (a much slower machine); it still trains honestly."""

    delay: float = 0.5

    def after_step(self, peer: PeerContext) -> None:
        if self.active(peer):
            time.sleep(self.delay)  # stands for compute time, not synchronisation


@dataclass(frozen=True)
class ForgedProgress(Fault):
    """After each step, this peer publishes a signed progress record with made-up numbers: an epoch
    `epoch_ahead` beyond its own and `samples` accumulated (a liar about how far the swarm is)."""

    epoch_ahead: int = 1000
    samples: int = 10**9
    honest = False

    def after_step(self, peer: PeerContext) -> None:
        if self.active(peer):
            peer.optimizer.tracker.report_local_progress(
                peer.optimizer.local_epoch + self.epoch_ahead, self.samples, update_global_samples=False
            )


FAULT_KINDS: dict[str, type[Fault]] = {
    "nan": NaNGradients,
    "scaled": ScaledGradients,
    "silent": Silent,
    "slow": Slow,
    "forged": ForgedProgress,
}
"""The shipped kinds by the names the command line uses (`--fault 2:silent:after=20`)."""
