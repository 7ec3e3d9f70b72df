"""What the peers of a `LocalSwarm` train: a small model that is cheap on a CPU, from a fixed start.

A task is a picklable description (peer processes are spawned and rebuild everything from it). It
makes the model (the same initial parameters on every peer, so their parameters can be compared
bit for bit), the optimizer factory, each peer's batches and the loss. `RegressionTask` is the one
that ships; another task needs the same five methods.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RegressionTask:
    """An MLP `features -> hidden -> 1` fitting a smooth function of random inputs.

    Args:
        features, hidden: the model's sizes (the defaults make ~600 parameters).
        samples: size of the data set (the same on every peer unless `peer_targets`).
        batch_size: samples per `Optimizer.step()`, as reported to the swarm.
        identical_batches: every micro-batch is the whole data set, so each peer's mean gradient
            depends only on the parameters: any averaging of the peers' gradients gives the same
            result, and the swarm must follow one process's full-batch steps exactly
            (`reference_parameters`).
        peer_targets: each peer fits a different target function (the same inputs), so peers that
            never average drift apart; peer i's targets are shifted by `i * target_spread`.
        target_spread: see `peer_targets`.
        optimizer, lr: a `torch.optim` class name and its learning rate.
        step_delay: seconds of stand-in compute per batch (paces the loop; nothing waits on it).
        seed: seed of the data set; each peer draws its batches from its own generator.
    """

    features: int = 16
    hidden: int = 32
    samples: int = 256
    batch_size: int = 16
    identical_batches: bool = False
    peer_targets: bool = False
    target_spread: float = 1.0
    optimizer: str = "Adam"
    lr: float = 0.01
    step_delay: float = 0.05
    seed: int = 1234

    def dataset(self, index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed)
        inputs = torch.randn(self.samples, self.features, generator=generator)
        targets = torch.sin(inputs @ torch.randn(self.features, 1, generator=generator))
        if self.peer_targets:
            targets = targets + index * self.target_spread
        return inputs, targets

    def make_model(self) -> torch.nn.Module:
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(0)  # every peer and every reference start from the same parameters
        model = torch.nn.Sequential(
            torch.nn.Linear(self.features, self.hidden), torch.nn.Tanh(), torch.nn.Linear(self.hidden, 1)
        )
        torch.random.set_rng_state(generator_state)
        return model

    def make_optimizer(self):
        """A factory for `plexus.Optimizer(optimizer=...)`."""
        return functools.partial(getattr(torch.optim, self.optimizer), lr=self.lr)

    def batches(self, index: int, stream: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Peer `index`'s endless batches; `stream` tells its incarnations apart."""
        inputs, targets = self.dataset(index)
        if self.identical_batches:
            while True:
                yield inputs, targets
        generator = torch.Generator().manual_seed(self.seed + 1000 * index + stream)
        while True:
            rows = torch.randint(0, self.samples, (self.batch_size,), generator=generator)
            yield inputs[rows], targets[rows]

    def loss(self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        return ((model(inputs) - targets) ** 2).mean()

    def reference_parameters(self, epochs: int, index: int = 0) -> list[torch.Tensor]:
        """One process, one full-batch optimizer step per epoch: the flat parameters after 0..`epochs`
        steps. A swarm on `identical_batches` must hold `result[e]` at every epoch e."""
        model = self.make_model()
        opt = self.make_optimizer()(model.parameters())
        batch = self.dataset(index)
        states = [flat_parameters(model)]
        for _ in range(epochs):
            opt.zero_grad()
            self.loss(model, batch).backward()
            opt.step()
            states.append(flat_parameters(model))
        return states


def flat_parameters(model: torch.nn.Module) -> torch.Tensor:
    """All parameters as one float32 vector (a copy)."""
    with torch.no_grad():
        return torch.cat([param.detach().reshape(-1).to(torch.float32) for param in model.parameters()])
