"""A running estimate of samples per second, debiased like Adam's moments, that can be paused.

Peers publish this figure so the swarm can predict when the next global epoch is due. Time spent
averaging or loading state is not training time, so `pause()` stops the clock for that span.
"""

import contextlib
import time


class PerformanceEMA:
    def __init__(self, alpha: float = 0.1, eps: float = 1e-20, clock=time.monotonic):
        self.alpha, self.eps, self.clock = alpha, eps, clock
        self.ema_seconds_per_sample = 0.0
        self.samples_per_second = eps
        self.num_updates = 0
        self.timestamp = clock()
        self.paused = False

    def update(self, task_size: float) -> float:
        """Count `task_size` samples processed since the last update (or reset); return samples/s."""
        if self.paused:
            raise RuntimeError("PerformanceEMA.update() was called while paused")
        if task_size <= 0:
            raise ValueError(f"task_size must be positive, got {task_size}")
        self.timestamp, previous = self.clock(), self.timestamp
        seconds_per_sample = max(0.0, self.timestamp - previous) / task_size
        self.ema_seconds_per_sample = self.alpha * seconds_per_sample + (1 - self.alpha) * self.ema_seconds_per_sample
        self.num_updates += 1
        debiased = self.ema_seconds_per_sample / (1 - (1 - self.alpha) ** self.num_updates)
        self.samples_per_second = 1 / max(debiased, self.eps)
        return self.samples_per_second

    def reset_timer(self) -> None:
        """Start the next measured interval now (e.g. after a pause outside `pause()`)."""
        self.timestamp = self.clock()

    @contextlib.contextmanager
    def pause(self):
        """Inside this block, elapsed time does not count towards the estimate."""
        self.paused, was_paused = True, self.paused
        try:
            yield
        finally:
            self.timestamp = self.clock()
            self.paused = was_paused

    def __repr__(self) -> str:
        return f"PerformanceEMA(samples_per_second={self.samples_per_second:.2f}, updates={self.num_updates})"
