"""The batching runtime: per-backend task pools and one compute thread, oldest work first.

Theory of operation
-------------------
Requests arrive on the event loop. `TaskPool.submit_task(*tensors)` appends a `Task` (its batch
of batch-first tensors, its size, an asyncio future and its arrival time) to the pool's queue and
wakes the compute thread; it takes a lock for a few list operations and never waits for compute,
so the loop is never blocked.

The `Runtime` owns one daemon thread that runs every module (one thread: a module is never run by
two threads at once, and the optimizer step of a backward never races a forward). Its loop:

1. Drop tasks whose future was cancelled (the caller gave up) from the head of each queue.
2. A pool is *ready* when its waiting rows reach `min_batch_size`, or when its oldest task has
   waited `timeout` seconds (so a lone request is not stranded below the minimum).
3. Of the ready pools, take the one whose oldest task arrived first; with none ready, sleep until
   the next such deadline or a new submission.
4. Form a batch from that pool's queue in arrival order, up to `max_batch_size` rows, stopping at
   the first task whose non-batch shapes differ (it starts the next batch). Concatenate, run the
   pool's function, split the outputs by task sizes, and hand each result (or the exception) back
   to its loop with `call_soon_threadsafe`.

A single task larger than `max_batch_size` is refused at submission, and each pool holds at most
`max_pending_tasks` tasks (the server answers "overloaded" past that). Jobs given to
`Runtime.submit_job` (checkpoints) run on the same thread between batches, so they see modules at
rest. What is left out: hivemind's prefetching of batches in a second process and stats reports;
one thread, no copies into shared memory.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import torch

from ...utils.logging import get_logger

logger = get_logger(__name__)

DEFAULT_MAX_PENDING_TASKS = 4096


class TaskRejected(ValueError):
    """The request cannot be queued: too large a batch, or the pool is full or closed."""


class Task:
    __slots__ = ("inputs", "size", "future", "loop", "arrived")

    def __init__(self, inputs: Sequence[torch.Tensor], size: int, future: asyncio.Future, arrived: float):
        self.inputs, self.size, self.future, self.arrived = inputs, size, future, arrived
        self.loop = future.get_loop()

    def signature(self) -> tuple:
        return tuple((tuple(t.shape[1:]), t.dtype) for t in self.inputs)


class TaskPool:
    """A queue of requests for one function (a backend's forward or backward), batched on demand.

    `process_func(*batched_inputs)` returns a tuple of batch-first tensors.
    """

    def __init__(self, process_func: Callable[..., Sequence[torch.Tensor]], *, name: str, max_batch_size: int,
                 min_batch_size: int = 1, timeout: float = 1.0, max_pending_tasks: int = DEFAULT_MAX_PENDING_TASKS,
                 clock: Callable[[], float] = time.monotonic):
        if not 1 <= min_batch_size <= max_batch_size:
            raise ValueError(f"need 1 <= min_batch_size ({min_batch_size}) <= max_batch_size ({max_batch_size})")
        self.process_func, self.name = process_func, name
        self.min_batch_size, self.max_batch_size, self.timeout = min_batch_size, max_batch_size, timeout
        self.max_pending_tasks = max_pending_tasks
        self.clock = clock
        self._tasks: deque[Task] = deque()
        self._lock = threading.Lock()
        self._wakeup = threading.Event()  # replaced by the runtime's own when attached
        self._closed_reason: str | None = None

    def submit_task(self, *inputs: torch.Tensor) -> asyncio.Future:
        """Queue one request (batch-first tensors with a common batch size); await the future for its
        outputs. Must be called from a running event loop. Raises TaskRejected."""
        if not inputs:
            raise TaskRejected(f"{self.name}: a request needs at least one tensor")
        size = inputs[0].shape[0] if inputs[0].dim() else 0
        if size < 1 or any(t.dim() == 0 or t.shape[0] != size for t in inputs):
            raise TaskRejected(f"{self.name}: every tensor must share one batch size >= 1, got "
                               f"{[tuple(t.shape) for t in inputs]}")
        if size > self.max_batch_size:
            raise TaskRejected(f"{self.name}: a batch of {size} rows exceeds max_batch_size={self.max_batch_size}; "
                               f"split it into smaller requests")
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            if self._closed_reason is not None:
                raise TaskRejected(f"{self.name}: {self._closed_reason}")
            if len(self._tasks) >= self.max_pending_tasks:
                raise TaskRejected(f"{self.name} is overloaded ({len(self._tasks)} requests waiting); retry later "
                                   f"or use another expert")
            self._tasks.append(Task(inputs, size, future, self.clock()))
        self._wakeup.set()
        return future

    @property
    def num_pending(self) -> int:
        return len(self._tasks)

    def _oldest(self) -> Task | None:
        """The oldest live task (cancelled ones are dropped); call with the lock held."""
        while self._tasks and self._tasks[0].future.done():
            self._tasks.popleft()
        return self._tasks[0] if self._tasks else None

    def _poll(self, now: float) -> tuple[float, bool] | None:
        """(arrival of the oldest task, whether a batch is ready), or None when empty."""
        with self._lock:
            oldest = self._oldest()
            if oldest is None:
                return None
            ready = sum(t.size for t in self._tasks) >= self.min_batch_size or now - oldest.arrived >= self.timeout
            return oldest.arrived, ready

    def _take_batch(self) -> list[Task]:
        with self._lock:
            batch, rows = [], 0
            while (task := self._oldest()) is not None and rows + task.size <= self.max_batch_size:
                if batch and task.signature() != batch[0].signature():
                    break
                batch.append(self._tasks.popleft())
                rows += task.size
            return batch

    def _close(self, reason: str) -> list[Task]:
        with self._lock:
            self._closed_reason = reason
            tasks, self._tasks = list(self._tasks), deque()
            return tasks

    def _reopen(self) -> None:
        with self._lock:
            self._closed_reason = None

    def __repr__(self) -> str:
        return f"<TaskPool {self.name} pending={len(self._tasks)} batch=[{self.min_batch_size}, {self.max_batch_size}]>"


def _resolve(task: Task, result=None, error: BaseException | None = None) -> None:
    def deliver():
        if not task.future.done():
            if error is not None:
                task.future.set_exception(error)
            else:
                task.future.set_result(result)
    try:
        task.loop.call_soon_threadsafe(deliver)
    except RuntimeError:  # that loop is closed: nobody is waiting any more
        pass


class Runtime:
    """Runs every pool's work on one compute thread, always serving the oldest waiting request first."""

    def __init__(self, pools: Sequence[TaskPool], *, clock: Callable[[], float] = time.monotonic):
        self.pools = list(pools)
        self.clock = clock
        self._wakeup = threading.Event()
        for pool in self.pools:
            pool._wakeup = self._wakeup
        self._jobs: deque[tuple[Callable[[], object], concurrent.futures.Future]] = deque()
        self._jobs_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ready = threading.Event()
        self.batches_processed = 0

    @classmethod
    def from_backends(cls, module_backends: dict, **kwargs) -> "Runtime":
        return cls([pool for backend in module_backends.values() for pool in backend.get_pools()], **kwargs)

    def start(self) -> None:
        if self._thread is not None:
            return
        for pool in self.pools:
            pool._reopen()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="plexus-moe-runtime", daemon=True)
        self._thread.start()
        self.ready.wait()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Finish the batch in progress, then fail every waiting request and stop the thread."""
        for pool in self.pools:
            for task in pool._close("the server is shutting down"):
                _resolve(task, error=ConnectionAbortedError(f"{pool.name}: the server is shutting down"))
        self._stop.set()
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning(f"the compute thread did not stop within {timeout} s (a module is still running)")
            self._thread = None
        self.ready.clear()
        with self._jobs_lock:
            jobs, self._jobs = list(self._jobs), deque()
        for _, future in jobs:
            future.cancel()

    def submit_job(self, job: Callable[[], object]) -> concurrent.futures.Future:
        """Run `job()` on the compute thread between batches (e.g. a checkpoint: modules are at rest)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._jobs_lock:
            self._jobs.append((job, future))
        self._wakeup.set()
        return future

    def _run(self) -> None:
        self.ready.set()
        while not self._stop.is_set():
            self._wakeup.clear()  # cleared before looking, so a submission after the look still wakes us
            if self._run_jobs():
                continue
            pool, delay = self._choose(self.clock())
            if pool is None:
                self._wakeup.wait(delay)
                continue
            batch = pool._take_batch()
            if batch:
                self._process(pool, batch)

    def _run_jobs(self) -> bool:
        with self._jobs_lock:
            jobs, self._jobs = list(self._jobs), deque()
        for job, future in jobs:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(job())
                except BaseException as error:  # the job's caller gets it
                    future.set_exception(error)
        return bool(jobs)

    def _choose(self, now: float) -> tuple[TaskPool | None, float]:
        best, best_arrival, next_deadline = None, float("inf"), now + 1.0
        for pool in self.pools:
            polled = pool._poll(now)
            if polled is None:
                continue
            arrived, ready = polled
            if ready and arrived < best_arrival:
                best, best_arrival = pool, arrived
            elif not ready:
                next_deadline = min(next_deadline, arrived + pool.timeout)
        return best, max(0.0, next_deadline - now)

    def _process(self, pool: TaskPool, batch: list[Task]) -> None:
        try:
            inputs = [torch.cat(column) if len(batch) > 1 else column[0]
                      for column in zip(*(task.inputs for task in batch))]
            outputs = pool.process_func(*inputs)
            total = sum(task.size for task in batch)
            for output in outputs:
                if output.dim() == 0 or output.shape[0] != total:
                    raise RuntimeError(f"{pool.name} returned a tensor of shape {tuple(output.shape)}, "
                                       f"not batch-first with {total} rows")
            sizes = [task.size for task in batch]
            per_task = list(zip(*(output.split(sizes) for output in outputs))) if outputs else [()] * len(batch)
        except Exception as error:
            logger.debug(f"{pool.name} failed on a batch of {len(batch)} requests: {error!r}", exc_info=True)
            for task in batch:
                _resolve(task, error=error)
            return
        self.batches_processed += 1
        for task, result in zip(batch, per_task):
            _resolve(task, result=tuple(result))

    def __repr__(self) -> str:
        state = "running" if self._thread is not None else "stopped"
        return f"<Runtime {state} pools={len(self.pools)} batches={self.batches_processed}>"
