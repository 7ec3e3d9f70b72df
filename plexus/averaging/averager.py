"""`DecentralizedAverager`: average tensors with whoever is looking for a group at the same time.

One step is: matchmaking through the DHT (`matchmaking.py`) forms a group, the members' gathered
data decide how the vector is split (`load_balancing.py`, by bandwidth), and a butterfly
all-reduce (`allreduce.py`) averages it. The averaged tensors are the caller's own, as in hivemind.
A round reads them and writes its result into a private working copy, which is copied into them in
one short critical section at the end, so the lock is never held across a round: state downloads
(`state_sharing.py`) and the training thread see either the state before a round or the state
after it, never a half-averaged mix. (Tensors that are not contiguous CPU tensors are first copied
into the working copy under the lock, and the round runs on it.) One working copy is all the
memory an averager adds besides the transport's buffers. Writes made to the tensors while a round
runs may or may not be part of what it contributes, and its result replaces them.

Bad members. By default a round excludes a member whose parts hold NaN or inf and fails a span
whose reducer answers them (`reject_nonfinite`), and bounds every member's weight relative to the
group (`max_weight_ratio`) and by `weight_limits`. With `robust`, each reducer takes the
CenteredClip of its parts instead of their mean and the members check every reducer's result
(`aggregation.py`, `verification.py`): one member sending anything moves a part's result by at
most its clipping radius over the group size, and a reducer answering wrongly has its parts
discarded. Hivemind has none of this.

Everything runs on the DHT's event loop; `step`, `load_state_from_peers` and friends are thread-
safe, blocking calls (or return futures), as in hivemind.
"""

import asyncio
import contextlib
import hashlib
import math
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..compression import CompressionBase, CompressionInfo, NoCompression
from ..dht.dht import DHT
from ..dht.node import DHTNode
from ..errors import PlexusError
from ..p2p.host import Host
from ..p2p.identity import PeerID
from ..utils.logging import get_logger
from ..utils.serializer import MSGPackSerializer
from ..utils.timing import get_dht_time
from .aggregation import DEFAULT_MAX_WEIGHT_RATIO, RobustAggregation
from .allreduce import DEFAULT_PART_SIZE_BYTES, AllReduceRouter, AllReduceRunner, AveragingMode
from .control import AveragingStage, StepControl
from .load_balancing import load_balance_peers
from .matchmaking import Matchmaking
from .state_download import load_state_from_peers
from .state_sharing import StateSharing

logger = get_logger(__name__)

DEFAULT_STEP_TIMEOUT = 60.0
_routers: "weakref.WeakKeyDictionary[Host, AllReduceRouter]" = weakref.WeakKeyDictionary()


class AveragingError(PlexusError):
    """An averaging step failed (no group in time, or the round broke); the message says which."""


class NoPeersError(AveragingError):
    """A step with `alone_timeout` gave up: no other peer was looking for a group."""


class LeftOutError(AveragingError):
    """With `accept_partial=False`: a reducer excluded this peer from the round (too slow, or its
    stream broke), and the rest of the group averaged without it. Not retried: that group is over."""


