"""Average a model's parameters with peers every few seconds, in a background thread.

The simplest way to train together: every peer runs its own optimizer, and a thread averages the
parameters with whoever is around every `averaging_period` seconds. Rounds start on multiples of
the period in DHT time, so peers that share a period look for a group at the same moment.

A round copies the parameters into the averager's float32 buffers under `lock` (share it with the
training loop: hold it around `optimizer.step()`), averages them with no lock held, and folds the
result back under `lock` with the delta rule, ``param += averaged - copied``, so optimizer steps
the loop made during the round are kept. A round that finds no group leaves the parameters alone.

    averager = PeriodicAverager(model, dht, prefix="my_run_params", averaging_period=10)
    for batch in data:
        loss = model(batch).mean()
        loss.backward()
        with averager.lock:
            opt.step()
        opt.zero_grad()
    averager.stop()
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch

from ..dht.dht import DHT
from ..utils.logging import get_logger
from ..utils.timing import get_dht_time
from .averager import AveragingError, DecentralizedAverager
from .control import StepControl

logger = get_logger(__name__)


class PeriodicAverager:
    """Averages `parameters` (a module or tensors) with peers under `prefix` every `averaging_period` s.

    Args:
        lock: the lock the training loop holds while it changes the parameters (default: a new
            `threading.Lock`, available as `.lock`).
        wait_for_updates: average only after `notify_update()` was called since the last round
            (a peer that stopped training stops averaging).
        step_timeout: the longest one round may take (default: the averaging period, at least 5 s).
        verbose: log each round at INFO (else DEBUG).
        start: start the thread now; otherwise call `start()`.
        **averager_kwargs: for DecentralizedAverager (`target_group_size`, `min_matchmaking_time`,
            `compression`, ...); `min_matchmaking_time` should be well below the period.
    """

    def __init__(
        self,
        parameters: torch.nn.Module | Iterable[torch.Tensor],
        dht: DHT,
        *,
        prefix: str,
        averaging_period: float,
        lock: Any = None,
        wait_for_updates: bool = False,
        step_timeout: float | None = None,
        verbose: bool = True,
        start: bool = True,
        **averager_kwargs,
    ):
        if not averaging_period > 0:
            raise ValueError(f"averaging_period must be positive, got {averaging_period}")
        if isinstance(parameters, torch.nn.Module):
            parameters = parameters.parameters()
        self.parameters = [param for param in parameters]
        self.averaging_period = float(averaging_period)
        self.step_timeout = step_timeout if step_timeout is not None else max(5.0, averaging_period)
        self.lock = lock if lock is not None else threading.Lock()
        self.wait_for_updates, self.verbose = wait_for_updates, verbose
        with torch.no_grad():
            buffers = [param.detach().to("cpu", torch.float32, copy=True) for param in self.parameters]
        self.averager = DecentralizedAverager(buffers, dht, prefix=prefix, start=True, **averager_kwargs)
        self.rounds_succeeded = self.rounds_failed = 0
        self.last_group_size: int | None = None
        self._finished = threading.Condition()
        self._stop, self._updated = threading.Event(), threading.Event()
        self._control: StepControl | None = None
        self._thread = threading.Thread(target=self._run, name=f"averaging-{prefix}", daemon=True)
        if start:
            self.start()

    def start(self) -> None:
        self._thread.start()

    def notify_update(self) -> None:
        """Tell the thread the parameters changed (used with `wait_for_updates=True`)."""
        self._updated.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread (a round in matchmaking is cancelled) and shut the averager down."""
        self._stop.set()
        self._updated.set()
        control = self._control
        if control is not None and not control.began_allreduce:
            control.cancel()
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning(f"the averaging thread did not stop within {timeout} s")
        self.averager.shutdown()

    shutdown = stop

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def wait_for_rounds(self, count: int, timeout: float) -> bool:
        """Block until `count` rounds ended (succeeded or failed) in total; False on timeout."""
        with self._finished:
            return self._finished.wait_for(
                lambda: self.rounds_succeeded + self.rounds_failed >= count, timeout
            )

    def __enter__(self) -> PeriodicAverager:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    # --- the thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.wait_for_updates:
                self._updated.wait()
                self._updated.clear()
                if self._stop.is_set():
                    break
            # DHT time, not the local clock: peers' rounds begin at the same moments
            delay = self.averaging_period - get_dht_time() % self.averaging_period
            if self._stop.wait(delay):
                break
            self._average_once()

    @torch.no_grad()
    def _average_once(self) -> None:
        level = logging.INFO if self.verbose else logging.DEBUG
        with self.lock, self.averager.get_tensors() as buffers:
            for buffer, param in zip(buffers, self.parameters):
                buffer.copy_(param)
            copied = [buffer.clone() for buffer in buffers]
        logger.log(level, "Starting a new averaging round with current parameters.")
        started = time.monotonic()
        try:
            self._control = self.averager.step(timeout=self.step_timeout, wait=False)
            gathered = self._control.result()
        except AveragingError as error:
            logger.warning(f"Averaging round failed: could not find a group ({error})")
            self._count(None)
            return
        except Exception as error:  # a cancelled round on stop(), or a broken one: the loop goes on
            if not self._stop.is_set():
                logger.error(f"Averaging round failed: {error!r}")
            self._count(None)
            return
        finally:
            self._control = None
        with self.lock, self.averager.get_tensors() as buffers:
            for param, buffer, old in zip(self.parameters, buffers, copied):
                param.add_(buffer.sub(old).to(param.device, param.dtype))
        logger.log(
            level,
            f"Finished averaging round in {time.monotonic() - started:.2f} s with {len(gathered)} peers.",
        )
        self._count(len(gathered))

    def _count(self, group_size: int | None) -> None:
        with self._finished:
            if group_size is None:
                self.rounds_failed += 1
            else:
                self.rounds_succeeded += 1
                self.last_group_size = group_size
            self._finished.notify_all()
