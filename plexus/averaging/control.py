"""StepControl: a handle on an averaging step that runs in the background (`step(wait=False)`).

The training thread can wait for the result, cancel the step, change the weight until the
all-reduce begins, and, with `require_trigger=True`, let matchmaking run ahead of time and start
the all-reduce only when it calls `allow_allreduce()` (how the optimizer forms groups before the
epoch ends).

The control owns the step's task on the event loop, and its future resolves only when that task
is over: `done()` means the step's coroutine has finished, however it ended. So `cancel()` asks
the task to stop and returns at once, while `done()`, `result()` and `cancelled()` follow a
moment later, when the coroutine has unwound (left matchmaking, withdrawn its declaration). A
caller that waits for a cancelled step therefore never starts the next one on top of it.
"""

import asyncio
import concurrent.futures
import enum
import threading
from collections.abc import Coroutine

UNWIND_TIMEOUT = 10.0  # the longest a cancelled step's coroutine takes to end, in practice far less


class AveragingStage(enum.Enum):
    """Where a background step is: looking for a group, waiting for its trigger, reducing, done."""

    IDLE = 0
    LOOKING_FOR_GROUP = 1
    AWAITING_TRIGGER = 2
    RUNNING_ALLREDUCE = 3
    FINISHED = 4


class StepControl:
    """A handle on one averaging step running in the background, returned by `step(wait=False)`:
    wait for its result, cancel it, change its weight, or trigger its all-reduce."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, *, scheduled_time: float, weight: float, require_trigger: bool
    ):
        self._loop = loop
        self.scheduled_time, self._weight = scheduled_time, weight
        self.stage = AveragingStage.IDLE
        self._trigger = asyncio.Event()  # created on the loop thread by the averager
        if not require_trigger:
            self._trigger.set()
        self._future: concurrent.futures.Future = concurrent.futures.Future()  # resolved as the task ends
        self._ended = threading.Event()  # set with the future (concurrent.futures.wait overlooks a
        self._future.add_done_callback(lambda _: self._ended.set())  # future cancelled this way)
        self._task: asyncio.Task | None = None  # made on the loop by _start
        self._cancelling = False
        self.weight_for_group = None
        """Optional `(gathered, weight) -> weight`, called once the group is known and the trigger
        fired, with the user `gather` of every member that contributes (not auxiliary): lets a
        caller withdraw its contribution from a group it should not average with (e.g. peers at a
        newer epoch). Runs on the event loop: keep it cheap and non-blocking."""

    # --- the task (the averager's side) --------------------------------------------------------------

    def _start(self, coroutine: Coroutine) -> None:
        """Run the step's coroutine as a task on the loop; callable from any thread, once."""
        self._loop.call_soon_threadsafe(self._create_task, coroutine)

    def _create_task(self, coroutine: Coroutine) -> None:
        if self._cancelling:  # cancelled before the loop got to it: it never runs
            coroutine.close()
            self._future.cancel()
            return
        self._task = self._loop.create_task(coroutine)
        self._task.add_done_callback(self._on_task_done)

    def _on_task_done(self, task: asyncio.Task) -> None:
        if task.cancelled():
            self._future.cancel()
        elif task.exception() is not None:
            self._future.set_exception(task.exception())
        else:
            self._future.set_result(task.result())

    def _cancel_task(self) -> None:
        if self._task is not None:  # None: _create_task has not run yet, and will see _cancelling
            self._task.cancel()

    def _finish(self) -> None:
        """Called by the averager as the step's coroutine ends, however it ends."""
        self.stage = AveragingStage.FINISHED

    def wait_ended(self, timeout: float = UNWIND_TIMEOUT) -> bool:
        """Block until the step's coroutine is over (the same as `done()`); False if it still runs
        after `timeout` seconds."""
        return self._ended.wait(timeout)

    @property
    def weight(self) -> float:
        return self._weight

    @weight.setter
    def weight(self, weight: float) -> None:
        if self.began_allreduce:
            raise RuntimeError("the all-reduce has already begun: its weight can no longer change")
        if not weight >= 0:
            raise ValueError(f"weight must be non-negative, got {weight}")
        self._weight = float(weight)

    @property
    def began_allreduce(self) -> bool:
        return self.stage in (AveragingStage.RUNNING_ALLREDUCE, AveragingStage.FINISHED)

    @property
    def triggered(self) -> bool:
        return self._trigger.is_set()

    def allow_allreduce(self) -> None:
        """Let a step made with `require_trigger=True` proceed to the all-reduce once matched."""
        self._loop.call_soon_threadsafe(self._trigger.set)

    async def wait_for_trigger(self) -> None:
        await self._trigger.wait()

    def result(self, timeout: float | None = None):
        """Gathered data of the group {peer_id: gather}, or the step's error."""
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> bool:
        """Ask the step to stop; False if it is over already. Returns at once: the coroutine unwinds
        on the loop, and the step is done (cancelled) when it has; `wait_ended()` waits for that."""
        if self._future.done():
            return False
        if not self._cancelling:  # once: a second cancellation would cut the unwinding short
            self._cancelling = True
            self._loop.call_soon_threadsafe(self._cancel_task)
        return True

    def cancelled(self) -> bool:
        return self._future.cancelled()

    def add_done_callback(self, callback) -> None:
        self._future.add_done_callback(lambda _: callback(self))

    def __await__(self):
        return self._wait().__await__()

    async def _wait(self):
        """Await the result; an awaiter that is cancelled cancels the step (and does not wait for it)."""
        try:
            return await asyncio.shield(asyncio.wrap_future(self._future))
        except asyncio.CancelledError:
            self.cancel()
            raise

    def __repr__(self) -> str:
        return f"<StepControl {self.stage.name} weight={self._weight} triggered={self.triggered}>"
