"""Calling many experts at once and deciding when enough of them have answered.

A mixture sends each sample to k experts; the calls are grouped by expert (one request carries
every row routed to that expert), so a call succeeding or failing counts for all its rows. The
rules, per sample (hivemind's):

- wait until every sample has `k_min` answers, then at most `timeout_after_k_min` longer for the
  rest (None: until all have answered), never past the overall deadline;
- stragglers are cancelled; failed calls are left out;
- a sample that ends with fewer than `k_min` answers fails the whole call with
  `TooFewExpertsError`, which names the experts that failed and why. It fails as soon as that is
  certain (every call a sample could still count on has failed), not at the deadline.

`Quorum` is the bookkeeping, without I/O; `call_with_quorum` runs the calls on the event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence

from ...errors import PhaseTimeout


class TooFewExpertsError(PhaseTimeout):
    """Fewer experts answered than `k_min` (or `backward_k_min`) asks for.

    A TimeoutError subclass, as in hivemind; the message lists the failures. Usually some expert
    servers are down or overloaded: lower k_min, raise the timeouts, or start more servers.
    """


class Quorum:
    """Which samples have enough answers. `rows[t]` lists the samples call t serves."""

    def __init__(self, num_samples: int, rows: Sequence[Sequence[int]], k_min: int | Sequence[int]):
        self.required = [k_min] * num_samples if isinstance(k_min, int) else list(k_min)
        self.rows = [list(r) for r in rows]
        self.answers = [0] * num_samples
        self.possible = [0] * num_samples  # answers still possible: succeeded + in flight
        for r in self.rows:
            for sample in r:
                self.possible[sample] += 1
        self._short = sum(1 for s in range(num_samples) if self.answers[s] < self.required[s])

    def succeeded(self, call: int) -> None:
        for sample in self.rows[call]:
            self.answers[sample] += 1
            if self.answers[sample] == self.required[sample]:
                self._short -= 1

    def failed(self, call: int) -> None:
        for sample in self.rows[call]:
            self.possible[sample] -= 1

    @property
    def reached(self) -> bool:
        """Every sample has its required answers."""
        return self._short == 0

    def hopeless(self) -> list[int]:
        """Samples that can no longer reach their required answers."""
        return [s for s, (possible, need) in enumerate(zip(self.possible, self.required)) if possible < need]


async def call_with_quorum(
    calls: Sequence[Callable[[], Awaitable]],
    rows: Sequence[Sequence[int]],
    num_samples: int,
    k_min: int | Sequence[int],
    timeout_after_k_min: float | None,
    deadline: float | None,
    describe: Callable[[int], str],
    phase: str,
) -> dict[int, object]:
    """Run every call at once; return {call index: result} for those that succeeded in time.

    `deadline` is a `time.monotonic()` instant (None: no overall bound). Raises TooFewExpertsError
    when some sample ends below `k_min`; `describe(i)` names call i in that message.
    """
    quorum = Quorum(num_samples, rows, k_min)
    loop = asyncio.get_running_loop()
    tasks = {loop.create_task(_run(call)): i for i, call in enumerate(calls)}
    results: dict[int, object] = {}
    errors: dict[int, BaseException] = {}
    pending = set(tasks)
    stop_at = deadline
    if quorum.reached and timeout_after_k_min is not None:
        stop_at = _earlier(stop_at, time.monotonic() + timeout_after_k_min)
    try:
        while pending:
            timeout = None if stop_at is None else max(0.0, stop_at - time.monotonic())
            if timeout == 0.0:
                break
            done, pending = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                break
            was_reached = quorum.reached
            for task in done:
                i = tasks[task]
                error = task.exception()
                if error is None:
                    results[i] = task.result()
                    quorum.succeeded(i)
                else:
                    errors[i] = error
                    quorum.failed(i)
            if quorum.hopeless():
                break
            if quorum.reached and not was_reached and timeout_after_k_min is not None:
                stop_at = _earlier(stop_at, time.monotonic() + timeout_after_k_min)
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    if not quorum.reached:
        short = [s for s in range(num_samples) if quorum.answers[s] < quorum.required[s]]
        late = [tasks[t] for t in pending]
        raise TooFewExpertsError(_explain(phase, quorum, short, errors, late, describe))
    return results


async def _run(call: Callable[[], Awaitable]):
    return await call()


def _earlier(a: float | None, b: float) -> float:
    return b if a is None else min(a, b)


def _explain(
    phase: str,
    quorum: Quorum,
    short: list[int],
    errors: dict[int, BaseException],
    late: list[int],
    describe: Callable[[int], str],
) -> str:
    sample = short[0]
    text = (
        f"{phase}: {len(short)} of {len(quorum.answers)} samples got fewer answers than required "
        f"(sample {sample}: {quorum.answers[sample]} of the {quorum.required[sample]} required)"
    )
    reasons = [f"{describe(i)}: {type(e).__name__}: {e}" for i, e in list(errors.items())[:3]]
    if len(errors) > 3:
        reasons.append(f"and {len(errors) - 3} more failures")
    if late:
        reasons.append(f"{len(late)} calls still unanswered at the deadline (e.g. {describe(late[0])})")
    if reasons:
        text += "; " + "; ".join(reasons)
    return text + (
        ". Some expert servers may be down or overloaded: lower k_min, raise the timeouts, or add servers"
    )
