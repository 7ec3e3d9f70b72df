"""The reducer's side of one all-reduce round: its span, its senders' streams, and the checks of
the other reducers (see `allreduce.py` for the protocol and the fault-tolerance rules).

A `SpanReducer` belongs to one `AllReduceRunner` (`self.round`), whose options and partition it
shares. It serves one stream per sender: it waits until every live sender has opened its stream
and bounds their weights (`aggregation.bounded_weights`), reads each sender's parts inside the
window, adds them up (`aggregation.MeanPart`, or `ClippedPart` in robust mode), answers each part
as soon as it completes, and excludes senders that stall or send garbage. With verification it
then reveals its seed, collects the senders' reports, judges the other spans
(`verification.Verifier`) and sends its verdict. Who owes what is `reducer_core.ReducerCore`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import torch

from ..compression import CompressionError, CompressionType, NoCompression
from ..compression.base import tensor_bytes_view
from ..compression.wire import dtype_name
from ..errors import PeerMisbehaved
from ..p2p import rpc
from ..p2p.messages import MessageError
from ..utils.logging import RateLimitedLog, get_logger
from .aggregation import ClippedPart, MeanPart, bounded_weights, equal_weights
from .messages import (
    AnswerHeader,
    AnswerKind,
    PartHeader,
    VerifyDone,
    VerifyReport,
    VerifySeed,
    VerifyVerdict,
    base_method,
    decode_tensor,
    encode_tensor,
)
from .partition import Part
from .reducer_core import ReducerCore
from .verification import SEED_BYTES, Verifier

if TYPE_CHECKING:
    from ..p2p.identity import PeerID
    from .allreduce import AllReduceRunner

logger = get_logger(__name__)
_faults = RateLimitedLog(logger)  # one line per (peer, kind of fault) a minute, however many rounds


def log_peer_fault(peer: PeerID, what: str, message: str) -> None:
    """Log a peer's fault once per kind (`what` with its numbers blanked) and minute."""
    _faults.warning((re.sub(r"\d[\d.e+-]*", "#", what), peer), message)


class SenderExcluded(PeerMisbehaved):
    """A reducer excluded a sender from the rest of the round; the text says why (sent to it)."""


EXCLUDED_YOU = "excluded you from all-reduce"
"""Begins the error text a reducer sends a sender it goes on without (the others' round goes on)."""


class _Channel:
    """One remote sender's stream at this reducer: answers waiting to be written, its reader."""

    def __init__(self, stream):
        self.stream = stream
        self.answers: deque = deque()
        self.wake = asyncio.Event()
        self.closed = False
        self.finished = asyncio.Event()
        self.reader: asyncio.Task | None = None

    def push(self, item) -> None:
        self.answers.append(item)
        self.wake.set()

    def close(self) -> None:
        self.closed = True
        self.wake.set()


