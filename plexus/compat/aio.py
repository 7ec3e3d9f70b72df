"""The asyncio helpers hivemind exports from `hivemind.utils`: `as_aiter`, `amap_in_executor`,
`enter_asynchronously`. Plexus's own code does not need them (it uses `asyncio.to_thread`); they
are here for code written against hivemind."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import threading
from collections.abc import AsyncIterable, AsyncIterator, Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

T = TypeVar("T")


async def as_aiter(*values: T) -> AsyncIterator[T]:
    """An async iterator over `values`."""
    for value in values:
        yield value


async def amap_in_executor(
    func: Callable[..., T],
    *iterables: AsyncIterable,
    max_prefetch: int = 1,
    executor: concurrent.futures.Executor | None = None,
) -> AsyncIterator[T]:
    """`func` applied to the items of the async iterables (zipped), each call in `executor`, the
    results yielded in order; up to `max_prefetch` calls run ahead of the consumer."""
    loop = asyncio.get_running_loop()
    iterators = [iterable.__aiter__() for iterable in iterables]
    pending: collections.deque[asyncio.Future] = collections.deque()
    try:
        while True:
            try:
                args = [await iterator.__anext__() for iterator in iterators]
            except StopAsyncIteration:
                break
            pending.append(loop.run_in_executor(executor, func, *args))
            if len(pending) > max_prefetch:
                yield await pending.popleft()
        while pending:
            yield await pending.popleft()
    finally:
        for future in pending:
            future.cancel()


@contextlib.asynccontextmanager
async def enter_asynchronously(context: AbstractContextManager) -> AsyncIterator[Any]:
    """`async with enter_asynchronously(lock):` enters a blocking context manager (a threading or
    multiprocessing lock) without blocking the event loop. Each entry waits in a thread of its own,
    so waiters never starve one another of executor threads; a waiter cancelled before it got in
    leaves the context as soon as the thread enters it."""
    loop = asyncio.get_running_loop()
    entered: asyncio.Future = loop.create_future()

    def deliver(value: Any, error: BaseException | None) -> None:
        if entered.cancelled():
            if error is None:
                context.__exit__(None, None, None)
        elif error is not None:
            entered.set_exception(error)
        else:
            entered.set_result(value)

    def enter() -> None:
        try:
            value = context.__enter__()
        except BaseException as error:  # handed to the waiter, who raises it
            loop.call_soon_threadsafe(deliver, None, error)
            return
        loop.call_soon_threadsafe(deliver, value, None)

    threading.Thread(target=enter, name="enter-asynchronously", daemon=True).start()
    value = await entered
    try:
        yield value
    finally:
        context.__exit__(None, None, None)


__all__ = ["amap_in_executor", "as_aiter", "enter_asynchronously"]
