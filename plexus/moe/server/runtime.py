"""The batching runtime: per-backend task pools and one compute thread, shared fairly between callers.

Theory of operation
-------------------
Requests arrive on the event loop. `TaskPool.submit_task(*tensors, owner=peer)` appends a `Task`
(its batch of batch-first tensors, its size, an asyncio future, its arrival time and its owner,
the peer that asked) to that owner's queue in the pool and wakes the compute thread; it takes a
lock for a few list operations and never waits for compute, so the loop is never blocked.

The `Runtime` owns one daemon thread that runs every module (one thread: a module is never run by
two threads at once, and the optimizer step of a backward never races a forward). It shares that
thread between owners by the compute time each received (start-time fair queueing, with batches
as the unit): every batch's duration is charged to the owners of its tasks in proportion to their
rows, over all pools, and the owner who received least goes next. An owner with nothing waiting
is forgotten; when it asks again it starts level with the least-served waiting owner, so being
idle earns no credit and asking little wins the ties. One client flooding the server with large
requests then delays another client by at most about one batch (the one running), not by its
whole queue. Its loop:

1. Drop tasks whose future was cancelled (the caller gave up) from the head of each owner's queue.
2. A pool is *ready* when its waiting rows reach `min_batch_size`, or when its oldest task has
   waited `timeout` seconds (so a lone request is not stranded below the minimum).
3. Of the owners with tasks in ready pools, take the least served (then the one with fewer tasks
   waiting, then the oldest task first: with a single owner this is hivemind's oldest-first order);
   with none ready, sleep until the next such deadline or a new submission.
4. Form a batch in that owner's pool: its oldest task first, then one task per owner in the order
   of service received, round after round, up to `max_batch_size` rows, skipping tasks whose
   non-batch shapes differ from the first (they go in a later batch). Concatenate, run the pool's
   function, split the outputs by task sizes, hand each result (or the exception) back to its loop
   with `call_soon_threadsafe`, and charge the batch's duration.

A single task larger than `max_batch_size` is refused at submission, and each pool holds at most
`max_pending_tasks` tasks (the server answers "overloaded" past that; how many one peer may have
under way is the server's `max_requests_per_peer`). Jobs given to `Runtime.submit_job`
(checkpoints) run on the same thread between batches, so they see modules at rest. What is left
out: hivemind's prefetching of batches in a second process and stats reports; one thread, no
copies into shared memory.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence

import torch

from ...errors import PeerError
from ...utils.logging import get_logger

logger = get_logger(__name__)

DEFAULT_MAX_PENDING_TASKS = 4096


class TaskRejected(PeerError, ValueError):
    """The request cannot be queued: too large a batch, or the pool is full or closed."""


class Task:
    __slots__ = ("arrived", "future", "inputs", "loop", "owner", "size")

    def __init__(
        self,
        inputs: Sequence[torch.Tensor],
        size: int,
        future: asyncio.Future,
        arrived: float,
        owner: Hashable = None,
    ):
        self.inputs, self.size, self.future, self.arrived, self.owner = inputs, size, future, arrived, owner
        self.loop = future.get_loop()

    def signature(self) -> tuple:
        return tuple((tuple(t.shape[1:]), t.dtype) for t in self.inputs)


class TaskPool:
    """A queue of requests for one function (a backend's forward or backward), batched on demand.

    `process_func(*batched_inputs)` returns a tuple of batch-first tensors.
    """

    def __init__(
        self,
        process_func: Callable[..., Sequence[torch.Tensor]],
        *,
        name: str,
        max_batch_size: int,
        min_batch_size: int = 1,
        timeout: float = 1.0,
        max_pending_tasks: int = DEFAULT_MAX_PENDING_TASKS,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not 1 <= min_batch_size <= max_batch_size:
            raise ValueError(
                f"need 1 <= min_batch_size ({min_batch_size}) <= max_batch_size ({max_batch_size})"
            )
        self.process_func, self.name = process_func, name
        self.min_batch_size, self.max_batch_size, self.timeout = min_batch_size, max_batch_size, timeout
        self.max_pending_tasks = max_pending_tasks
        self.clock = clock
        self._queues: dict[Hashable, deque[Task]] = {}  # per owner, oldest first
        self._pending = self._rows = 0
        self._lock = threading.Lock()
        self._wakeup = threading.Event()  # replaced by the runtime's own when attached
        self._closed_reason: str | None = None

    def submit_task(self, *inputs: torch.Tensor, owner: Hashable = None) -> asyncio.Future:
        """Queue one request (batch-first tensors with a common batch size) on behalf of `owner`
        (the peer that sent it; None: a local caller); await the future for its outputs. Must be
        called from a running event loop. Raises TaskRejected."""
        if not inputs:
            raise TaskRejected(f"{self.name}: a request needs at least one tensor")
        size = inputs[0].shape[0] if inputs[0].dim() else 0
        if size < 1 or any(t.dim() == 0 or t.shape[0] != size for t in inputs):
            raise TaskRejected(
                f"{self.name}: every tensor must share one batch size >= 1, got "
                f"{[tuple(t.shape) for t in inputs]}"
            )
        if size > self.max_batch_size:
            raise TaskRejected(
                f"{self.name}: a batch of {size} rows exceeds max_batch_size={self.max_batch_size}; "
                f"split it into smaller requests"
            )
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            if self._closed_reason is not None:
                raise TaskRejected(f"{self.name}: {self._closed_reason}")
            if self._pending >= self.max_pending_tasks:
                raise TaskRejected(
                    f"{self.name} is overloaded ({self._pending} requests waiting); "
                    f"retry later or use another expert"
                )
            self._queues.setdefault(owner, deque()).append(Task(inputs, size, future, self.clock(), owner))
            self._pending += 1
            self._rows += size
        self._wakeup.set()
        return future

    @property
    def num_pending(self) -> int:
        return self._pending

    def _drop_cancelled(self) -> None:
        """Drop cancelled tasks from the head of each queue, and empty queues; call with the lock held."""
        for owner in list(self._queues):
            queue = self._queues[owner]
            while queue and queue[0].future.done():
                self._rows -= queue.popleft().size
                self._pending -= 1
            if not queue:
                del self._queues[owner]

    def _poll(self, now: float) -> tuple[float, bool, dict[Hashable, tuple[float, int]]] | None:
        """(arrival of the oldest task, whether a batch is ready, {owner: (arrival of its oldest task,
        its tasks waiting)}), or None when empty."""
        with self._lock:
            self._drop_cancelled()
            if not self._queues:
                return None
            heads = {owner: (queue[0].arrived, len(queue)) for owner, queue in self._queues.items()}
            oldest = min(arrived for arrived, _ in heads.values())
            return oldest, self._rows >= self.min_batch_size or now - oldest >= self.timeout, heads

    def _take_batch(self, order: Sequence[Hashable]) -> list[Task]:
        """A batch of up to `max_batch_size` rows: the oldest task of `order[0]`, then one task per
        owner in `order` (owners not in it last), round after round, each owner's oldest first."""
        with self._lock:
            self._drop_cancelled()
            owners = [owner for owner in order if owner in self._queues]
            owners += [owner for owner in self._queues if owner not in owners]
            batch, rows, signature = [], 0, None
            progress = True
            while progress:
                progress = False
                for owner in owners:
                    queue = self._queues.get(owner)
                    task = next((task for task in queue if not task.future.done()), None) if queue else None
                    if task is None or queue is None or rows + task.size > self.max_batch_size:
                        continue
                    if signature is not None and task.signature() != signature:
                        continue
                    signature = task.signature()
                    queue.remove(task)
                    self._pending -= 1
                    self._rows -= task.size
                    if not queue:
                        del self._queues[owner]
                    batch.append(task)
                    rows += task.size
                    progress = True
            return batch

    def _close(self, reason: str) -> list[Task]:
        with self._lock:
            self._closed_reason = reason
            tasks = [task for queue in self._queues.values() for task in queue]
            self._queues, self._pending, self._rows = {}, 0, 0
            return tasks

    def _reopen(self) -> None:
        with self._lock:
            self._closed_reason = None

    def __repr__(self) -> str:
        return (
            f"<TaskPool {self.name} pending={self._pending} from {len(self._queues)} owners "
            f"batch=[{self.min_batch_size}, {self.max_batch_size}]>"
        )


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
    """Runs every pool's work on one compute thread, the least-served owner first (module docstring)."""

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
        # compute seconds per owner with tasks waiting; touched by the compute thread only
        self._served: dict[Hashable, float] = {}

    @classmethod
    def from_backends(cls, module_backends: dict, **kwargs) -> Runtime:
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
                logger.warning(
                    f"the compute thread did not stop within {timeout} s (a module is still running)"
                )
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
            pool, order, delay = self._choose(self.clock())
            if pool is None:
                self._wakeup.wait(delay)
                continue
            batch = pool._take_batch(order)
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

    def _choose(self, now: float) -> tuple[TaskPool | None, list[Hashable], float]:
        """(pool to serve, its owners in the order to serve them, seconds to sleep if none)."""
        waiting: dict[Hashable, int] = {}
        ready, next_deadline = [], now + 1.0
        for pool in self.pools:
            polled = pool._poll(now)
            if polled is None:
                continue
            oldest, is_ready, heads = polled
            for owner, (_, count) in heads.items():
                waiting[owner] = waiting.get(owner, 0) + count
            if is_ready:
                ready.append((pool, heads))
            else:
                next_deadline = min(next_deadline, oldest + pool.timeout)
        self._settle_shares(waiting)
        best, best_key = None, None
        for pool, heads in ready:
            for owner, (arrived, _) in heads.items():
                key = (self._served[owner], waiting[owner], arrived)
                if best_key is None or key < best_key:
                    best, best_key = (pool, owner, heads), key
        if best is None:
            return None, [], max(0.0, next_deadline - now)
        pool, first, heads = best
        others = sorted((owner for owner in heads if owner != first), key=lambda owner: self._served[owner])
        return pool, [first, *others], 0.0

    def _settle_shares(self, waiting: dict[Hashable, int]) -> None:
        """Forget owners with nothing waiting; a newcomer starts level with the least served of the rest."""
        for owner in [owner for owner in self._served if owner not in waiting]:
            del self._served[owner]
        level = min(self._served.values(), default=0.0)
        for owner in waiting:
            self._served.setdefault(owner, level)

    def _process(self, pool: TaskPool, batch: list[Task]) -> None:
        started = self.clock()
        try:
            inputs = [
                torch.cat(column) if len(batch) > 1 else column[0]
                for column in zip(*(task.inputs for task in batch))
            ]
            outputs = pool.process_func(*inputs)
            total = sum(task.size for task in batch)
            for output in outputs:
                if output.dim() == 0 or output.shape[0] != total:
                    raise RuntimeError(
                        f"{pool.name} returned a tensor of shape {tuple(output.shape)}, "
                        f"not batch-first with {total} rows"
                    )
            sizes = [task.size for task in batch]
            per_task = (
                list(zip(*(output.split(sizes) for output in outputs))) if outputs else [()] * len(batch)
            )
        except Exception as error:
            logger.debug(f"{pool.name} failed on a batch of {len(batch)} requests: {error!r}", exc_info=True)
            for task in batch:
                _resolve(task, error=error)
            return
        finally:
            self._charge(batch, self.clock() - started)
        self.batches_processed += 1
        for task, result in zip(batch, per_task):
            _resolve(task, result=tuple(result))

    def _charge(self, batch: list[Task], seconds: float) -> None:
        rows = sum(task.size for task in batch)
        for task in batch:
            self._served[task.owner] = self._served.get(task.owner, 0.0) + seconds * task.size / rows

    def __repr__(self) -> str:
        state = "running" if self._thread is not None else "stopped"
        return f"<Runtime {state} pools={len(self.pools)} batches={self.batches_processed}>"
