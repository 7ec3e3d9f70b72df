"""StepControl: a handle on an averaging step that runs in the background (`step(wait=False)`).

The training thread can wait for the result, cancel the step, change the weight until the
all-reduce begins, and, with `require_trigger=True`, let matchmaking run ahead of time and start
the all-reduce only when it calls `allow_allreduce()` (how the optimizer forms groups before the
epoch ends).
"""

import asyncio
import concurrent.futures
import enum
import threading


UNWIND_TIMEOUT = 10.0  # the longest a cancelled step's coroutine takes to end, in practice far less


class AveragingStage(enum.Enum):
    IDLE = 0
    LOOKING_FOR_GROUP = 1
    AWAITING_TRIGGER = 2
    RUNNING_ALLREDUCE = 3
    FINISHED = 4


class StepControl:
    def __init__(self, loop: asyncio.AbstractEventLoop, *, scheduled_time: float, weight: float, require_trigger: bool):
        self._loop = loop
        self.scheduled_time, self._weight = scheduled_time, weight
        self.stage = AveragingStage.IDLE
        self._trigger = asyncio.Event()  # created on the loop thread by the averager
        if not require_trigger:
            self._trigger.set()
        self._future: concurrent.futures.Future | None = None
        self._ended = threading.Event()  # the step's coroutine is over (or was cancelled unstarted)
        self.weight_for_group = None
        """Optional `(gathered, weight) -> weight`, called once the group is known and the trigger
        fired, with the user `gather` of every member that contributes (not auxiliary): lets a
        caller withdraw its contribution from a group it should not average with (e.g. peers at a
        newer epoch). Runs on the event loop: keep it cheap and non-blocking."""

    def _attach(self, future: concurrent.futures.Future) -> None:
        self._future = future
        future.add_done_callback(self._on_future_done)

    def _on_future_done(self, _future) -> None:
        if self.stage is AveragingStage.IDLE:  # cancelled before its coroutine ran: it never will
            self._ended.set()

    def _finish(self) -> None:
        """Called by the averager as the step's coroutine ends, however it ends."""
        self.stage = AveragingStage.FINISHED
        self._ended.set()

    def wait_ended(self, timeout: float = UNWIND_TIMEOUT) -> bool:
        """Block until the step's coroutine is over, not just its future: a cancelled step leaves
        matchmaking a moment after `cancel()` returns, and the averager looks for one group at a
        time. False if it still runs after `timeout` seconds."""
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
        return self._future.cancel()

    def cancelled(self) -> bool:
        return self._future.cancelled()

    def add_done_callback(self, callback) -> None:
        self._future.add_done_callback(lambda _: callback(self))

    def __await__(self):
        return asyncio.wrap_future(self._future).__await__()

    def __repr__(self) -> str:
        return f"<StepControl {self.stage.name} weight={self._weight} triggered={self.triggered}>"
