"""The glue between Hugging Face's Trainer and plexus.Optimizer.

HF Trainer calls `optimizer.step()` after every `gradient_accumulation_steps` micro-batches and
`lr_scheduler.step()` right after. With plexus.Optimizer a local step only accumulates; the
learning rate must follow the swarm's epochs instead, so the real scheduler lives inside the
optimizer and Trainer gets a `NoOpScheduler` that only reports the current rate.

`SwarmCallback` does what Trainer cannot know about:
- at the start, downloads the swarm's state (a newcomer joins at the current epoch);
- after each step, checks the parameters: non-finite values (a diverged round, a bad peer) are
  replaced by reloading the state from peers; if that does not help, it stops with an error;
- at each new global epoch, logs this peer's contribution and publishes its loss, samples and
  speed for the training monitor (see metrics.py).
"""

import logging
import math

import torch
from transformers import TrainerCallback

from plexus.utils.timing import get_dht_time

from .metrics import HISTORY, LocalMetrics, StepMetrics, metrics_key

logger = logging.getLogger("plexus.albert")


class NoOpScheduler:
    """What HF Trainer sees as its scheduler: steps nothing, reports the wrapped optimizer's rate."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self) -> None:
        pass  # plexus.Optimizer steps the real scheduler once per global epoch

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {}  # the real schedule follows the epoch, which the optimizer's own state holds

    def load_state_dict(self, state_dict: dict) -> None:
        pass


class LossMeter:
    """Sums the MLM loss of micro-batches between global epochs (fed by the Trainer's compute_loss)."""

    def __init__(self):
        self.total, self.count = 0.0, 0

    def add(self, loss: float) -> None:
        if math.isfinite(loss):
            self.total, self.count = self.total + loss, self.count + 1

    def take(self) -> tuple[float, int]:
        mean, count = (self.total / self.count if self.count else math.nan), self.count
        self.total, self.count = 0.0, 0
        return mean, count


class SwarmCallback(TrainerCallback):
    """Per-step bookkeeping for the swarm."""

    def __init__(
        self,
        *,
        dht,
        optimizer,
        model: torch.nn.Module,
        run_id: str,
        subkey: bytes,
        client_mode: bool,
        batch_size_per_step: int,
        losses: LossMeter,
        statistics_expiration: float = 600.0,
    ):
        self.dht, self.optimizer, self.model, self.run_id = dht, optimizer, model, run_id
        self.subkey, self.client_mode, self.batch_size_per_step = subkey, client_mode, batch_size_per_step
        self.losses, self.statistics_expiration = losses, statistics_expiration
        self.last_epoch = optimizer.local_epoch
        self.samples = 0
        self.history: list[StepMetrics] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.optimizer.load_state_from_peers()
        self.last_epoch = self.optimizer.local_epoch
        logger.info(f"Starting at global epoch {self.last_epoch}")

    def on_step_end(self, args, state, control, **kwargs):
        if not self.parameters_are_finite():
            self.recover()
            return
        self.samples += self.batch_size_per_step
        epoch = self.optimizer.local_epoch
        if epoch == self.last_epoch:
            return
        loss, mini_steps = self.losses.take()
        if (
            epoch == self.last_epoch + 1 and mini_steps
        ):  # we took part in this step (not caught up by loading)
            self.publish(epoch, loss, mini_steps)
        self.last_epoch, self.samples = epoch, 0

    def parameters_are_finite(self) -> bool:
        return all(torch.isfinite(param).all() for param in self.model.parameters())

    def recover(self) -> None:
        logger.warning("Parameters became non-finite; reloading the state from peers")
        self.optimizer.load_state_from_peers()
        if not self.parameters_are_finite():
            raise SystemExit(
                "error: the parameters are non-finite and no peer offered a finite state; "
                "lower --learning_rate and restart (from a checkpoint with --output_dir)"
            )
        self.losses.take()
        self.last_epoch, self.samples = self.optimizer.local_epoch, 0

    def publish(self, epoch: int, loss: float, mini_steps: int) -> None:
        speed = float(self.optimizer.tracker.performance_ema.samples_per_second)
        # plexus.Optimizer logs "Step #N", the contribution and the speed; it cannot see Trainer's loss
        logger.info(f"Local loss: {loss:.5f} (MLM, {mini_steps} micro-batches)")
        entry = StepMetrics(
            step=epoch,
            loss=loss,
            mini_steps=mini_steps,
            samples_accumulated=self.samples,
            samples_per_second=speed if math.isfinite(speed) else 0.0,
            time=get_dht_time(),
        )
        self.history = [*self.history, entry][-HISTORY:]
        record = LocalMetrics(
            peer_id=str(self.dht.peer_id), client_mode=self.client_mode, history=self.history
        )
        # not waited for: a slow DHT must not hold up training (the next epoch's record carries this one too)
        self.dht.store(
            metrics_key(self.run_id),
            record.model_dump(),
            expiration_time=get_dht_time() + self.statistics_expiration,
            subkey=self.subkey,
            return_future=True,
        )
