"""Butterfly all-reduce of one already-formed group: every peer averages one span of the vector.

Theory of operation
-------------------
The group's tensors form one vector (`partition.TensorPartition`), cut into one span per peer.
Peer j *reduces* span j: every *sender* streams its values of span j to peer j, part by part, over
one bidirectional RPC stream (`{prefix}/allreduce/1.0.0`, frames in `messages.py`), and peer j
answers each part on the same stream as soon as every live sender has contributed it, so sending,
reducing and answering overlap (pipelined, not span by span). A sender's own span never touches
the network: it is contributed and applied in place.

Modes: NODE sends and reduces; CLIENT sends and receives but reduces nothing (fraction 0; it never
accepts part streams, so it may sit behind NAT); AUX reduces only (weight 0, sends nothing,
receives nothing, its tensors are left alone).

Reduction: `acc += w * x` in float32 (float64 for float64 tensors), then `average = acc / sum(w)`
over the senders that contributed *that* part. A part that came uncompressed is answered with the
average itself, encoded once and shared by every recipient (so, with alpha = 1, all peers end
bit-identical). A part that came lossily compressed is answered with `average - x~` where x~ is the
sender's part as the reducer decoded it, compressed again: the sender's own compression error
cancels and only the difference carries new error (parameters that already agree stay
untouched). The sender applies `tensor += alpha * (average - tensor)`. A part whose contributors
all have weight 0 has no average and is answered KEEP.

Fault tolerance (the per-part rule):
  * The answer to part k is the weighted average over exactly the senders that contributed part k
    before it completed; it is the same for everyone who receives it.
  * Every sender that receives an answer applies it. A sender that does not receive it keeps its
    own local values for that part and for every later part of that span: on every peer, each part
    ends either averaged (identical on all peers that have it) or local, and within a span the
    averaged parts are a prefix.
  * Reducer side, `sender_timeout`: a sender that has not opened its stream within sender_timeout
    of the round's start, or owes the reducer its next part for sender_timeout (time held back by
    the window does not count), is excluded from the rest of the round. So is a sender that sends
    garbage (a malformed header or buffer, a part of the wrong index, size or dtype, NaN/inf when
    `reject_nonfinite`), or whose stream breaks. Its contributions to parts that are not yet
    complete stay in (they are valid data; the part's average is over its contributors,
    including it); later parts are averaged over the others. The excluded sender gets an error
    naming the reason, and keeps its local values from the first unanswered part on.
  * Sender side, `reducer_timeout` (must exceed sender_timeout): a reducer that fails to answer
    the next part within reducer_timeout, refuses the stream, or whose stream breaks, fails its
    span: the parts already answered stay applied, the rest keep local values, and `run()` reports
    the span in `AllReduceReport.failed_spans`.
  * Memory is bounded: a reducer reads a sender's next part only inside the window of parts past
    the completion frontier, and only while that sender has fewer than `window` answers waiting
    to be written to it.

The bookkeeping (who has sent what, who is excluded, the completion frontier and window, whose
clock runs) is `reducer_core.ReducerCore`, sans-I/O, described there; this module is the asyncio
driver, `AllReduceRunner`, and the stream router, `AllReduceRouter`. Left out: retries (the
averager retries a round), checking the group's schema (the averager's matchmaking does that).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional, Sequence

import torch

from ..compression import CompressionBase, CompressionError, CompressionInfo, CompressionType, NoCompression
from ..compression.base import tensor_bytes_view
from ..compression.wire import dtype_name
from ..p2p import rpc
from ..p2p.host import Host
from ..p2p.identity import PeerID
from ..p2p.messages import MessageError
from ..utils.logging import get_logger
from .messages import AnswerHeader, AnswerKind, PartHeader, decode_tensor, encode_tensor
from .partition import DEFAULT_PART_SIZE_BYTES, Part, TensorPartition, spans_from_fractions
from .reducer_core import ReducerCore

logger = get_logger(__name__)

DEFAULT_PROTOCOL_PREFIX = "/plexus/averaging"
DEFAULT_WINDOW = 4  # parts in flight per span and sender: 4 MiB each at the default part size
DEFAULT_MAX_FRAME_BYTES = 64 << 20
FRAME_OVERHEAD_BYTES = 4096  # codebooks, per-block scales: room above numel * 8 bytes


def allreduce_protocol(protocol_prefix: str = DEFAULT_PROTOCOL_PREFIX) -> str:
    return f"{protocol_prefix}/allreduce/1.0.0"


class AveragingMode(enum.Enum):
    NODE = 0  # sends its tensors and reduces its span
    CLIENT = 1  # sends and receives, reduces nothing, accepts no streams
    AUX = 2  # reduces only: weight 0, sends nothing, receives nothing


class AllReduceError(Exception):
    """The all-reduce could not run as configured (the caller's fault; the message says what)."""


class SenderExcluded(Exception):
    """A reducer excluded a sender from the rest of the round; the text says why (sent to it)."""


EXCLUDED_YOU = "excluded you from all-reduce"
"""Begins the error text a reducer sends a sender it went on without (the others' round goes on)."""


@dataclass(frozen=True)
class SpanFailure:
    """A span this peer sent but did not get fully averaged back; parts from `parts_received` on
    kept their local values."""

    reducer: PeerID
    parts_received: int
    parts_total: int
    reason: str
    excluded: bool = False
    """The reducer went on without us (it excluded this peer): the others got its whole span."""


@dataclass
class AllReduceReport:
    """What happened in one round, from this peer's side."""

    failed_spans: list[SpanFailure] = field(default_factory=list)
    excluded_senders: dict[PeerID, str] = field(default_factory=dict)  # by this peer's reducer

    @property
    def complete(self) -> bool:
        return not self.failed_spans and not self.excluded_senders


# --- the driver ---------------------------------------------------------------------------------


@dataclass
class _PartState:
    acc: torch.Tensor
    total_weight: float = 0.0
    # lossy senders' parts as received (header, buffer): x~ is decoded again for the delta answer,
    # which keeps 2 bytes per element (float16) in flight instead of 4
    received: dict[int, tuple] = field(default_factory=dict)


class _Channel:
    """One remote sender's stream at this reducer: answers waiting to be written, its reader."""

    def __init__(self, stream):
        self.stream = stream
        self.answers: deque = deque()
        self.wake = asyncio.Event()
        self.closed = False
        self.finished = asyncio.Event()
        self.reader: Optional[asyncio.Task] = None

    def push(self, item) -> None:
        self.answers.append(item)
        self.wake.set()

    def close(self) -> None:
        self.closed = True
        self.wake.set()


class AllReduceRunner:
    """One round of butterfly all-reduce in an already-formed group (see the module comment).

    Args:
        host: this peer's started Host.
        group_id: the group's id, agreed in matchmaking (1 to 64 bytes).
        tensors: local tensors, averaged in place (contiguous, floating; same shapes on all peers).
        outputs: if given, results go there instead and `tensors` are only read; parts that get
            no result (KEEP, failed spans, an AUX peer's) get the local values copied there.
        ordered_peer_ids: the group in its agreed order; includes this host's peer id.
        peer_fractions: the share of the vector each peer reduces (0 for CLIENT peers).
        modes: one AveragingMode per peer (default: all NODE).
        weight: this peer's weight in the average (ignored, taken as 0, for AUX).
        compression: how parts and answers are encoded on the wire.
        part_size_bytes: the most wire bytes per part (by the compression's estimate).
        sender_timeout: how long a reducer waits for a sender's next part before excluding it.
        reducer_timeout: how long a sender waits for a reducer's next answer; > sender_timeout.
        protocol_prefix: protocol ids are `{protocol_prefix}/allreduce/1.0.0`.
        averaging_alpha: tensor += alpha * (average - tensor).
        reject_nonfinite: exclude senders whose parts hold NaN or inf.
        tensor_infos: one CompressionInfo per tensor (keys, roles) for adaptive compression.
        window: parts a reducer may hold in flight per span, and answers per sender.

    A reducing runner (NODE or AUX with a non-empty span) must be registered with the host's
    `AllReduceRouter` before `run()`, so that senders' streams reach it.
    """

    def __init__(self, host: Host, group_id: bytes, tensors: Sequence[torch.Tensor],
                 ordered_peer_ids: Sequence[PeerID], peer_fractions: Sequence[float],
                 modes: Optional[Sequence[AveragingMode]] = None, weight: float = 1.0,
                 compression: CompressionBase = NoCompression(), part_size_bytes: int = DEFAULT_PART_SIZE_BYTES,
                 sender_timeout: float = 10.0, reducer_timeout: float = 20.0,
                 protocol_prefix: str = DEFAULT_PROTOCOL_PREFIX, *, averaging_alpha: float = 1.0,
                 reject_nonfinite: bool = False, tensor_infos: Optional[Sequence[CompressionInfo]] = None,
                 window: int = DEFAULT_WINDOW, outputs: Optional[Sequence[torch.Tensor]] = None):
        peers = list(ordered_peer_ids)
        modes = list(modes) if modes is not None else [AveragingMode.NODE] * len(peers)
        if len(set(peers)) != len(peers):
            raise AllReduceError("ordered_peer_ids has duplicates")
        if host.peer_id not in peers:
            raise AllReduceError(f"this host ({host.peer_id}) is not in the group {[p.short() for p in peers]}")
        if not len(peers) == len(peer_fractions) == len(modes):
            raise AllReduceError(f"{len(peers)} peers, {len(peer_fractions)} fractions and {len(modes)} modes differ")
        for peer, fraction, mode in zip(peers, peer_fractions, modes):
            if mode == AveragingMode.CLIENT and fraction != 0:
                raise AllReduceError(f"CLIENT peer {peer.short()} has fraction {fraction}; clients reduce nothing")
        if not 0 < sender_timeout < reducer_timeout:
            raise AllReduceError(f"need 0 < sender_timeout ({sender_timeout}) < reducer_timeout ({reducer_timeout}): "
                                 "a reducer may wait sender_timeout for a slow sender before it can answer")
        if not isinstance(group_id, bytes) or not 0 < len(group_id) <= 64:
            raise AllReduceError(f"group_id must be 1 to 64 bytes, got {group_id!r}")
        self.host, self.group_id, self.peers, self.modes = host, group_id, peers, modes
        self.me = peers.index(host.peer_id)
        self.mode = modes[self.me]
        self.weight = 0.0 if self.mode == AveragingMode.AUX else float(weight)
        if not self.weight >= 0 or self.weight == float("inf"):
            raise AllReduceError(f"weight must be finite and >= 0, got {weight}")
        self.compression, self.alpha, self.reject_nonfinite = compression, averaging_alpha, reject_nonfinite
        self.sender_timeout, self.reducer_timeout, self.window = sender_timeout, reducer_timeout, window
        self.protocol = allreduce_protocol(protocol_prefix)
        total = sum(t.numel() for t in tensors)
        spans = spans_from_fractions(total, list(peer_fractions))
        self.partition = TensorPartition(tensors, spans, compression, part_size_bytes, tensor_infos, outputs)
        self.senders = [i for i, mode in enumerate(modes) if mode != AveragingMode.AUX]
        self.is_sender = self.mode != AveragingMode.AUX
        self.num_parts = self.partition.num_parts(self.me)
        self.max_frame_bytes = max(
            [self.partition.max_part_numel(i) for i in range(len(peers))], default=0) * 8 + FRAME_OVERHEAD_BYTES
        self.report = AllReduceReport()
        self._started = asyncio.Event()
        self._reduced = asyncio.Event()
        self._progress = asyncio.Event()
        self._core: Optional[ReducerCore] = None
        self._states: dict[int, _PartState] = {}
        self._channels: dict[int, _Channel] = {}
        self._applied = [0] * len(peers)  # per span: how many of its first parts have their result in place
        self._tasks: set[asyncio.Task] = set()
        self._ran = False

    @property
    def is_reducing(self) -> bool:
        return self.num_parts > 0

    def __repr__(self) -> str:
        return (f"<AllReduceRunner group {self.group_id.hex()[:8]} peer {self.me}/{len(self.peers)} "
                f"{self.mode.name} {self._core!r}>")

    # --- the round ---------------------------------------------------------------------------------

    async def run(self) -> AllReduceReport:
        """Average the tensors in place; returns what failed (nothing, normally). Cancel it (or
        wrap it in asyncio.timeout) to bound the whole round."""
        if self._ran:
            raise AllReduceError("an AllReduceRunner runs once; make a new one for the next round")
        self._ran = True
        loop = asyncio.get_running_loop()
        self._core = ReducerCore(self.num_parts, self.senders, window=self.window, sender_timeout=self.sender_timeout,
                                 now=loop.time(), exempt=[self.me])
        self._started.set()
        background = []
        if self.is_reducing:
            background.append(self._spawn(self._watchdog()))
            if self.is_sender:
                background.append(self._spawn(self._contribute_local()))
            if self._core.done:
                self._reduced.set()
        exchanges = []
        if self.is_sender:
            exchanges = [self._spawn(self._exchange(j)) for j in range(len(self.peers))
                         if j != self.me and self.partition.num_parts(j) > 0]
        try:
            await asyncio.gather(*exchanges)
            if self.is_reducing:
                await self._reduced.wait()
                await self._flush_answers(loop.time() + self.sender_timeout)
        finally:
            for task in list(self._tasks):
                task.cancel()
            for channel in self._channels.values():
                if not channel.finished.is_set():
                    channel.stream.reset()
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if not self.partition.in_place:
            for j, applied in enumerate(self._applied):
                for index in range(applied, self.partition.num_parts(j)):
                    self.partition.keep(self.partition.part(j, index))
        for index, reason in sorted(self._core.excluded.items()):
            self.report.excluded_senders[self.peers[index]] = reason
        if not self.report.complete:
            logger.warning(f"all-reduce {self.group_id.hex()[:8]}: {len(self.report.failed_spans)} span(s) failed, "
                           f"{len(self.report.excluded_senders)} sender(s) excluded")
        return self.report

    def _spawn(self, coroutine) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _flush_answers(self, deadline: float) -> None:
        """Wait (until `deadline`) for every live sender's answers to be written."""
        pending = [c.finished.wait() for c in self._channels.values() if not c.finished.is_set()]
        if pending:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(deadline):
                    await asyncio.gather(*pending)

    # --- sender side -------------------------------------------------------------------------------

    async def _exchange(self, j: int) -> None:
        """Send span j to reducer j and apply its answers as they come."""
        peer, total, received = self.peers[j], self.partition.num_parts(j), 0
        responses = rpc.call_stream(self.host, peer, self.protocol, self._part_frames(j), rpc.Chunks,
                                    max_message_size=self.max_frame_bytes)
        try:
            while received < total:
                part = self.partition.part(j, received)
                async with asyncio.timeout(self.reducer_timeout):
                    header = AnswerHeader.decode(b"".join(await anext(responses)))
                    self._check_answer(header, part)
                    chunks = await anext(responses) if header.kind != AnswerKind.KEEP else None
                self._apply_answer(part, header, chunks)
                received = self._applied[j] = received + 1
            async with asyncio.timeout(self.reducer_timeout):
                if await anext(responses, None) is not None:
                    raise rpc.RPCProtocolError("reducer sent more answers than parts")
        except asyncio.CancelledError:
            raise
        except Exception as error:
            if isinstance(error, TimeoutError):
                reason = f"no answer within reducer_timeout={self.reducer_timeout}s"
            elif isinstance(error, StopAsyncIteration):
                reason = "the reducer closed the stream early"
            else:
                reason = f"{type(error).__name__}: {error}"
            logger.warning(f"all-reduce {self.group_id.hex()[:8]}: span of {peer.short()} failed after {received} "
                           f"of {total} parts ({reason}); keeping local values for the rest of it")
            excluded = isinstance(error, rpc.RPCError) and str(error).startswith(EXCLUDED_YOU)
            self.report.failed_spans.append(SpanFailure(peer, received, total, reason, excluded))
        finally:
            await responses.aclose()

    async def _part_frames(self, j: int) -> AsyncIterator:
        for part in self.partition.parts(j):
            view = self.partition.view(part)
            dtype, compression, buffer = encode_tensor(view, self.partition.compression_info(part), self.compression)
            first = part.index == 0
            header = PartHeader(part.index, part.numel, dtype, compression,
                                self.group_id if first else None, self.weight if first else None)
            yield header.encode()
            yield buffer
            del buffer  # sent: let it go before the next part is encoded

    def _check_answer(self, header: AnswerHeader, part: Part) -> None:
        expected = dtype_name(self.partition.dtype(part))
        if header.index != part.index or header.numel != part.numel or header.dtype != expected:
            raise rpc.RPCProtocolError(f"answer for part {header.index} ({header.numel} x {header.dtype}) does not "
                                       f"match part {part.index} ({part.numel} x {expected})")

    def _apply_answer(self, part: Part, header: AnswerHeader, chunks: Optional[list]) -> None:
        if header.kind == AnswerKind.KEEP:
            self.partition.keep(part)
            return
        target = self.partition.output(part)
        if (header.kind == AnswerKind.AVERAGE and header.compression == CompressionType.NONE and self.alpha == 1.0
                and target.device.type == "cpu"):  # the average itself: copy the received bytes straight in
            destination = tensor_bytes_view(target)
            if sum(map(len, chunks)) != len(destination):
                raise rpc.RPCProtocolError(f"answer for part {part.index} has {sum(map(len, chunks))} bytes, "
                                           f"expected {len(destination)}")
            offset = 0
            for chunk in chunks:
                destination[offset : offset + len(chunk)] = chunk
                offset += len(chunk)
            return
        values = decode_tensor(header.numel, header.dtype, header.compression, b"".join(chunks))
        if header.kind == AnswerKind.AVERAGE:
            self.partition.apply_average(part, values, self.alpha)
        else:
            self.partition.apply_delta(part, values, self.alpha)

    # --- reducer side: contributions -------------------------------------------------------------

    def _notify(self) -> None:
        self._progress.set()
        self._progress = asyncio.Event()

    async def _wait_until(self, predicate) -> None:
        while not predicate():
            await self._progress.wait()

    async def _contribute_local(self) -> None:
        for index in range(self.num_parts):
            await self._wait_until(lambda: self._core.allowed(self.me) or self.me not in self._core.live)
            if self.me not in self._core.live:
                return
            part = self.partition.part(self.me, index)
            self._contribute(self.me, part, self.partition.view(part).cpu(), self.weight)
            await asyncio.sleep(0)  # let the network make progress between parts

    def _contribute(self, sender: int, part: Part, values: torch.Tensor, weight: float,
                    lossy_wire: Optional[tuple] = None) -> None:
        state = self._states.get(part.index)
        if state is None:  # the first contribution starts the sum: one pass, no zero-filled accumulator
            acc_dtype = torch.float64 if values.dtype == torch.float64 else torch.float32
            acc = torch.mul(values, weight) if values.dtype == acc_dtype else values.to(acc_dtype).mul_(weight)
            state = self._states[part.index] = _PartState(acc)
        else:
            state.acc.add_(values, alpha=weight)
        state.total_weight += weight
        if lossy_wire is not None:
            state.received[sender] = lossy_wire
        self._on_complete(self._core.contribute(sender, part.index, asyncio.get_running_loop().time()))

    def _exclude(self, sender: int, reason: str) -> None:
        if sender not in self._core.live:
            return
        logger.warning(f"all-reduce {self.group_id.hex()[:8]}: excluding sender {self.peers[sender].short()}: {reason}")
        completed = self._core.exclude(sender, reason, asyncio.get_running_loop().time())
        channel = self._channels.get(sender)
        if channel is not None:
            channel.push(SenderExcluded(f"{EXCLUDED_YOU} {self.group_id.hex()[:8]} "
                                        f"({self.host.peer_id.short()}): {reason}"))
            channel.close()
            if channel.reader is not None and channel.reader is not asyncio.current_task():
                channel.reader.cancel()
        for state in self._states.values():
            state.received.pop(sender, None)
        self._on_complete(completed)

    async def _watchdog(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._core.done:
            for sender in self._core.expired(loop.time()):
                if sender in self._channels:
                    reason = f"sent no part for sender_timeout={self.sender_timeout}s"
                else:
                    reason = f"did not open its stream within sender_timeout={self.sender_timeout}s"
                self._exclude(sender, reason)
            deadline = self._core.next_deadline()
            progress = self._progress
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(deadline):
                    await progress.wait()

    # --- reducer side: answers -------------------------------------------------------------------

    def _on_complete(self, completed: range) -> None:
        for index in completed:
            self._answer(index)
        if completed:
            self._notify()
        if self._core.done and not self._reduced.is_set():
            self._reduced.set()
            for channel in self._channels.values():
                channel.close()

    def _answer(self, index: int) -> None:
        state = self._states.pop(index, None)
        part = self.partition.part(self.me, index)
        recipients = [s for s in sorted(self._core.live) if s != self.me and s in self._channels]
        dtype = self.partition.dtype(part)
        target = self.partition.output(part) if self.is_sender and self.me in self._core.live else None
        if target is not None:
            self._applied[self.me] = index + 1  # in place by the end of this call, or kept
        if state is None or state.total_weight <= 0:
            keep = AnswerHeader(index, AnswerKind.KEEP, part.numel, dtype_name(dtype), 0).encode()
            for sender in recipients:
                self._channels[sender].push((keep, None))
            if target is not None:
                self.partition.keep(part)
            return
        in_place = (target is not None and self.alpha == 1.0 and target.dtype == state.acc.dtype
                    and target.device.type == "cpu")  # the average is final for this round: shared from there
        total = state.total_weight
        average = torch.div(state.acc, total, out=target) if in_place else state.acc.div_(total)
        shared = None
        for sender in recipients:
            received = state.received.pop(sender, None)  # freed as its answer takes its place
            if received is None:
                if shared is None:
                    wire = average.to(dtype)
                    header = AnswerHeader(index, AnswerKind.AVERAGE, part.numel, dtype_name(dtype), 0)
                    shared = (header.encode(), tensor_bytes_view(wire))
                self._channels[sender].push(shared)
            else:
                sent_header, sent_buffer = received
                x_decoded = decode_tensor(sent_header.numel, sent_header.dtype, sent_header.compression, sent_buffer)
                delta = (average - x_decoded).to(dtype)
                info = self.partition.compression_info(part)
                name, compression, buffer = encode_tensor(delta, info, self.compression)
                header = AnswerHeader(index, AnswerKind.DELTA, part.numel, name, compression)
                self._channels[sender].push((header.encode(), buffer))
        if target is not None and not in_place:
            self.partition.apply_average(part, average, self.alpha)

    # --- reducer side: one sender's stream ---------------------------------------------------------

    async def serve_sender(self, stream, first: PartHeader, frames: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The reducer's side of one sender's stream: read its parts, yield the answer frames."""
        peer = stream.remote_peer
        sender = self.peers.index(peer) if peer in self.peers else None
        if sender is None or sender == self.me or self.modes[sender] == AveragingMode.AUX:
            raise SenderExcluded(f"{peer.short()} is not a sender of all-reduce {self.group_id.hex()[:8]}")
        if not self.is_reducing:
            raise SenderExcluded(f"{self.host.peer_id.short()} reduces no part of all-reduce {self.group_id.hex()[:8]}")
        try:
            async with asyncio.timeout(self.sender_timeout):
                await self._started.wait()
        except TimeoutError:
            raise SenderExcluded("this peer has not started the round; is the group id stale?") from None
        if sender in self._core.excluded:
            raise SenderExcluded(f"{EXCLUDED_YOU} {self.group_id.hex()[:8]}: {self._core.excluded[sender]}")
        if sender in self._channels:
            raise SenderExcluded("a second stream from the same sender; one per reducer and round")
        channel = self._channels[sender] = _Channel(stream)
        channel.reader = self._spawn(self._read_parts(sender, first, frames))
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

    async def _read_parts(self, sender: int, header: Optional[PartHeader], frames: AsyncIterator[bytes]) -> None:
        weight, received = header.weight, 0
        try:
            if weight is None:
                raise ValueError("the first part header must carry group_id and weight")
            while received < self.num_parts:
                channel = self._channels[sender]
                await self._wait_until(lambda: sender not in self._core.live
                                       or self._core.allowed(sender) and len(channel.answers) < self.window)
                if sender not in self._core.live:
                    return
                if header is None:
                    raw = await anext(frames, None)
                    if raw is None:
                        raise ValueError(f"stream ended after {received} of {self.num_parts} parts")
                    header = PartHeader.decode(raw)
                    if header.group_id is not None:
                        raise ValueError(f"part {header.index} repeats group_id/weight; only the first part has them")
                buffer = await anext(frames, None)
                if buffer is None:
                    raise ValueError(f"stream ended before the buffer of part {header.index}")
                part = self._check_part(header)
                values = decode_tensor(header.numel, header.dtype, header.compression, buffer)
                if self.reject_nonfinite and not bool(torch.isfinite(values).all()):
                    raise ValueError(f"part {part.index} holds NaN or inf values")
                lossy = header.compression != CompressionType.NONE
                self._contribute(sender, part, values, weight, (header, buffer) if lossy else None)
                received, header, buffer, values = received + 1, None, None, None  # added: not held while waiting
        except asyncio.CancelledError:
            raise
        except (ValueError, MessageError, CompressionError, rpc.RPCProtocolError, ConnectionError,
                asyncio.IncompleteReadError) as error:
            plain = type(error) is ValueError  # our own checks: the message says it all
            self._exclude(sender, str(error) if plain else f"{type(error).__name__}: {error}")

    def _check_part(self, header: PartHeader) -> Part:
        part = self.partition.part(self.me, header.index) if 0 <= header.index < self.num_parts else None
        if part is None:
            raise ValueError(f"part index {header.index} is outside this span's {self.num_parts} parts")
        dtype = dtype_name(self.partition.dtype(part))
        if header.numel != part.numel or header.dtype != dtype:
            raise ValueError(f"part {header.index} has {header.numel} x {header.dtype}, expected {part.numel} x "
                             f"{dtype}: do all peers use the same tensors, part_size_bytes and compression?")
        return part


# --- routing incoming streams to runners ----------------------------------------------------------


class AllReduceRouter:
    """Serves `{prefix}/allreduce/1.0.0` on a host and hands each sender's stream to the runner of
    its group (by the group_id in the stream's first header).

    A stream may arrive a little before its group's runner is registered (the sender learned of
    the group first); it waits up to `registration_timeout` for it, then gets an error. At most
    `max_waiting_streams` streams wait at once.
    """

    def __init__(self, host: Host, protocol_prefix: str = DEFAULT_PROTOCOL_PREFIX, *,
                 registration_timeout: float = 5.0, max_waiting_streams: int = 256,
                 max_message_size: int = DEFAULT_MAX_FRAME_BYTES):
        self.host, self.protocol = host, allreduce_protocol(protocol_prefix)
        self.registration_timeout, self.max_waiting_streams = registration_timeout, max_waiting_streams
        self.max_message_size = max_message_size
        self._runners: dict[bytes, AllReduceRunner] = {}
        self._registered = asyncio.Event()
        self._waiting = 0
        rpc.add_handler(host, self.protocol, self._handle, bytes, bytes, stream_input=True, stream_output=True,
                        max_message_size=max_message_size)

    def close(self) -> None:
        self.host.remove_stream_handler(self.protocol)

    @contextlib.contextmanager
    def register(self, runner: AllReduceRunner):
        """Route the runner's group to it while the `with` block runs."""
        if runner.max_frame_bytes > self.max_message_size:
            raise AllReduceError(f"parts of up to {runner.max_frame_bytes} bytes exceed this router's "
                                 f"max_message_size={self.max_message_size}; lower part_size_bytes")
        if runner.group_id in self._runners:
            raise AllReduceError(f"group {runner.group_id.hex()} already has a runner on this host")
        self._runners[runner.group_id] = runner
        self._registered.set()
        self._registered = asyncio.Event()
        try:
            yield runner
        finally:
            del self._runners[runner.group_id]

    async def _find(self, group_id: bytes) -> AllReduceRunner:
        if group_id not in self._runners:
            if self._waiting >= self.max_waiting_streams:
                raise SenderExcluded("too many streams waiting for their group; try again later")
            self._waiting += 1
            try:
                while group_id not in self._runners:
                    await self._registered.wait()
            finally:
                self._waiting -= 1
        return self._runners[group_id]

    async def _handle(self, frames: AsyncIterator[bytes], context: rpc.RPCContext) -> AsyncIterator[bytes]:
        try:
            async with asyncio.timeout(self.registration_timeout):
                raw = await anext(frames, None)
                if raw is None:
                    raise SenderExcluded("empty all-reduce stream")
                header = PartHeader.decode(raw)
                if header.group_id is None:
                    raise SenderExcluded("the first part header must carry the group_id")
                runner = await self._find(header.group_id)
        except TimeoutError:
            raise SenderExcluded("no all-reduce for this group here: this peer is not in it, or it already "
                                 f"finished (waited {self.registration_timeout}s)") from None
        async for frame in runner.serve_sender(context.stream, header, frames):
            yield frame
