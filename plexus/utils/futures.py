"""A thread-safe future that asyncio code can also `await`.

The synchronous API returns futures (`DHT.get(..., return_future=True)`, `averager.step(wait=False)`)
that a training thread waits on with `.result()`. Code written for hivemind also awaits them from
inside coroutines, so `AwaitableFuture` is a `concurrent.futures.Future` whose `__await__` wraps it
for the running loop (whichever loop that is, the background one included): awaiting never blocks
a thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Coroutine


class AwaitableFuture(concurrent.futures.Future):
    """`concurrent.futures.Future` + `await future` in any running event loop."""

    def __await__(self):
        return asyncio.wrap_future(self).__await__()


def run_threadsafe(coroutine: Coroutine, loop: asyncio.AbstractEventLoop) -> AwaitableFuture:
    """`asyncio.run_coroutine_threadsafe`, returning an AwaitableFuture; cancelling it cancels the task."""
    inner = asyncio.run_coroutine_threadsafe(coroutine, loop)
    outer = AwaitableFuture()

    def copy_state(done: concurrent.futures.Future) -> None:
        if done.cancelled():
            outer.cancel()
            return
        try:
            error = done.exception()
            if error is not None:
                outer.set_exception(error)
            else:
                outer.set_result(done.result())
        except concurrent.futures.InvalidStateError:
            pass  # the caller cancelled `outer` meanwhile: that outcome stands

    def propagate_cancel(done: concurrent.futures.Future) -> None:
        if done.cancelled():
            inner.cancel()

    outer.add_done_callback(propagate_cancel)
    inner.add_done_callback(copy_state)
    return outer
