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

Weights: a reducer reads no part before every live sender has opened its stream (or was excluded),
then bounds each stated weight (`aggregation.bounded_weights`: a caller's per-peer limit, and
`max_weight_ratio` x the group's lower-median weight), the same way on every reducer; in robust
mode every member of positive weight counts once.

Reduction: `acc += w * x` in float32 (float64 for float64 tensors), then `average = acc / sum(w)`
over the senders that contributed *that* part; or, with `robust`, the CenteredClip of their
values (`aggregation.ClippedPart`). A part that came uncompressed is answered with the average
itself, encoded once and shared by every recipient (so, with alpha = 1, all peers end
bit-identical). A part that came lossily compressed is answered with `average - x~` where x~ is
the sender's part as the reducer decoded it, compressed again: the sender's own compression error
cancels and only the difference carries new error (parameters that already agree stay
untouched). The sender applies `tensor += alpha * (average - tensor)`. A part whose contributors
all have weight 0 (in robust mode: fewer than `min_contributors` of positive weight) has no
average and is answered KEEP.

Verification (`robust.verify`): after the last part every reducer checks the others' spans
(`verification.py`: seeds, scalar reports and verdicts travel on the same streams), and a part that
most verifiers reject keeps its local values everywhere. Verifying needs the sent values after
the round, so without `outputs` the runner keeps its results in a copy until the verdicts are in.

Fault tolerance (the per-part rule):
  * The answer to part k is the weighted average over exactly the senders that contributed part k
    before it completed; it is the same for everyone who receives it.
  * Every sender that receives an answer applies it. A sender that does not receive it keeps its
    own local values for that part and for every later part of that span: on every peer, each part
    ends either averaged (identical on all peers that have it) or local, and within a span the
    averaged parts are a prefix (verification may then discard single parts).
  * Reducer side, `sender_timeout`: a sender that has not opened its stream within sender_timeout
    of the round's start, or owes the reducer its next part for sender_timeout (time held back by
    the window, or by waiting for the other senders' streams, does not count), is excluded from the
    rest of the round. So is a sender that sends garbage (a malformed header or buffer, a part of
    the wrong index, size or dtype, NaN/inf when `reject_nonfinite`, the default), or whose stream
    breaks; and the reducer's own values, if they are not finite (it keeps them, and averages its
    span over the others). Its contributions to parts that are not yet complete stay in (they are
    valid data; the part's average is over its contributors, including it), except in robust mode,
    where they are taken out again; later parts are averaged over the others. The excluded sender
    gets an error naming the reason, and keeps its local values from the first unanswered part on.
  * Sender side, `reducer_timeout` (must exceed sender_timeout): a reducer that fails to answer
    the next part within reducer_timeout, refuses the stream, answers NaN or inf (with
    `reject_nonfinite`), or whose stream breaks, fails its span: the parts already answered stay
    applied, the rest keep local values, and `run()` reports the span in
    `AllReduceReport.failed_spans`.
  * Memory is bounded: a reducer reads a sender's next part only inside the window of parts past
    the completion frontier, and only while that sender has fewer than `window` answers waiting
    to be written to it.

The bookkeeping (who has sent what, who is excluded, the completion frontier and window, whose
clock runs) is `reducer_core.ReducerCore`, sans-I/O, described there; this module is the asyncio
driver, `AllReduceRunner` (the round and its sender side; the reducer side is
`reducer.SpanReducer`), and the stream router, `AllReduceRouter`. Two public methods are a seam for
tests that play a faulty member: `outgoing` (what this peer sends for a part) and `reduced` (what
it answers). Left out: retries (the averager retries a round), checking the group's schema (the
averager's matchmaking does that).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..compression import CompressionBase, CompressionInfo, CompressionType, NoCompression
from ..compression.base import tensor_bytes_view
from ..compression.wire import dtype_name
from ..errors import PeerError
from ..p2p import rpc
from ..p2p.host import Host
from ..p2p.identity import PeerID
from ..utils.logging import get_logger
from .aggregation import DEFAULT_MAX_WEIGHT_RATIO, RobustAggregation
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
from .partition import DEFAULT_PART_SIZE_BYTES, Part, TensorPartition, spans_from_fractions
from .reducer import EXCLUDED_YOU, SenderExcluded, SpanReducer, log_peer_fault
from .verification import PART_FIELDS, PartPrecision, direction, discarded_parts, encode_report, part_row

logger = get_logger(__name__)

DEFAULT_PROTOCOL_PREFIX = "/plexus/averaging"
DEFAULT_WINDOW = 4  # parts in flight per span and sender: 4 MiB each at the default part size
DEFAULT_MAX_FRAME_BYTES = 64 << 20
FRAME_OVERHEAD_BYTES = 4096  # codebooks, per-block scales: room above numel * 8 bytes


def allreduce_protocol(protocol_prefix: str = DEFAULT_PROTOCOL_PREFIX) -> str:
    return f"{protocol_prefix}/allreduce/1.0.0"


class AveragingMode(enum.Enum):
    """What a member does in a round: a full node, a client (behind NAT) or an auxiliary reducer."""

    NODE = 0  # sends its tensors and reduces its span
    CLIENT = 1  # sends and receives, reduces nothing, accepts no streams
    AUX = 2  # reduces only: weight 0, sends nothing, receives nothing


class AllReduceError(PeerError):
    """The all-reduce could not run as configured (the caller's fault; the message says what)."""


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
    discarded_parts: dict[PeerID, list[int]] = field(default_factory=dict)  # by reducer: failed verification

    @property
    def complete(self) -> bool:
        return not self.failed_spans and not self.excluded_senders and not self.discarded_parts


# --- the driver ---------------------------------------------------------------------------------


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
        averaging_alpha: tensor += alpha * (average - tensor); must be 1 to verify reducers.
        reject_nonfinite: exclude senders whose parts hold NaN or inf, and fail spans whose reducer
            answers NaN or inf (default True).
        tensor_infos: one CompressionInfo per tensor (keys, roles) for adaptive compression.
        window: parts a reducer may hold in flight per span, and answers per sender.
        robust: CenteredClip per part, and verification of the reducers (None: the plain mean).
        weight_limits: the most weight each peer may carry (e.g. what its progress record
            justifies); peers not named are bounded only by `max_weight_ratio`.
        max_weight_ratio: no weight counts for more than this many times the group's lower-median
            positive weight. Robust rounds ignore both: every member of positive weight counts once.
        shared_lossy_answers: a reducer answers lossily compressed parts with the compressed
            average itself, the same message for every member, and applies what it decodes to
            its own tensors too: every member ends with the same values, and each keeps its own
            compression error (see `residuals`) instead of having it cancelled. For averaging
            updates (DiLoCo's pseudo-gradients) rather than parameters. Not with `robust.verify`.
        residuals: tensors like `tensors`; each part this peer sends lossily gets what the
            compression lost of it (sent values minus what the reducer decodes), the rest zeros.

    A reducing runner (NODE or AUX with a non-empty span) must be registered with the host's
    `AllReduceRouter` before `run()`, so that senders' streams reach it.
    """

    def __init__(
        self,
        host: Host,
        group_id: bytes,
        tensors: Sequence[torch.Tensor],
        ordered_peer_ids: Sequence[PeerID],
        peer_fractions: Sequence[float],
        modes: Sequence[AveragingMode] | None = None,
        weight: float = 1.0,
        compression: CompressionBase = NoCompression(),
        part_size_bytes: int = DEFAULT_PART_SIZE_BYTES,
        sender_timeout: float = 10.0,
        reducer_timeout: float = 20.0,
        protocol_prefix: str = DEFAULT_PROTOCOL_PREFIX,
        *,
        averaging_alpha: float = 1.0,
        reject_nonfinite: bool = True,
        tensor_infos: Sequence[CompressionInfo] | None = None,
        window: int = DEFAULT_WINDOW,
        outputs: Sequence[torch.Tensor] | None = None,
        robust: RobustAggregation | None = None,
        weight_limits: Mapping[PeerID, float] | None = None,
        max_weight_ratio: float = DEFAULT_MAX_WEIGHT_RATIO,
        shared_lossy_answers: bool = False,
        residuals: Sequence[torch.Tensor] | None = None,
    ):
        peers = list(ordered_peer_ids)
        modes = list(modes) if modes is not None else [AveragingMode.NODE] * len(peers)
        if len(set(peers)) != len(peers):
            raise AllReduceError("ordered_peer_ids has duplicates")
        if host.peer_id not in peers:
            raise AllReduceError(
                f"this host ({host.peer_id}) is not in the group {[p.short() for p in peers]}"
            )
        if not len(peers) == len(peer_fractions) == len(modes):
            raise AllReduceError(
                f"{len(peers)} peers, {len(peer_fractions)} fractions and {len(modes)} modes differ"
            )
        for peer, fraction, mode in zip(peers, peer_fractions, modes):
            if mode == AveragingMode.CLIENT and fraction != 0:
                raise AllReduceError(
                    f"CLIENT peer {peer.short()} has fraction {fraction}; clients reduce nothing"
                )
        if not 0 < sender_timeout < reducer_timeout:
            raise AllReduceError(
                f"need 0 < sender_timeout ({sender_timeout}) < reducer_timeout ({reducer_timeout}): "
                "a reducer may wait sender_timeout for a slow sender before it can answer"
            )
        if not isinstance(group_id, bytes) or not 0 < len(group_id) <= 64:
            raise AllReduceError(f"group_id must be 1 to 64 bytes, got {group_id!r}")
        if not max_weight_ratio >= 1:
            raise AllReduceError(f"max_weight_ratio must be at least 1, got {max_weight_ratio}")
        self.host, self.group_id, self.peers, self.modes = host, group_id, peers, modes
        self.me = peers.index(host.peer_id)
        self.mode = modes[self.me]
        self.weight = 0.0 if self.mode == AveragingMode.AUX else float(weight)
        if not self.weight >= 0 or self.weight == float("inf"):
            raise AllReduceError(f"weight must be finite and >= 0, got {weight}")
        self.compression, self.alpha, self.reject_nonfinite = compression, averaging_alpha, reject_nonfinite
        self.sender_timeout, self.reducer_timeout, self.window = sender_timeout, reducer_timeout, window
        self.robust = robust
        self.verifying = robust is not None and robust.verify
        if self.verifying and averaging_alpha != 1.0:
            raise AllReduceError(
                f"verifying reducers needs averaging_alpha=1 (got {averaging_alpha}): "
                "members check the result they applied against what they sent"
            )
        if shared_lossy_answers and self.verifying:
            raise AllReduceError("shared_lossy_answers cannot be verified: members keep their own errors")
        if residuals is not None and [r.shape for r in residuals] != [t.shape for t in tensors]:
            raise AllReduceError("residuals must have the shapes of the tensors")
        self.shared_lossy_answers = shared_lossy_answers
        self.residuals = [residual.view(-1) for residual in residuals] if residuals is not None else None
        if self.residuals is not None:
            for residual in self.residuals:
                residual.zero_()
        self.max_weight_ratio = max_weight_ratio
        self.weight_limits = {
            peers.index(peer): float(limit) for peer, limit in (weight_limits or {}).items() if peer in peers
        }
        self.protocol = allreduce_protocol(protocol_prefix)
        self._results_copy = None  # verifying in place: (tensors, where the results wait for the verdicts)
        if self.verifying and outputs is None and self.mode != AveragingMode.AUX:
            outputs = [torch.empty_like(tensor, memory_format=torch.contiguous_format) for tensor in tensors]
            self._results_copy = (list(tensors), outputs)
        total = sum(t.numel() for t in tensors)
        spans = spans_from_fractions(total, list(peer_fractions))
        self.partition = TensorPartition(tensors, spans, compression, part_size_bytes, tensor_infos, outputs)
        self.senders = [i for i, mode in enumerate(modes) if mode != AveragingMode.AUX]
        self.is_sender = self.mode != AveragingMode.AUX
        self.num_parts = self.partition.num_parts(self.me)
        span_parts = [self.partition.num_parts(i) for i in range(len(peers))]
        largest = max([self.partition.max_part_numel(i) for i in range(len(peers))], default=0)
        self.max_frame_bytes = 8 * largest
        if self.verifying:  # a report: one row per part of the vector; a verdict: an index per part
            self.max_frame_bytes = max(self.max_frame_bytes, sum(span_parts) * (8 * PART_FIELDS + 9))
        self.max_frame_bytes += FRAME_OVERHEAD_BYTES
        self.report = AllReduceReport()
        self.reducer = SpanReducer(self) if self.is_reducing else None
        self._answers_in = asyncio.Event()  # every answer this peer waits for is in, its own span's too
        self._applied = [0] * len(peers)  # per span: how many of its first parts have their result in place
        self._exchanges_left = 0
        # verification: per span, the radius of each applied part (0: KEEP), and the weight we were given
        self._answered: list[list[float]] = [[] for _ in peers]
        self._weight_given: list[float] = [0.0] * len(peers)
        self._reports: dict[int, asyncio.Future] = {}  # span -> our report for its reducer (None: none)
        self._verdicts: dict[int, list] = {}  # verifier -> its bad parts per span
        self._tasks: set[asyncio.Task] = set()
        self._ran = False

    @property
    def is_reducing(self) -> bool:
        return self.num_parts > 0

    def __repr__(self) -> str:
        return (
            f"<AllReduceRunner group {self.group_id.hex()[:8]} peer {self.me}/{len(self.peers)} "
            f"{self.mode.name} {self.reducer!r}>"
        )

    # --- the seam for faulty members (tests) ---------------------------------------------------------

    def outgoing(self, part: Part, values: torch.Tensor) -> torch.Tensor:
        """What this peer contributes for `part`: its local values. Override to play a member that
        sends something else (NaN, scaled or flipped values); it must return the same shape and dtype."""
        return values

    def reduced(self, part: Part, average: torch.Tensor) -> torch.Tensor:
        """What this reducer answers for `part` of its span: the average. Override to play a
        reducer that answers wrongly."""
        return average

    # --- the round ---------------------------------------------------------------------------------

    async def run(self) -> AllReduceReport:
        """Average the tensors in place; returns what failed (nothing, normally). Cancel it (or
        wrap it in asyncio.timeout) to bound the whole round."""
        if self._ran:
            raise AllReduceError("an AllReduceRunner runs once; make a new one for the next round")
        self._ran = True
        loop = asyncio.get_running_loop()
        verification = None
        if self.reducer is not None:
            self.reducer.start(loop.time())
            if self.verifying:
                verification = self._spawn(self.reducer.verify_spans())
        exchanges = []
        if self.is_sender:
            exchanges = [
                self._spawn(self._exchange(j))
                for j in range(len(self.peers))
                if j != self.me and self.partition.num_parts(j) > 0
            ]
        self._exchanges_left = len(exchanges)
        self._check_answers_in()
        try:
            await asyncio.gather(*exchanges)
            if self.reducer is not None:
                await self.reducer.reduced.wait()
                if verification is not None:
                    await verification
                await self.reducer.flush_answers(loop.time() + self.sender_timeout)
        finally:
            for task in list(self._tasks):
                task.cancel()
            if self.reducer is not None:
                self.reducer.finish()
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._finish_results()
        if self.reducer is not None:
            for index, reason in sorted(self.reducer.core.excluded.items()):
                self.report.excluded_senders[self.peers[index]] = reason
        if not self.report.complete:
            report = self.report
            logger.warning(
                f"all-reduce {self.group_id.hex()[:8]}: {len(report.failed_spans)} span(s) "
                f"failed, {len(report.excluded_senders)} sender(s) excluded, parts of "
                f"{len(report.discarded_parts)} span(s) discarded"
            )
        return self.report

    def _finish_results(self) -> None:
        """Local values where no (verified) result came; verified results into the tensors."""
        if not self.partition.in_place:
            for j, applied in enumerate(self._applied):
                for index in range(applied, self.partition.num_parts(j)):
                    self.partition.keep(self.partition.part(j, index))
        if self.verifying and self.mode != AveragingMode.AUX:
            spans = [self.partition.num_parts(j) for j in range(len(self.peers))]
            verdicts = dict(self._verdicts)
            if self.reducer is not None and self.reducer.own_verdict is not None:
                verdicts[self.me] = self.reducer.own_verdict
            for span, parts in discarded_parts(verdicts, spans).items():
                for index in parts:
                    if index < self._applied[span]:
                        self.partition.keep(self.partition.part(span, index))
                self.report.discarded_parts[self.peers[span]] = parts
                log_peer_fault(
                    self.peers[span],
                    "discarded",
                    f"all-reduce {self.group_id.hex()[:8]}: "
                    f"discarding {len(parts)} part(s) reduced by {self.peers[span]}: most "
                    f"verifiers found them wrong",
                )
        if self._results_copy is not None:
            for tensor, result in zip(*self._results_copy):
                tensor.copy_(result)

    def _spawn(self, coroutine) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _check_answers_in(self) -> None:
        if self._exchanges_left == 0 and (self.reducer is None or self.reducer.reduced.is_set()):
            self._answers_in.set()

    # --- sender side -------------------------------------------------------------------------------

    async def _exchange(self, j: int) -> None:
        """Send span j to reducer j and apply its answers as they come (then verify it, if asked)."""
        peer, total, received = self.peers[j], self.partition.num_parts(j), 0
        self._reports[j] = asyncio.get_running_loop().create_future()
        responses = rpc.call_stream(
            self.host,
            peer,
            self.protocol,
            self._part_frames(j),
            rpc.Chunks,
            max_message_size=self.max_frame_bytes,
        )
        try:
            try:
                while received < total:
                    part = self.partition.part(j, received)
                    async with asyncio.timeout(self.reducer_timeout):
                        header = AnswerHeader.decode(b"".join(await anext(responses)))
                        self._check_answer(header, part)
                        chunks = await anext(responses) if header.kind != AnswerKind.KEEP else None
                    self._apply_answer(part, header, chunks)
                    self._record_answer(j, header)
                    received = self._applied[j] = received + 1
            finally:
                self._exchanges_left -= 1
                self._check_answers_in()
            if self.verifying:
                await self._verify_with(j, responses)
            async with asyncio.timeout(self.reducer_timeout):
                if await anext(responses, None) is not None:
                    raise rpc.RPCProtocolError("reducer sent more than the protocol allows")
        except asyncio.CancelledError:
            raise
        except Exception as error:
            if isinstance(error, TimeoutError):
                reason = f"no answer within reducer_timeout={self.reducer_timeout}s"
            elif isinstance(error, StopAsyncIteration):
                reason = "the reducer closed the stream early"
            else:
                reason = f"{type(error).__name__}: {error}"
            if received < total:
                log_peer_fault(
                    peer,
                    reason,
                    f"all-reduce {self.group_id.hex()[:8]}: span of {peer} failed "
                    f"after {received} of {total} parts ({reason}); keeping local values for "
                    f"the rest of it",
                )
                excluded = isinstance(error, rpc.RPCError) and str(error).startswith(EXCLUDED_YOU)
                self.report.failed_spans.append(SpanFailure(peer, received, total, reason, excluded))
            else:
                log_peer_fault(
                    peer,
                    "verify " + reason,
                    f"all-reduce {self.group_id.hex()[:8]}: could not "
                    f"verify with {peer} ({reason}); its verdict does not count",
                )
        finally:
            if not self._reports[j].done():
                self._reports[j].set_result(None)
            await responses.aclose()

    async def _part_frames(self, j: int) -> AsyncIterator:
        for part in self.partition.parts(j):
            view = self.outgoing(part, self.partition.view(part))
            dtype, compression, buffer = encode_tensor(
                view, self.partition.compression_info(part), self.compression
            )
            if self.residuals is not None and compression != CompressionType.NONE:
                decoded = decode_tensor(part.numel, dtype, compression, buffer)
                residual = self.residuals[part.tensor_index][part.start : part.stop]
                residual.copy_(view.detach().cpu().to(residual.dtype)).sub_(decoded.to(residual.dtype))
            first = part.index == 0
            header = PartHeader(
                part.index,
                part.numel,
                dtype,
                compression,
                self.group_id if first else None,
                self.weight if first else None,
            )
            yield header.encode()
            yield buffer
            del buffer  # sent: let it go before the next part is encoded
        if self.verifying:
            await self._answers_in.wait()
            yield VerifyDone().encode()
            report = await self._reports[j]
            if report is not None:
                yield report

    def _check_answer(self, header: AnswerHeader, part: Part) -> None:
        expected = dtype_name(self.partition.dtype(part))
        if header.index != part.index or header.numel != part.numel or header.dtype != expected:
            raise rpc.RPCProtocolError(
                f"answer for part {header.index} ({header.numel} x {header.dtype}) does not "
                f"match part {part.index} ({part.numel} x {expected})"
            )
        if self.verifying and header.kind != AnswerKind.KEEP and not header.radius:
            raise rpc.RPCProtocolError(f"answer for part {part.index} has no radius; is the reducer robust?")

    def _record_answer(self, j: int, header: AnswerHeader) -> None:
        if not self.verifying:
            return
        if header.index == 0:
            self._weight_given[j] = header.weight or 0.0
        self._answered[j].append(0.0 if header.kind == AnswerKind.KEEP else header.radius or 0.0)

    def _apply_answer(self, part: Part, header: AnswerHeader, chunks: list | None) -> None:
        if header.kind == AnswerKind.KEEP:
            self.partition.keep(part)
            return
        if chunks is None:
            raise rpc.RPCProtocolError(f"answer for part {part.index} came without its buffer")
        target = self.partition.output(part)
        checked_in_place = self.reject_nonfinite and self.partition.in_place  # no local copy to fall back on
        if (
            header.kind == AnswerKind.AVERAGE
            and header.compression == CompressionType.NONE
            and self.alpha == 1.0
            and target.device.type == "cpu"
            and not checked_in_place
        ):  # received bytes go straight in
            destination = tensor_bytes_view(target)
            if sum(map(len, chunks)) != len(destination):
                raise rpc.RPCProtocolError(
                    f"answer for part {part.index} has {sum(map(len, chunks))} bytes, "
                    f"expected {len(destination)}"
                )
            offset = 0
            for chunk in chunks:
                destination[offset : offset + len(chunk)] = chunk
                offset += len(chunk)
            if self.reject_nonfinite and not bool(torch.isfinite(target).all()):
                self.partition.keep(part)
                raise rpc.RPCProtocolError(f"the reducer answered part {part.index} with NaN or inf")
            return
        values = decode_tensor(header.numel, header.dtype, header.compression, b"".join(chunks))
        if self.reject_nonfinite and not bool(torch.isfinite(values).all()):
            raise rpc.RPCProtocolError(f"the reducer answered part {part.index} with NaN or inf")
        if header.kind == AnswerKind.AVERAGE:
            self.partition.apply_average(part, values, self.alpha)
        else:
            self.partition.apply_delta(part, values, self.alpha)

    # --- sender side: verification ---------------------------------------------------------------

    async def _verify_with(self, j: int, responses) -> None:
        """Verifier j revealed its seed: send it our report, take its verdict."""
        async with asyncio.timeout(2 * self.reducer_timeout):  # it waits up to reducer_timeout for the others
            seed = VerifySeed.decode(b"".join(await anext(responses))).seed
        report = await asyncio.get_running_loop().run_in_executor(None, self._make_report, seed)
        self._reports[j].set_result(report.encode())
        async with asyncio.timeout(2 * self.reducer_timeout):
            verdict = VerifyVerdict.decode(b"".join(await anext(responses)))
        if len(verdict.bad_parts) != len(self.peers):
            raise rpc.RPCProtocolError(
                f"a verdict on {len(verdict.bad_parts)} spans, the group has {len(self.peers)}"
            )
        self._verdicts[j] = verdict.bad_parts

    def _make_report(self, seed: bytes) -> VerifyReport:
        """Our rows for every part we applied, with directions from `seed` (runs in a thread: the
        round's tensors are at rest by now)."""
        weights, rows = [], []
        for j in range(len(self.peers)):
            own = self.reducer.weights if j == self.me and self.reducer is not None else None
            weights.append(own.get(self.me, 0.0) if own else self._weight_given[j])
            span_rows: list[tuple[float, ...]] = []
            for index, radius in enumerate(self._answered[j][: self._applied[j]]):
                if radius == 0:
                    span_rows.append((0.0, 0.0, 0.0, 0.0))
                    continue
                part = self.partition.part(j, index)
                sent = self.outgoing(part, self.partition.view(part))
                span_rows.append(
                    part_row(sent, self.partition.output(part), radius, direction(seed, j, index, part.numel))
                )
            rows.append(span_rows)
        return encode_report(weights, rows)

    def part_precision(self, span: int, index: int) -> PartPrecision:
        """How exactly members can reproduce part `index` of `span` (its dtype and wire compression)."""
        part = self.partition.part(span, index)
        method = base_method(self.compression, self.partition.compression_info(part))
        return PartPrecision.of(self.partition.dtype(part), method.compression_type)

    # --- reducer side ---------------------------------------------------------------------------------

    async def serve_sender(
        self, stream, first: PartHeader, frames: AsyncIterator[bytes]
    ) -> AsyncIterator[bytes]:
        """The reducer's side of one sender's stream: read its parts, yield the answer frames."""
        peer = stream.remote_peer
        sender = self.peers.index(peer) if peer in self.peers else None
        if sender is None or sender == self.me or self.modes[sender] == AveragingMode.AUX:
            raise SenderExcluded(f"{peer.short()} is not a sender of all-reduce {self.group_id.hex()[:8]}")
        if self.reducer is None:
            raise SenderExcluded(
                f"{self.host.peer_id.short()} reduces no part of all-reduce {self.group_id.hex()[:8]}"
            )
        async for frame in self.reducer.serve_sender(stream, first, frames):
            yield frame


# --- routing incoming streams to runners ----------------------------------------------------------


class AllReduceRouter:
    """Serves `{prefix}/allreduce/1.0.0` on a host and hands each sender's stream to the runner of
    its group (by the group_id in the stream's first header).

    A stream may arrive a little before its group's runner is registered (the sender learned of
    the group first); it waits up to `registration_timeout` for it, then gets an error. At most
    `max_waiting_streams` streams wait at once.
    """

    def __init__(
        self,
        host: Host,
        protocol_prefix: str = DEFAULT_PROTOCOL_PREFIX,
        *,
        registration_timeout: float = 5.0,
        max_waiting_streams: int = 256,
        max_message_size: int = DEFAULT_MAX_FRAME_BYTES,
    ):
        self.host, self.protocol = host, allreduce_protocol(protocol_prefix)
        self.registration_timeout, self.max_waiting_streams = registration_timeout, max_waiting_streams
        self.max_message_size = max_message_size
        self._runners: dict[bytes, AllReduceRunner] = {}
        self._registered = asyncio.Event()
        self._waiting = 0
        rpc.add_handler(
            host,
            self.protocol,
            self._handle,
            bytes,
            bytes,
            stream_input=True,
            stream_output=True,
            max_message_size=max_message_size,
        )

    def close(self) -> None:
        self.host.remove_stream_handler(self.protocol)

    @contextlib.contextmanager
    def register(self, runner: AllReduceRunner):
        """Route the runner's group to it while the `with` block runs."""
        if runner.max_frame_bytes > self.max_message_size:
            raise AllReduceError(
                f"parts of up to {runner.max_frame_bytes} bytes exceed this router's "
                f"max_message_size={self.max_message_size}; lower part_size_bytes"
            )
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
            raise SenderExcluded(
                "no all-reduce for this group here: this peer is not in it, or it already "
                f"finished (waited {self.registration_timeout}s)"
            ) from None
        async for frame in runner.serve_sender(context.stream, header, frames):
            yield frame
