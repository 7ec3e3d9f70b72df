"""The decentralized parameter-averaging optimizers of early hivemind: `DecentralizedOptimizer`,
`DecentralizedSGD`, `DecentralizedAdam`.

Each peer steps its own optimizer; a background thread averages its parameters (and optionally
gradients and optimizer statistics) with whoever is around, through a `TrainingAverager`. Every
`averaging_steps_period` local steps the thread is woken for one round; with
`averaging_time_period` it first waits for the next multiple of that period in DHT time, so peers
look for a group at the same moment. The training loop and the thread share `lock_parameters`:
`step()` holds it around the optimizer step, the averager around its two copies, never across a
round. A round that finds no group leaves the parameters alone.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence

import torch

from ..averaging.averager import AveragingError
from ..dht.dht import DHT
from ..optim.training_averager import TrainingAverager
from ..utils.logging import get_logger
from ..utils.timing import get_dht_time

logger = get_logger(__name__)


class DecentralizedOptimizer(torch.optim.Optimizer):
    """Wraps `opt`; averages with peers under `prefix` in the background (see the module docstring).

    Args:
        opt: the local optimizer, stepped by `step()`.
        average_parameters / average_gradients / average_opt_statistics: what a round averages.
        averaging_steps_period: local steps between rounds.
        averaging_time_period: if positive, rounds start on multiples of this many seconds of DHT time.
        timeout: the longest one round may take.
        **kwargs: for the TrainingAverager (`min_matchmaking_time`, `compression`, ...).
    """

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        dht: DHT,
        *,
        prefix: str,
        target_group_size: int,
        average_parameters: bool,
        average_gradients: bool,
        average_opt_statistics: Sequence[str] = (),
        averaging_steps_period: int = 1,
        averaging_time_period: float = 0,
        timeout: float | None = None,
        verbose: bool = False,
        **kwargs,
    ):
        if averaging_steps_period < 1 or averaging_time_period < 0:
            raise ValueError("averaging_steps_period must be >= 1 and averaging_time_period >= 0")
        self.opt, self.dht, self.local_step = opt, dht, 0
        self.averaging_steps_period = averaging_steps_period
        self.averaging_time_period = averaging_time_period
        self.timeout, self.verbose = timeout, verbose
        self.averager = TrainingAverager(
            opt,
            average_parameters=average_parameters,
            average_gradients=average_gradients,
            average_opt_statistics=average_opt_statistics,
            dht=dht,
            start=True,
            prefix=prefix,
            target_group_size=target_group_size,
            **kwargs,
        )
        self.lock_parameters = threading.Lock()
        self.update_event, self.stop_event = threading.Event(), threading.Event()
        self.rounds_succeeded = self.rounds_failed = 0
        self._thread = threading.Thread(
            target=self._average_in_background, name=f"{prefix}-averaging", daemon=True
        )
        self._thread.start()

    # torch.optim.Optimizer's face: the wrapped optimizer's groups and state
    @property
    def param_groups(self):
        return self.opt.param_groups

    @param_groups.setter
    def param_groups(self, value) -> None:
        self.opt.param_groups = value

    @property
    def state(self):
        return self.opt.state

    @state.setter
    def state(self, value) -> None:
        self.opt.state = value

    def state_dict(self) -> dict:
        return self.opt.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.opt.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = False) -> None:
        # averaged gradients need their buffers, so they are zeroed rather than dropped by default
        self.opt.zero_grad(set_to_none=set_to_none)

    def step(self, *args, **kwargs):
        with self.lock_parameters:
            loss = self.opt.step(*args, **kwargs)
        self.local_step += 1
        if self.local_step % self.averaging_steps_period == 0:
            self.update_event.set()
        return loss

    def _average_in_background(self) -> None:
        while not self.stop_event.is_set():
            self.update_event.wait()
            self.update_event.clear()
            if self.averaging_time_period and self.stop_event.wait(
                self.averaging_time_period - get_dht_time() % self.averaging_time_period
            ):
                break  # waited for the next period boundary (a stop cuts the wait short)
            if self.stop_event.is_set():
                break
            try:
                gathered = self.averager.step(self.lock_parameters, timeout=self.timeout)
                self.rounds_succeeded += 1
                if self.verbose:
                    logger.info(f"Averaged parameters with {len(gathered)} peers")
            except AveragingError as error:  # no group this time: the next round may find one
                self.rounds_failed += 1
                level = logging.INFO if self.verbose else logging.DEBUG
                logger.log(level, f"Averaging round failed: {error}")
            except Exception as error:  # the thread goes on: training must not stop over one round
                self.rounds_failed += 1
                logger.warning(f"Averaging round failed unexpectedly: {error!r}", exc_info=True)

    def shutdown(self) -> None:
        self.stop_event.set()
        self.update_event.set()
        self._thread.join(self.averager.shutdown_timeout + 5)
        self.averager.shutdown()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} step={self.local_step} wrapping {type(self.opt).__name__}>"


class DecentralizedSGD(DecentralizedOptimizer):
    """SGD whose parameters are averaged with peers (see DecentralizedOptimizer)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float,
        *,
        dht: DHT,
        prefix: str,
        target_group_size: int,
        momentum: float = 0,
        dampening: float = 0,
        weight_decay: float = 0,
        nesterov: bool = False,
        **kwargs,
    ):
        opt = torch.optim.SGD(
            params, lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov
        )
        super().__init__(
            opt,
            dht,
            prefix=prefix,
            target_group_size=target_group_size,
            average_parameters=True,
            average_gradients=False,
            **kwargs,
        )


class DecentralizedAdam(DecentralizedOptimizer):
    """Adam whose parameters and second moments are averaged with peers (see DecentralizedOptimizer)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float,
        *,
        dht: DHT,
        prefix: str,
        target_group_size: int,
        averaging_steps_period: int = 1,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        **kwargs,
    ):
        opt = torch.optim.Adam(params, lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
        statistics = ("max_exp_avg_sq",) if amsgrad else ("exp_avg_sq",)
        super().__init__(
            opt,
            dht,
            prefix=prefix,
            target_group_size=target_group_size,
            average_parameters=True,
            average_gradients=False,
            average_opt_statistics=statistics,
            averaging_steps_period=averaging_steps_period,
            **kwargs,
        )


__all__ = ["DecentralizedAdam", "DecentralizedOptimizer", "DecentralizedSGD"]