class SpanReducer:
    """Reduces `round`'s own span (its runner must reduce a non-empty span); see the module comment."""

    def __init__(self, round: AllReduceRunner):
        self.round = round
        self.me, self.peers, self.partition = round.me, round.peers, round.partition
        self.num_parts = round.num_parts
        self.tag = round.group_id.hex()[:8]  # names the round in logs and errors
        self.started = asyncio.Event()
        self.reduced = asyncio.Event()
        self.progress = asyncio.Event()
        self._core: ReducerCore | None = None
        self.states: dict[int, MeanPart | ClippedPart] = {}
        self.channels: dict[int, _Channel] = {}
        self.declared: dict[int, float] = {}  # sender -> the weight it stated
        self.weights: dict[int, float] | None = None  # sender -> its bounded weight, once settled
        self.done_senders: set[int] = set()
        self.verifier: Verifier | None = None
        self.own_verdict: list | None = None

    def __repr__(self) -> str:
        return f"<SpanReducer {self._core!r}>"

    @property
    def core(self) -> ReducerCore:
        """Who is live, who is due and what is complete; made by `start` (streams wait for `started`)."""
        if self._core is None:
            raise RuntimeError(f"the reduction of round {self.tag} has not started")
        return self._core

    def _weight_of(self, sender: int) -> float:
        """The bounded weight of `sender`: asked for only once the weights are settled."""
        if self.weights is None:
            raise RuntimeError(f"round {self.tag}: the weights are not settled yet")
        return self.weights[sender]

    def start(self, now: float) -> list[asyncio.Task]:
        """Begin the round: the background tasks (to cancel when it ends)."""
        r = self.round
        self._core = core = ReducerCore(
            self.num_parts,
            r.senders,
            window=r.window,
            sender_timeout=r.sender_timeout,
            now=now,
            exempt=[self.me],
        )
        if r.is_sender:
            self.declared[self.me] = r.weight
        if core.settled:
            self.settle_weights()
        self.started.set()
        tasks = [r._spawn(self._watchdog())]
        if r.is_sender:
            tasks.append(r._spawn(self._contribute_local()))
        if self.core.done:
            self._on_complete(range(0))
        return tasks

    def finish(self) -> None:
        """The round is over: reset the streams whose answers were not all written."""
        for channel in self.channels.values():
            if not channel.finished.is_set():
                channel.stream.reset()

    async def flush_answers(self, deadline: float) -> None:
        """Wait (until `deadline`) for every live sender's answers to be written."""
        pending = [c.finished.wait() for c in self.channels.values() if not c.finished.is_set()]
        if pending:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(deadline):
                    await asyncio.gather(*pending)

    # --- contributions -------------------------------------------------------------

    def _notify(self) -> None:
        self.progress.set()
        self.progress = asyncio.Event()

    async def _wait_until(self, predicate) -> None:
        while not predicate():
            await self.progress.wait()

    def settle_weights(self) -> None:
        """Every live sender stated its weight: bound them all (see aggregation.bounded_weights)."""
        declared = {s: w for s, w in self.declared.items() if s in self.core.live}
        if self.round.robust is not None:
            self.weights = equal_weights(declared)
            self._notify()
            return
        self.weights = bounded_weights(declared, self.round.weight_limits, self.round.max_weight_ratio)
        for sender, weight in self.weights.items():
            if weight < declared[sender] and sender != self.me:
                log_peer_fault(
                    self.peers[sender],
                    "weight",
                    f"all-reduce {self.tag}: weight of "
                    f"{self.peers[sender]} bounded from {declared[sender]:.6g} to {weight:.6g} "
                    f"(its limit {self.round.weight_limits.get(sender)}, or "
                    f"{self.round.max_weight_ratio} x the group's median)",
                )
        self._notify()

    async def _contribute_local(self) -> None:
        for index in range(self.num_parts):
            await self._wait_until(lambda: self.core.allowed(self.me) or self.me not in self.core.live)
            if self.me not in self.core.live:
                return
            part = self.partition.part(self.me, index)
            values = self.round.outgoing(part, self.partition.view(part)).cpu()
            if self.round.reject_nonfinite and not bool(torch.isfinite(values).all()):
                self._exclude(self.me, f"this peer's own part {index} holds NaN or inf values")
                return
            self._contribute(self.me, part, values)
            await asyncio.sleep(0)  # let the network make progress between parts

    def _contribute(
        self, sender: int, part: Part, values: torch.Tensor, lossy_wire: tuple | None = None
    ) -> None:
        state = self.states.get(part.index)
        if state is None:
            robust = self.round.robust
            state = self.states[part.index] = ClippedPart(robust) if robust else MeanPart()
        state.add(sender, values, self._weight_of(sender), lossy_wire)
        self._on_complete(self.core.contribute(sender, part.index, asyncio.get_running_loop().time()))

    def _exclude(self, sender: int, reason: str) -> None:
        if sender not in self.core.live:
            return
        peer = self.peers[sender]
        log_peer_fault(peer, reason, f"all-reduce {self.tag}: excluding sender {peer}: {reason}")
        completed = self.core.exclude(sender, reason, asyncio.get_running_loop().time())
        channel = self.channels.get(sender)
        if channel is not None:
            channel.push(
                SenderExcluded(f"{EXCLUDED_YOU} {self.tag} ({self.round.host.peer_id.short()}): {reason}")
            )
            channel.close()
            if channel.reader is not None and channel.reader is not asyncio.current_task():
                channel.reader.cancel()
        for state in self.states.values():
            state.drop(sender)
        if self.weights is None and self.core.settled:
            self.settle_weights()
        self._on_complete(completed)

    async def _watchdog(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.core.done:
            for sender in self.core.expired(loop.time()):
                if sender in self.channels:
                    reason = f"sent no part for sender_timeout={self.round.sender_timeout}s"
                else:
                    reason = f"did not open its stream within sender_timeout={self.round.sender_timeout}s"
                self._exclude(sender, reason)
            deadline = self.core.next_deadline()
            progress = self.progress
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(deadline):
                    await progress.wait()

    # --- answers -------------------------------------------------------------------

    def _on_complete(self, completed: range) -> None:
        for index in completed:
            self._answer(index)
        if completed:
            self._notify()
        if self.core.done and not self.reduced.is_set():
            self.reduced.set()
            self.round._check_answers_in()
            if not self.round.verifying:  # otherwise the streams stay open for the verification
                for channel in self.channels.values():
                    channel.close()

    def _answer(self, index: int) -> None:
        state = self.states.pop(index, None)
        part = self.partition.part(self.me, index)
        recipients = [s for s in sorted(self.core.live) if s != self.me and s in self.channels]
        dtype = self.partition.dtype(part)
        target = self.partition.output(part) if self.round.is_sender and self.me in self.core.live else None
        in_place = (
            target is not None
            and self.round.alpha == 1.0
            and target.device.type == "cpu"
            and state is not None
            and target.dtype == state.dtype
        )  # final: shared from there
        average, radius = state.average(target if in_place else None) if state is not None else (None, None)
        if isinstance(state, ClippedPart) and not state.converged:
            _faults.warning(
                ("centered clip not converged",),
                f"all-reduce {self.tag}: CenteredClip of part {index} did not converge in "
                f"{state.iterations} steps; verifiers may reject it (is clip_radius far below "
                f"the members' spread?)",
            )
        if target is not None:
            self.round._applied[self.me] = index + 1  # in place by the end of this call, or kept
            if self.round.verifying:
                self.round._answered[self.me].append(radius or 0.0)
        if average is None or state is None:  # (no state, no average)
            keep = AnswerHeader(index, AnswerKind.KEEP, part.numel, dtype_name(dtype), 0).encode()
            for sender in recipients:
                self.channels[sender].push((keep, None))
            if target is not None:
                self.partition.keep(part)
            return
        average = self.round.reduced(part, average)

        def header(
            kind: AnswerKind, sender: int, name: str = dtype_name(dtype), compression: int = 0
        ) -> bytes:
            weight = self._weight_of(sender) if self.round.verifying and index == 0 else None
            return AnswerHeader(index, kind, part.numel, name, compression, radius, weight).encode()

        shared = None
        method = base_method(self.round.compression, self.partition.compression_info(part))
        if self.round.shared_lossy_answers and not isinstance(method, NoCompression):
            name, compression, buffer = encode_tensor(
                average.to(dtype), self.partition.compression_info(part), self.round.compression
            )
            for sender in recipients:
                state.take_lossy(sender)
                self.channels[sender].push((header(AnswerKind.AVERAGE, sender, name, compression), buffer))
            if target is not None:
                self.partition.apply_average(
                    part, decode_tensor(part.numel, name, compression, buffer), self.round.alpha
                )
            return
        for sender in recipients:
            x_decoded = state.take_lossy(sender)
            if x_decoded is None:
                if shared is None:
                    shared = tensor_bytes_view(average.to(dtype))
                self.channels[sender].push((header(AnswerKind.AVERAGE, sender), shared))
            else:
                delta = (average - x_decoded).to(dtype)
                name, compression, buffer = encode_tensor(
                    delta, self.partition.compression_info(part), self.round.compression
                )
                self.channels[sender].push((header(AnswerKind.DELTA, sender, name, compression), buffer))
        if target is not None and average.data_ptr() != target.data_ptr():
            self.partition.apply_average(part, average, self.round.alpha)

    # --- verification ----------------------------------------------------------------

    async def verify_spans(self) -> None:
        """As a verifier: once our senders have all their answers, reveal a seed, collect their
        reports (and ours), judge the other spans and send everyone the verdict."""
        loop = asyncio.get_running_loop()

        def live_senders() -> list[int]:
            return [s for s in self.core.live if s != self.me and s in self.channels]

        await self.round._answers_in.wait()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.round.reducer_timeout):
                await self._wait_until(lambda: all(s in self.done_senders for s in live_senders()))
        due = [s for s in live_senders() if s in self.done_senders]
        expected = {s: self._weight_of(s) for s in due}
        if self.round.is_sender and self.weights is not None and self.me in self.weights:
            expected[self.me] = self.weights[self.me]
        seed = os.urandom(SEED_BYTES)
        robust = self.round.robust
        assert robust is not None  # the round verifies only with robust aggregation
        self.verifier = verifier = Verifier(
            self.me,
            [self.partition.num_parts(j) for j in range(len(self.peers))],
            expected,
            robust,
            self.round.part_precision,
        )
        for sender in due:
            self.channels[sender].push((VerifySeed(seed).encode(), None))
        if self.me in expected:
            verifier.add(self.me, await loop.run_in_executor(None, self.round._make_report, seed))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.round.reducer_timeout):
                await self._wait_until(
                    lambda: all(s in self.verifier.reports or s not in self.core.live for s in due)
                )
        verdict = self.verifier.verdict()
        for span, reason in verdict.reasons.items():
            log_peer_fault(
                self.peers[span],
                reason,
                f"all-reduce {self.tag}: verification of the "
                f"span reduced by {self.peers[span]} failed: {reason}",
            )
        self.own_verdict = verdict.bad_parts
        frame = VerifyVerdict(verdict.bad_parts).encode()
        for sender, channel in self.channels.items():
            if sender in due and sender in self.core.live:
                channel.push((frame, None))
            channel.close()

    # --- one sender's stream ---------------------------------------------------------

    async def serve_sender(
        self, stream, first: PartHeader, frames: AsyncIterator[bytes]
    ) -> AsyncIterator[bytes]:
        """The reducer's side of one sender's stream: read its parts, yield the answer frames."""
        sender = self.peers.index(stream.remote_peer)  # the runner checked it is one of the senders
        try:
            async with asyncio.timeout(self.round.sender_timeout):
                await self.started.wait()
        except TimeoutError:
            raise SenderExcluded("this peer has not started the round; is the group id stale?") from None
        if sender in self.core.excluded:
            raise SenderExcluded(f"{EXCLUDED_YOU} {self.tag}: {self.core.excluded[sender]}")
        if sender in self.channels:
            raise SenderExcluded("a second stream from the same sender; one per reducer and round")
        channel = self.channels[sender] = _Channel(stream)
        assert first.weight is not None  # the runner checked: the first header has group_id and weight
        self.declared[sender] = first.weight
        if self.core.open(sender, asyncio.get_running_loop().time()):
            self.settle_weights()
        channel.reader = self.round._spawn(self._read_parts(sender, first, frames))
        try:
            while True:
                while not channel.answers and not channel.closed:
                    channel.wake.clear()
                    await channel.wake.wait()
                if not channel.answers:
                    return
                item = channel.answers.popleft()
                self._notify()  # a slot in this sender's answer backlog is free
                if isinstance(item, Exception):
                    raise item
                header, buffer = item
                try:
                    yield header
                    if buffer is not None:
                        yield buffer
                except GeneratorExit:  # the RPC layer dropped us: writing to the sender failed
                    self._exclude(sender, "its stream broke while answers were written to it")
                    raise
        finally:
            channel.finished.set()

    async def _read_parts(self, sender: int, header: PartHeader | None, frames: AsyncIterator[bytes]) -> None:
        received = 0
        try:
            while received < self.num_parts:
                channel = self.channels[sender]
                await self._wait_until(
                    lambda: (
                        sender not in self.core.live
                        or (self.core.allowed(sender) and len(channel.answers) < self.round.window)
                    )
                )
                if sender not in self.core.live:
                    return
                if header is None:
                    header = PartHeader.decode(await self._next_frame(frames, f"after {received} parts"))
                    if header.group_id is not None:
                        raise ValueError(
                            f"part {header.index} repeats group_id/weight; only the first part has them"
                        )
                buffer = await self._next_frame(frames, f"before the buffer of part {header.index}")
                part = self._check_part(header)
                values = decode_tensor(header.numel, header.dtype, header.compression, buffer)
                if self.round.reject_nonfinite and not bool(torch.isfinite(values).all()):
                    raise ValueError(f"part {part.index} holds NaN or inf values")
                lossy = header.compression != CompressionType.NONE
                self._contribute(sender, part, values, (header, buffer) if lossy else None)
                received, header = received + 1, None
                del buffer, values  # not held while waiting
            if self.round.verifying:
                VerifyDone.decode(await self._next_frame(frames, "before VerifyDone"))
                self.done_senders.add(sender)
                self._notify()
                report = VerifyReport.decode(await self._next_frame(frames, "before its VerifyReport"))
                await self._wait_until(lambda: self.verifier is not None)
                assert self.verifier is not None  # (waited for above)
                self.verifier.add(sender, report)
                self._notify()
        except asyncio.CancelledError:
            raise
        except (
            ValueError,
            MessageError,
            CompressionError,
            rpc.RPCProtocolError,
            ConnectionError,
            asyncio.IncompleteReadError,
        ) as error:
            plain = type(error) is ValueError  # our own checks: the message says it all
            self._exclude(sender, str(error) if plain else f"{type(error).__name__}: {error}")

    @staticmethod
    async def _next_frame(frames: AsyncIterator[bytes], where: str) -> bytes:
        raw = await anext(frames, None)
        if raw is None:
            raise ValueError(f"the stream ended {where}")
        return raw

    def _check_part(self, header: PartHeader) -> Part:
        part = self.partition.part(self.me, header.index) if 0 <= header.index < self.num_parts else None
        if part is None:
            raise ValueError(f"part index {header.index} is outside this span's {self.num_parts} parts")
        dtype = dtype_name(self.partition.dtype(part))
        if header.numel != part.numel or header.dtype != dtype:
            raise ValueError(
                f"part {header.index} has {header.numel} x {header.dtype}, expected "
                f"{part.numel} x {dtype}: do all peers use the same tensors, part_size_bytes "
                f"and compression?"
            )
        return part
