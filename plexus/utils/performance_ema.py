"""A running estimate of samples per second, debiased like Adam's moments, that can be paused.

Peers publish this figure so the swarm can predict when the next global epoch is due. Time spent
averaging or loading state is not training time, so `pause()` stops the clock for that span.
Several threads that process batches at once measure with `update_threadsafe()`: each counts the
time since it started or since the last update, whichever is later, so overlapping work is not
counted twice.
"""

import contextlib
import threading
import time


class PerformanceEMA:
    """Samples per second, smoothed with factor `alpha`; `paused=True` starts with the clock stopped."""

    def __init__(self, alpha: float = 0.1, eps: float = 1e-20, paused: bool = False, clock=time.monotonic):
        self.alpha, self.eps, self.clock = alpha, eps, clock
        self.ema_seconds_per_sample = 0.0
        self.samples_per_second = eps
        self.num_updates = 0
        self.timestamp = clock()
        self.paused = paused
        self.lock = threading.Lock()

    def update(self, task_size: float, interval: float | None = None) -> float:
        """Count `task_size` samples processed in `interval` seconds (default: since the last update
        or reset; required while paused); return samples/s."""
        if task_size <= 0:
            raise ValueError(f"task_size must be positive, got {task_size}")
        if self.paused:
            if interval is None:
                raise RuntimeError("PerformanceEMA.update() was called while paused without an interval")
        else:
            self.timestamp, previous = self.clock(), self.timestamp
            interval = max(0.0, self.timestamp - previous) if interval is None else interval
        previous_ema = (1 - self.alpha) * self.ema_seconds_per_sample
        self.ema_seconds_per_sample = self.alpha * interval / task_size + previous_ema
        self.num_updates += 1
        debiased = self.ema_seconds_per_sample / (1 - (1 - self.alpha) ** self.num_updates)
        self.samples_per_second = 1 / max(debiased, self.eps)
        return self.samples_per_second

    @contextlib.contextmanager
    def update_threadsafe(self, task_size: float):
        """Count `task_size` samples for the work done inside this block; safe from many threads."""
        started = self.clock()
        yield
        with self.lock:
            self.update(task_size, interval=max(0.0, self.clock() - max(started, self.timestamp)))

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
