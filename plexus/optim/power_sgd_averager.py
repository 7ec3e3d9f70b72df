"""`PowerSGDGradientAverager`: average gradients as rank-r factors (PowerSGD with error feedback).

Theory of operation
-------------------
PowerSGD (Vogels et al., 2019) sends, for an n x m gradient, two thin factors P (n x r) and
Q (m x r) instead of the matrix. Per round, for each factorised tensor, with M the error-feedback
buffer (what earlier rounds failed to transmit) and Q the shared query matrix:

  1. M' = M + G                        (error feedback)
  2. P = M' Q, then all-reduce P       (phase P: weighted mean over the group)
  3. orthogonalise P's columns         (every peer has the same P, so the same result)
  4. Q = M'^T P, then all-reduce Q     (phase Q; it also carries the tensors not factorised)
  5. G~ = P Q^T is the averaged gradient; M = M' - G~.

Tensors with ndim <= 1, or whose factors would not save at least `min_compression_ratio` of the
tensor's size (r (n + m) > (1 - min_compression_ratio) n m), are averaged whole in phase Q. Tensors
with ndim > 2 are viewed as the most nearly square matrix their dimensions split into. All the
arithmetic is float32 (bf16 and fp16 gradients work); results are cast back to the averaged
gradients' dtype.

Both phases run in one group, found by one matchmaking: the round is `_run_allreduce`, which runs
two butterfly all-reduces whose group ids are the group's id plus `.P` / `.Q`. The schema hash
includes "powersgd", the rank and the factor shapes, so plain GradientAverager peers (or PowerSGD
peers of another rank) meeting under the same prefix refuse each other in matchmaking
(BAD_SCHEMA_HASH) instead of averaging garbage.

Q is state: every peer starts from the same Q (seeded by the prefix and the tensor's index and
shape), so even the first round is exact PowerSGD; after each round the Q phase leaves every member
with the same new Q. Newcomers download Q with `load_state_from_peers`. A peer that failed a phase
(a span it did not get back) keeps its old Q and local gradients for that round and raises; its
next successful round re-synchronises Q. One that failed phase P still takes part in phase Q, with
weight 0, so that the others' round completes without it (a peer whose gradients hold NaN or inf
is excluded by the reducers and must not take the group's round down with it). A peer with weight
0 (it contributes nothing) takes the averaged result but leaves its error buffer alone. Left out:
hivemind's greedy merging of
adjacent small dimensions (we pick the most square split instead).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import math
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..averaging.allreduce import AveragingMode
from ..averaging.averager import _routers
from ..averaging.load_balancing import load_balance_peers
from ..compression import CompressionInfo, TensorRole
from ..dht.dht import DHT
from ..errors import PeerError
from ..p2p.identity import PeerID
from ..utils.logging import get_logger
from ..utils.serializer import MSGPackSerializer
from .grad_averager import GradientAverager

logger = get_logger(__name__)


class PowerSGDPhaseError(PeerError, ConnectionError):
    """A PowerSGD phase did not average every span; this peer keeps its local gradients this round."""


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The most nearly square (rows, cols) that splits `shape` between two runs of dimensions."""
    best = (shape[0], math.prod(shape[1:]))
    for split in range(2, len(shape)):
        candidate = (math.prod(shape[:split]), math.prod(shape[split:]))
        if min(candidate) > min(best):
            best = candidate
    return best