class DecentralizedAverager:
    """Averages `averaged_tensors` with other peers under the same `prefix`.

    Args (hivemind's names): `target_group_size`/`min_group_size` bound groups;
    `min_matchmaking_time` is how long a peer waits for others before assembling;
    `request_timeout` bounds each matchmaking exchange; `part_size_bytes` sizes all-reduce parts;
    `sender_timeout` (default `next_chunk_timeout`, else 10 s) and `reducer_timeout` (default twice
    that) cut off stalled peers; `allreduce_timeout` bounds a whole round; `bandwidth` weighs how
    much of the vector this peer reduces; `auxiliary` peers only reduce; client-mode peers only send.

    Robustness (Plexus's own; see the module comment):
        reject_nonfinite: exclude members that send NaN or inf, refuse such answers (default True).
        max_weight_ratio: no member's weight counts for more than this many times the group's
            lower-median positive weight (default 8: peers may differ in speed, not by 1e9).
        weight_limits: optional `(peer_ids) -> {peer_id: most weight}`, called on the event loop
            as each round starts (keep it cheap); e.g. the samples a peer's progress record
            justifies. Peers it leaves out are bounded by `max_weight_ratio` only.
        robust: a `RobustAggregation` for CenteredClip per part and verified reducers (default
            None: the plain weighted mean). All members of a group must pass equal options.

    Averaging updates rather than parameters (DiLoCo's pseudo-gradients):
        shared_lossy_answers: reducers answer lossily compressed parts with the compressed average,
            one message for all, so every member ends with the same values (default False: each
            member's own compression error cancels; see `allreduce.py`). Not with robust.verify.
        compression_residuals: tensors like the averaged ones; each round writes there what the
            compression lost of every part this peer sent (zeros elsewhere), for error feedback.
    """

    allreduce_runner = AllReduceRunner
    """The class rounds run with; a subclass may override its `outgoing`/`reduced` seams to play a
    faulty member in tests (set it on an instance)."""

    def __init__(
        self,
        averaged_tensors: Sequence[torch.Tensor],
        dht: DHT,
        *,
        start: bool = False,
        prefix: str,
        target_group_size: int | None = None,
        min_group_size: int = 2,
        initial_group_bits: str = "",
        min_matchmaking_time: float = 5.0,
        request_timeout: float = 3.0,
        averaging_alpha: float = 1.0,
        part_size_bytes: int = DEFAULT_PART_SIZE_BYTES,
        allreduce_timeout: float | None = None,
        next_chunk_timeout: float | None = None,
        sender_timeout: float | None = None,
        reducer_timeout: float | None = None,
        compression: CompressionBase = NoCompression(),
        state_compression: CompressionBase = NoCompression(),
        tensor_infos: Sequence[CompressionInfo] | None = None,
        bandwidth: float | None = None,
        min_vector_size: int = 0,
        auxiliary: bool = False,
        allow_state_sharing: bool | None = None,
        declare_state_period: float = 30,
        client_mode: bool | None = None,
        shutdown_timeout: float = 5,
        reject_nonfinite: bool = True,
        max_weight_ratio: float = DEFAULT_MAX_WEIGHT_RATIO,
        weight_limits: Callable[[Sequence[PeerID]], Mapping[PeerID, float]] | None = None,
        robust: RobustAggregation | None = None,
        shared_lossy_answers: bool = False,
        compression_residuals: Sequence[torch.Tensor] | None = None,
    ):
        if "." in prefix:
            raise ValueError(f"prefix must not contain '.', got {prefix!r}")
        self.dht, self.prefix = dht, prefix
        self.client_mode = dht.client_mode if client_mode is None else client_mode
        if auxiliary and self.client_mode:
            raise ValueError("an auxiliary peer reduces parts for others, so it cannot be in client mode")
        self.mode = (
            AveragingMode.CLIENT
            if self.client_mode
            else AveragingMode.AUX
            if auxiliary
            else AveragingMode.NODE
        )
        self._tensors = [tensor.detach() for tensor in averaged_tensors]  # the caller's: results land there
        for tensor in self._tensors:
            if not tensor.is_floating_point():
                raise ValueError(f"only floating-point tensors can be averaged, got {tensor.dtype}")
        self._work: list[torch.Tensor] | None = None  # see _working_copy()
        self._reads_in_place = all(t.device.type == "cpu" and t.is_contiguous() for t in self._tensors)
        self._lock = threading.Lock()
        self.tensor_infos = (
            list(tensor_infos)
            if tensor_infos is not None
            else [CompressionInfo.from_tensor(tensor, key=i) for i, tensor in enumerate(self._tensors)]
        )
        if target_group_size is not None and min_group_size > target_group_size:
            logger.warning(
                f"min_group_size={min_group_size} exceeds target_group_size={target_group_size}: "
                f"groups form only when full (taking min_group_size={target_group_size})"
            )
            min_group_size = target_group_size
        self.target_group_size, self.min_group_size = target_group_size, min_group_size
        self.initial_group_bits, self.min_matchmaking_time = initial_group_bits, min_matchmaking_time
        self.request_timeout, self.averaging_alpha, self.part_size_bytes = (
            request_timeout,
            averaging_alpha,
            part_size_bytes,
        )
        self.sender_timeout = sender_timeout or next_chunk_timeout or 10.0
        self.reducer_timeout = reducer_timeout or 2 * self.sender_timeout
        self.allreduce_timeout = allreduce_timeout
        self.compression, self.state_compression = compression, state_compression
        self.bandwidth = 0.0 if self.client_mode else bandwidth
        self.min_vector_size, self.declare_state_period = min_vector_size, declare_state_period
        self.shutdown_timeout = shutdown_timeout
        if not max_weight_ratio >= 1:
            raise ValueError(f"max_weight_ratio must be at least 1, got {max_weight_ratio}")
        if robust is not None and robust.verify and averaging_alpha != 1.0:
            raise ValueError(
                "robust=RobustAggregation(verify=True) needs averaging_alpha=1: members check "
                "the result they applied"
            )
        if shared_lossy_answers and robust is not None and robust.verify:
            raise ValueError(
                "shared_lossy_answers cannot be verified (members keep their own compression errors): "
                "pass robust=RobustAggregation(verify=False)"
            )
        if compression_residuals is not None and [r.shape for r in compression_residuals] != [
            t.shape for t in self._tensors
        ]:
            raise ValueError("compression_residuals must have the shapes of the averaged tensors")
        self.shared_lossy_answers = shared_lossy_answers
        self.compression_residuals = (
            list(compression_residuals) if compression_residuals is not None else None
        )
        self.reject_nonfinite, self.max_weight_ratio = reject_nonfinite, max_weight_ratio
        self.weight_limits, self.robust = weight_limits, robust
        self._allow_state_sharing = (
            not (self.client_mode or auxiliary) if allow_state_sharing is None else allow_state_sharing
        )
        self._state_sharing_priority = 0.0
        self.schema_hash = self._compute_schema_hash()
        self._background = dht._background
        self._matchmaking: Matchmaking | None = None
        self._state_sharing: StateSharing | None = None
        self._ready: Any = None
        if start:
            self.run_in_background()

    def _compute_schema_hash(self) -> bytes:
        """Peers average together only if they cut the vector into the same parts."""
        schema = [(tuple(t.shape), str(t.dtype)) for t in self._tensors]
        layout: tuple = (schema, self.part_size_bytes, type(self.compression).__name__)
        if self.robust is not None:  # robust rounds speak more on the wire, and must clip alike
            layout += (repr(self.robust),)
        if self.shared_lossy_answers:
            layout += ("shared lossy answers",)
        return hashlib.sha256(repr(layout).encode()).digest()

    # --- life cycle --------------------------------------------------------------------------------

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        if self._ready is None:
            self.dht.wait_until_ready()
            self._ready = self._background.submit(self._start())
        if await_ready:
            self._ready.result(timeout)

    def _host_and_node(self) -> tuple[Host, DHTNode]:
        host, node = self.dht.host, self.dht.node
        if host is None or node is None:
            raise RuntimeError("the averager's DHT is not running")
        return host, node

    @property
    def _started_matchmaking(self) -> Matchmaking:
        if self._matchmaking is None:
            raise RuntimeError(
                "the averager has not started: create it with start=True or call run_in_background()"
            )
        return self._matchmaking

    @property
    def _started_state_sharing(self) -> StateSharing:
        if self._state_sharing is None:
            raise RuntimeError(
                "the averager has not started: create it with start=True or call run_in_background()"
            )
        return self._state_sharing

    async def _start(self) -> None:
        host, node = self._host_and_node()
        if host not in _routers:
            _routers[host] = AllReduceRouter(host)
        self._matchmaking = Matchmaking(
            host,
            node,
            prefix=self.prefix,
            schema_hash=self.schema_hash,
            target_group_size=self.target_group_size,
            min_group_size=self.min_group_size,
            initial_group_bits=self.initial_group_bits,
            min_matchmaking_time=self.min_matchmaking_time,
            request_timeout=self.request_timeout,
            client_mode=self.client_mode,
            assemble_when_all_joined=True,
        )
        self._state_sharing = StateSharing(
            host,
            node,
            self.prefix,
            self.get_current_state,
            state_lock=self._lock,
            state_compression=self.state_compression,
            declare_period=self.declare_state_period,
            priority=self._state_sharing_priority,
            allow_sharing=self._allow_state_sharing,
            client_mode=self.client_mode,
        )
        await self._state_sharing.start()

    def is_alive(self) -> bool:
        return self._ready is not None and self._ready.done() and self._ready.exception() is None

    def shutdown(self) -> None:
        if self._ready is None:
            return
        ready, self._ready = self._ready, None
        if ready.done() and ready.exception() is None:
            self._background.run(self._shutdown(), timeout=self.shutdown_timeout + 5)

    async def _shutdown(self) -> None:
        await self._started_matchmaking.shutdown()
        await self._started_state_sharing.shutdown()

    def __enter__(self):
        self.run_in_background()
        return self

    def __exit__(self, *exc_info):
        self.shutdown()

    # --- tensors and state -------------------------------------------------------------------------

    @contextlib.contextmanager
    def get_tensors(self):
        """The averaged tensors (the ones given to the constructor), locked: a round never writes
        them while this block runs."""
        with self._lock:
            yield self._tensors

    def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor], Sequence[CompressionInfo]]:
        """What newcomers download: (metadata, tensors, infos). Subclasses add optimizer state etc.

        Called with the tensors' lock held; return references, the caller copies them."""
        return dict(group_bits=self.get_group_bits()), self._tensors, self.tensor_infos

    def load_state_from_peers(
        self, wait: bool = True, timeout: float | None = None, min_priority: float | None = None
    ):
        """Download (metadata, tensors) from up-to-date peers; None if nobody shares state.

        `min_priority` (e.g. the swarm's epoch): fail with `StateDownloadError` rather than take
        an older state. With `reject_nonfinite`, a donor's state holding NaN or inf is refused and
        the others are tried."""
        future = self._background.submit(
            load_state_from_peers(
                *self._host_and_node(),
                self.prefix,
                timeout=timeout,
                min_priority=min_priority,
                reject_nonfinite=self.reject_nonfinite,
            )
        )
        return future.result() if wait else future

    @property
    def allow_state_sharing(self) -> bool:
        return self._allow_state_sharing

    @allow_state_sharing.setter
    def allow_state_sharing(self, value: bool) -> None:
        if value and self.client_mode:
            raise ValueError("a client-mode peer cannot be dialed, so it cannot share state")
        self._allow_state_sharing = value
        if self._state_sharing is not None:
            self._state_sharing.allow_sharing = value

    @property
    def state_sharing_priority(self) -> float:
        return self._state_sharing_priority

    @state_sharing_priority.setter
    def state_sharing_priority(self, value: float) -> None:
        self._state_sharing_priority = float(value)
        if self._state_sharing is not None:
            self._state_sharing.priority = float(value)

    def get_group_bits(self) -> str:
        return self._matchmaking.group_bits if self._matchmaking is not None else self.initial_group_bits

    def set_group_bits(self, group_bits: str) -> None:
        self._started_matchmaking.group_bits = group_bits

    @property
    def peer_id(self) -> PeerID:
        return self.dht.peer_id

    # --- averaging ---------------------------------------------------------------------------------

    def step(
        self,
        gather: Any = None,
        scheduled_time: float | None = None,
        weight: float | None = None,
        timeout: float | None = None,
        allow_retries: bool = True,
        require_trigger: bool = False,
        wait: bool = True,
        weight_for_group=None,
        expected_group_size: int | None = None,
        accept_partial: bool = True,
        alone_timeout: float | None = None,
        round_tag: bytes = b"",
    ):
        """Average once with a group; returns {peer_id: gathered data} of its members.

        With `wait=False` returns a StepControl at once (result, cancel, trigger). Raises
        AveragingError if no round succeeded before `timeout` (default 60 s). `weight_for_group`:
        see `StepControl.weight_for_group`. `expected_group_size`: peers the caller knows will look
        for this round; the group waits for them until the scheduled time instead of forming early.

        `accept_partial=False`: a round in which a span of ours failed (its reducer left, or its
        result failed verification, so those parts kept our local values) counts as failed: our
        tensors are left exactly as they were, and the step retries with a new group while the
        deadline allows, or, if a reducer went on without us, raises LeftOutError. Then every
        successful step leaves this peer with the same result as everyone who averaged with it.
        `alone_timeout`: give up (NoPeersError, no retry) that many seconds after the scheduled
        time when no other peer is looking for a group, instead of waiting for the deadline.
        `round_tag`: meet only steps with the same tag (e.g. an epoch; see `Matchmaking`).
        """
        if self._ready is None:
            raise RuntimeError("the averager is not running: create it with start=True")
        if weight is None:
            weight = 0.0 if self.mode == AveragingMode.AUX else 1.0
        if self.mode == AveragingMode.AUX and weight != 0:
            raise ValueError("an auxiliary peer contributes no tensors, so its weight must be 0")
        if scheduled_time is None:
            scheduled_time = get_dht_time() + self.min_matchmaking_time
        control = StepControl(
            self._background.loop,
            scheduled_time=scheduled_time,
            weight=weight,
            require_trigger=require_trigger,
        )
        control.weight_for_group = weight_for_group
        user_gather = MSGPackSerializer.dumps(gather)
        control._start(
            self._step(
                control,
                user_gather,
                timeout,
                allow_retries,
                expected_group_size,
                accept_partial,
                alone_timeout,
                round_tag,
            )
        )
        return control.result() if wait else control

    async def _step(
        self,
        control: StepControl,
        user_gather: bytes,
        timeout: float | None,
        allow_retries: bool,
        expected_group_size: int | None,
        accept_partial: bool,
        alone_timeout: float | None,
        round_tag: bytes,
    ):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (timeout if timeout is not None else DEFAULT_STEP_TIMEOUT)
        gather = MSGPackSerializer.dumps([self.bandwidth, self.mode.value, user_gather])
        failures: list[str] = []
        matchmaking = self._started_matchmaking
        try:
            while True:
                control.stage = AveragingStage.LOOKING_FOR_GROUP
                group = await matchmaking.look_for_group(
                    gather=gather,
                    deadline=deadline,
                    scheduled_time=control.scheduled_time,
                    expected_group_size=expected_group_size,
                    alone_timeout=alone_timeout,
                    round_tag=round_tag,
                )
                if group is None and matchmaking.last_round_alone:
                    earlier = f" (earlier tries: {'; '.join(failures)})" if failures else ""
                    raise NoPeersError(
                        f"Averaging step failed: no other peer was looking for a group under "
                        f"{matchmaking.group_key!r}{earlier}"
                    )
                if group is None:
                    failures.append("could not find a group")
                else:
                    control.stage = AveragingStage.AWAITING_TRIGGER
                    async with asyncio.timeout_at(deadline):
                        await control.wait_for_trigger()
                    control.stage = AveragingStage.RUNNING_ALLREDUCE
                    try:
                        return await self._run_allreduce(
                            group, self._weight_for_group(group, control), accept_partial
                        )
                    except (ConnectionError, TimeoutError, ValueError) as error:
                        failures.append(f"all-reduce in group {group.group_id.hex()[:8]} failed: {error!r}")
                if not allow_retries or loop.time() + self.request_timeout >= deadline:
                    raise AveragingError(f"Averaging step failed: {'; '.join(failures)}")
                control.scheduled_time = get_dht_time() + self.min_matchmaking_time
        except TimeoutError:
            raise AveragingError(
                f"Averaging step failed: no group was ready before the deadline "
                f"({'; '.join(failures) or 'waiting for the trigger'})"
            ) from None
        finally:
            control._finish()

    def _weight_for_group(self, group, control: StepControl) -> float:
        """The control's weight, or what its `weight_for_group` makes of it for this group."""
        if control.weight_for_group is None or self.mode == AveragingMode.AUX:
            return control.weight
        contributing = {}
        for peer, data in zip(group.peer_ids, group.gathered):
            member = MSGPackSerializer.loads(data)
            if not (isinstance(member, list) and len(member) == 3 and member[1] in (0, 1, 2)):
                raise ValueError(f"a group member sent malformed gathered data: {member!r:.80}")
            if AveragingMode(member[1]) != AveragingMode.AUX:
                contributing[peer] = MSGPackSerializer.loads(member[2])
        try:  # the caller's code: its failure is not a network fault to retry
            weight = float(control.weight_for_group(contributing, control.weight))
        except Exception as error:
            raise AveragingError(f"weight_for_group raised {error!r}") from error
        if not (math.isfinite(weight) and weight >= 0):
            raise AveragingError(f"weight_for_group returned {weight!r}; a weight must be finite and >= 0")
        return weight

    async def _run_allreduce(self, group, weight: float, accept_partial: bool = True) -> dict[PeerID, Any]:
        members = [MSGPackSerializer.loads(data) for data in group.gathered]
        for member in members:
            if not (isinstance(member, list) and len(member) == 3 and member[1] in (0, 1, 2)):
                raise ValueError(f"a group member sent malformed gathered data: {member!r:.80}")
        modes = [AveragingMode(member[1]) for member in members]
        bandwidths = [
            0.0 if mode == AveragingMode.CLIENT else member[0] for member, mode in zip(members, modes)
        ]
        total = sum(tensor.numel() for tensor in self._tensors)
        fractions = load_balance_peers(total, bandwidths, self.min_vector_size)
        async with self._round_tensors() as (sources, outputs):
            host, _ = self._host_and_node()
            runner = self.allreduce_runner(
                host,
                group.group_id,
                sources,
                group.peer_ids,
                fractions,
                modes,
                weight,
                self.compression,
                self.part_size_bytes,
                self.sender_timeout,
                self.reducer_timeout,
                averaging_alpha=self.averaging_alpha,
                tensor_infos=self.tensor_infos,
                outputs=outputs,
                shared_lossy_answers=self.shared_lossy_answers,
                residuals=self.compression_residuals,
                **self._member_checks(group.peer_ids),
            )
            with _routers[host].register(runner):
                async with asyncio.timeout(self.allreduce_timeout):
                    report = await runner.run()
            failed = ", ".join(
                f"{f.reducer.short()} ({f.parts_received}/{f.parts_total} parts: {f.reason})"
                for f in report.failed_spans
            )
            if (report.failed_spans or report.discarded_parts) and not accept_partial:  # not published
                if any(failure.excluded for failure in report.failed_spans):
                    raise LeftOutError(
                        f"Averaging step failed: the group {group.group_id.hex()[:8]} averaged "
                        f"without this peer: {failed}"
                    )
                discarded = ", ".join(peer.short() for peer in report.discarded_parts)
                raise ConnectionError(
                    f"spans kept local values: {failed or 'none'}; parts that failed "
                    f"verification, reduced by: {discarded or 'none'}"
                )
        if not report.complete:
            logger.warning(
                f"averaging round finished with {len(group.peer_ids)} peers, but some spans kept local "
                f"values: {failed or 'none'}; excluded senders: "
                f"{list(map(str, report.excluded_senders))}; parts that failed verification: "
                f"{len(report.discarded_parts)} span(s)"
            )
        return {peer: MSGPackSerializer.loads(member[2]) for peer, member in zip(group.peer_ids, members)}

    def _member_checks(self, peer_ids: Sequence[PeerID]) -> dict:
        """The runner options that guard a round against bad members."""
        limits = dict(self.weight_limits(peer_ids)) if self.weight_limits is not None else None
        return dict(
            reject_nonfinite=self.reject_nonfinite,
            max_weight_ratio=self.max_weight_ratio,
            weight_limits=limits,
            robust=self.robust,
        )

    async def _acquire_lock(self) -> None:
        """Take the tensors' lock without blocking the loop; if cancelled meanwhile, let it go."""
        acquired = asyncio.get_running_loop().run_in_executor(None, self._lock.acquire)
        try:
            await asyncio.shield(acquired)
        except asyncio.CancelledError:

            def release_once_acquired(future: asyncio.Future) -> None:
                if not future.cancelled():
                    self._lock.release()

            acquired.add_done_callback(release_once_acquired)
            raise

    @contextlib.asynccontextmanager
    async def _round_tensors(self):
        """(what the round reads, where it writes: None for in place), then publish the working copy
        in one short critical section. Reading the tensors themselves saves a copy of them per
        round (~0.05 s per 400 MiB, of a ~0.7 s round of two peers)."""
        if (
            self.mode == AveragingMode.AUX
        ):  # it only reduces others' parts: its tensors are neither read nor written
            yield (self._tensors if self._reads_in_place else await self._working_copy()), None
            return
        work = await self._working_copy()
        if self._reads_in_place:
            yield self._tensors, work
        else:
            await self._acquire_lock()
            try:
                for buffer, tensor in zip(work, self._tensors):
                    buffer.copy_(tensor)
            finally:
                self._lock.release()
            yield work, None
        await self._acquire_lock()
        try:
            for buffer, tensor in zip(work, self._tensors):
                tensor.copy_(buffer)
            self._started_state_sharing.state_changed()
        finally:
            self._lock.release()

    async def _working_copy(self) -> list[torch.Tensor]:
        """Contiguous CPU buffers like the tensors, made (off the event loop) by the first round that
        needs them: subclasses with rounds of their own (PowerSGD) never do."""
        if self._work is None:
            self._work = await asyncio.get_running_loop().run_in_executor(
                None, lambda: [torch.zeros(tensor.shape, dtype=tensor.dtype) for tensor in self._tensors]
            )
        return self._work

    def __repr__(self) -> str:
        return f"<DecentralizedAverager {self.prefix} {self.mode.name} peer={self.dht.peer_id.short()}>"