@torch.no_grad()
def orthogonalize_(matrix: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Make the columns of `matrix` orthonormal in place (modified Gram-Schmidt); zero columns stay 0."""
    for i in range(matrix.shape[1]):
        column = matrix[:, i : i + 1]
        column.div_(column.norm() + eps)
        if i + 1 < matrix.shape[1]:
            rest = matrix[:, i + 1 :]
            rest.sub_(column @ (column.T @ rest))
    return matrix


class PowerSGDGradientAverager(GradientAverager):
    """A GradientAverager that sends rank-`averager_rank` factors of large gradients (see above).

    Args are GradientAverager's, plus `averager_rank` (r) and `min_compression_ratio` (the least
    fraction of a tensor's size its factors must save for it to be factorised). `averaging_alpha`
    must stay 1: both phases need every member to end with the same P and Q.
    """

    def __init__(
        self,
        parameters: Iterable[torch.nn.Parameter],
        averager_rank: int,
        *,
        dht: DHT,
        prefix: str,
        reuse_grad_buffers: bool = False,
        accumulate_grads_on: torch.device | None = None,
        client_mode: bool | None = None,
        warn: bool = True,
        min_compression_ratio: float = 0.5,
        averaged_grads: Sequence[torch.Tensor] | None = None,
        **kwargs,
    ):
        if not averager_rank >= 1:
            raise ValueError(f"averager_rank must be at least 1, got {averager_rank}")
        if not 0 <= min_compression_ratio < 1:
            raise ValueError(f"min_compression_ratio must be in [0, 1), got {min_compression_ratio}")
        if kwargs.get("averaging_alpha", 1.0) != 1.0:
            raise ValueError(
                "PowerSGD needs averaging_alpha=1: every member must end each phase with the same factors"
            )
        parameters = tuple(parameters)
        self.rank, self.min_compression_ratio = averager_rank, min_compression_ratio
        self._matrices: dict[int, tuple[int, int]] = {}  # parameter index -> (n, m), factorised tensors only
        for index, param in enumerate(parameters):
            if param.ndim <= 1:
                continue
            n, m = matrix_shape(param.shape)
            r = min(averager_rank, n, m)
            if r * (n + m) <= (1 - min_compression_ratio) * n * m:
                self._matrices[index] = (n, m)
        self._plain = [index for index in range(len(parameters)) if index not in self._matrices]
        self._qs = [self._initial_q(prefix, index, n, m) for index, (n, m) in self._matrices.items()]
        self._ms = [torch.zeros(n, m, dtype=torch.float32) for n, m in self._matrices.values()]
        super().__init__(
            parameters,
            dht=dht,
            prefix=prefix,
            reuse_grad_buffers=reuse_grad_buffers,
            accumulate_grads_on=accumulate_grads_on,
            client_mode=client_mode,
            warn=warn,
            averaged_grads=averaged_grads or (),
            **kwargs,
        )

    def _initial_q(self, prefix: str, index: int, n: int, m: int) -> torch.Tensor:
        seed = hashlib.sha256(f"{prefix}/powersgd/{index}/{n}x{m}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(seed[:8], "little") & (2**63 - 1))
        return torch.randn(m, min(self.rank, n, m), generator=generator)

    def _compute_schema_hash(self) -> bytes:
        layout = ("powersgd/1", self.rank, sorted(self._matrices.items()), [tuple(q.shape) for q in self._qs])
        return hashlib.sha256(super()._compute_schema_hash() + repr(layout).encode()).digest()

    # --- state: the Q matrices -----------------------------------------------------------------

    def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor], Sequence[CompressionInfo]]:
        """Newcomers download the shared Q matrices (called under the averager's lock)."""
        infos = [
            CompressionInfo.from_tensor(q, key=f"q{index}", role=TensorRole.GRADIENT)
            for index, q in zip(self._matrices, self._qs)
        ]
        return dict(group_bits=self.get_group_bits(), powersgd_rank=self.rank), self._qs, infos

    def load_state_from_peers(self, wait: bool = True, timeout: float | None = None):
        """Download and adopt the swarm's Q matrices; returns (metadata, tensors) or None."""
        if wait:
            return self._adopt_state(super().load_state_from_peers(wait=True, timeout=timeout))
        future: concurrent.futures.Future = concurrent.futures.Future()

        download = super().load_state_from_peers

        def load() -> None:
            try:
                future.set_result(self._adopt_state(download(wait=True, timeout=timeout)))
            except BaseException as error:  # handed to whoever waits on the future
                future.set_exception(error)

        threading.Thread(target=load, name=f"{self.prefix}-load-state", daemon=True).start()
        return future

    def _adopt_state(self, state):
        if state is None:
            return None
        _metadata, tensors = state
        if [tuple(t.shape) for t in tensors] != [tuple(q.shape) for q in self._qs]:
            logger.warning(
                f"{self.prefix}: a peer's PowerSGD state has shapes "
                f"{[tuple(t.shape) for t in tensors]}, ours {[tuple(q.shape) for q in self._qs]} "
                f"(another rank or model?); keeping our Q"
            )
            return state
        with self.get_tensors():
            for q, loaded in zip(self._qs, tensors):
                q.copy_(loaded)
        return state

    # --- the round: two all-reduce phases in one group -----------------------------------------

    async def _run_allreduce(self, group, weight: float, accept_partial: bool = True) -> dict[PeerID, Any]:
        # accept_partial does not apply: a phase with a failed span always fails (PowerSGDPhaseError)
        members = [MSGPackSerializer.loads(data) for data in group.gathered]
        for member in members:
            if not (isinstance(member, list) and len(member) == 3 and member[1] in (0, 1, 2)):
                raise ValueError(f"a group member sent malformed gathered data: {member!r:.80}")
        modes = [AveragingMode(member[1]) for member in members]
        bandwidths = [
            0.0 if mode == AveragingMode.CLIENT else member[0] for member, mode in zip(members, modes)
        ]
        loop = asyncio.get_running_loop()

        async with self._locked():  # a snapshot: the training thread may write them once we let go
            grads = [tensor.to(torch.float32, copy=True) for tensor in self._tensors]
            plain = [self._tensors[index].clone() for index in self._plain]
            qs = [q.clone() for q in self._qs]

        def phase_p() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            ms = [
                error.add(grads[index].view(n, m))
                for error, (index, (n, m)) in zip(self._ms, self._matrices.items())
            ]
            return ms, [mt @ q for mt, q in zip(ms, qs)]

        ms, ps = await loop.run_in_executor(None, phase_p)
        failed = None
        try:
            await self._run_phase(group, b"P", ps, modes, bandwidths, weight)
        except PowerSGDPhaseError as error:  # still reduce our span of phase Q, or the others' round fails
            failed, weight = error, 0.0

        def phase_q() -> list[torch.Tensor]:
            return [mt.T @ orthogonalize_(p) for mt, p in zip(ms, ps)]

        new_qs = await loop.run_in_executor(None, phase_q)
        await self._run_phase(group, b"Q", new_qs + plain, modes, bandwidths, weight)
        if failed is not None:
            raise failed

        if self.mode != AveragingMode.AUX:  # an auxiliary peer got no results: nothing to keep
            approximations = await loop.run_in_executor(None, lambda: [p @ q.T for p, q in zip(ps, new_qs)])
            async with self._locked():
                for (index, _), approximation in zip(self._matrices.items(), approximations):
                    self._tensors[index].copy_(approximation.view(self._tensors[index].shape))
                for index, averaged in zip(self._plain, plain):
                    self._tensors[index].copy_(averaged)
                for q, new_q in zip(self._qs, new_qs):
                    q.copy_(new_q)
                self._state_sharing.state_changed()
            if weight > 0:  # what this round failed to transmit is carried into the next one
                for error, mt, approximation in zip(self._ms, ms, approximations):
                    torch.sub(mt, approximation, out=error)
        return {peer: MSGPackSerializer.loads(member[2]) for peer, member in zip(group.peer_ids, members)}

    @contextlib.asynccontextmanager
    async def _locked(self):
        """Hold the averager's lock without blocking the event loop; a cancelled wait still lets go."""
        acquiring = asyncio.get_running_loop().run_in_executor(None, self._lock.acquire)
        try:
            await asyncio.shield(acquiring)
        except asyncio.CancelledError:
            acquiring.add_done_callback(lambda _: self._lock.release())
            raise
        try:
            yield
        finally:
            self._lock.release()

    async def _run_phase(
        self, group, tag: bytes, tensors: list[torch.Tensor], modes, bandwidths, weight: float
    ) -> None:
        if not tensors:
            return
        sizes = load_balance_peers(sum(t.numel() for t in tensors), bandwidths, self.min_vector_size)
        infos = [
            CompressionInfo.from_tensor(t, key=f"{tag.decode()}{i}", role=TensorRole.GRADIENT)
            for i, t in enumerate(tensors)
        ]
        runner = self.allreduce_runner(
            self.dht.host,
            group.group_id + b"." + tag,
            tensors,
            group.peer_ids,
            sizes,
            modes,
            weight,
            self.compression,
            self.part_size_bytes,
            self.sender_timeout,
            self.reducer_timeout,
            tensor_infos=infos,
            **self._member_checks(group.peer_ids),
        )
        with _routers[self.dht.host].register(runner):
            async with asyncio.timeout(self.allreduce_timeout):
                report = await runner.run()
        if report.failed_spans or report.discarded_parts:
            failed = ", ".join(
                [
                    f"{f.reducer.short()} ({f.parts_received}/{f.parts_total}: {f.reason})"
                    for f in report.failed_spans
                ]
                + [f"{peer.short()} (failed verification)" for peer in report.discarded_parts]
            )
            raise PowerSGDPhaseError(
                f"PowerSGD phase {tag.decode()} in group {group.group_id.hex()[:8]} "
                f"kept local values for some spans ({failed}); the factors would "
                f"differ between peers"
            )
