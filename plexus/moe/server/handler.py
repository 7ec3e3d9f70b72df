"""The expert RPC service on a Host: info, forward and backward, unary and streaming.

Every request is checked against the expert's schema before anything is decoded or queued: the
uid must be served here, the tensor count must match, each tensor must have the descriptor's
dtype and non-batch shape, all must share one batch size in [1, max_batch_size], and hold no NaN
or inf. Unary requests are checked by their tensors' headers before any tensor is decoded; in the
streaming variants each tensor's header chunk is checked as it arrives, before its data is
buffered. A request that fails a check gets an error naming the expert, the tensor and what was
expected; nothing else is affected. A batch that turns out non-finite anyway (`NonFiniteError`)
fails every request in it, and leaves the expert as it was. Refusals are logged once a minute per
peer and kind. The RPC layer answers garbage bytes the same way. Each call, reading included, is
bounded by `request_timeout`.

One peer may have at most `max_requests_per_peer` forward and backward calls under way at once
(reading, queued or computing); one more is refused with an error saying so, and the refusal is
logged once a minute per peer. Queued work is tagged with the calling peer, so the runtime shares
compute between peers fairly (runtime.py): a peer flooding the server waits behind its own
requests, not in front of everyone else's.

Wire format and protocol ids: `plexus.moe.messages`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

import torch

from ...compression import CompressionError, SerializedTensor
from ...compression.wire import DTYPE_NAMES
from ...errors import PeerMisbehaved, PhaseTimeout
from ...p2p import rpc
from ...p2p.host import Host
from ...p2p.identity import PeerID
from ...utils.logging import RateLimitedLog, get_logger
from ...utils.tensors import first_nonfinite
from ..messages import (
    BACKWARD_PROTOCOL,
    BACKWARD_STREAM_PROTOCOL,
    FORWARD_PROTOCOL,
    FORWARD_STREAM_PROTOCOL,
    INFO_PROTOCOL,
    MAX_FRAME,
    ExpertRequest,
    ExpertResponse,
    ExpertSchema,
    InfoRequest,
    StreamCollector,
    deserialize_unary,
    payload_size,
    serialize_tensors,
    stream_messages,
    unary_message,
)
from ..schema import BatchTensorDescriptor
from .module_backend import ModuleBackend, NonFiniteError
from .runtime import TaskRejected

logger = get_logger(__name__)
_refusals = RateLimitedLog(logger)

DEFAULT_REQUEST_TIMEOUT = 120.0
DEFAULT_MAX_REQUESTS_PER_PEER = 64  # a mixture's forward sends one call per chosen expert of a server
PROTOCOLS = (
    INFO_PROTOCOL,
    FORWARD_PROTOCOL,
    BACKWARD_PROTOCOL,
    FORWARD_STREAM_PROTOCOL,
    BACKWARD_STREAM_PROTOCOL,
)


class ExpertRequestError(PeerMisbehaved, ValueError):
    """The caller's request does not fit the expert (the caller's fault; the text says what to fix)."""


class ExpertTimeoutError(PhaseTimeout):
    """A request did not finish within the server's request_timeout (the server is busy or slow)."""


class ConnectionHandler:
    """Serves `module_backends` on `host` under the `/plexus/moe/...` protocol ids."""

    def __init__(
        self,
        host: Host,
        module_backends: dict[str, ModuleBackend],
        *,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
        max_requests_per_peer: int = DEFAULT_MAX_REQUESTS_PER_PEER,
    ):
        if max_requests_per_peer < 1:
            raise ValueError(f"max_requests_per_peer must be at least 1, got {max_requests_per_peer}")
        self.host, self.module_backends, self.request_timeout = host, module_backends, request_timeout
        self.max_requests_per_peer = max_requests_per_peer
        self._under_way: dict[PeerID, int] = {}

    def register(self) -> None:
        for protocol in PROTOCOLS:
            if protocol in self.host.protocols:
                raise RuntimeError(
                    f"{self.host.peer_id} already serves {protocol}: one expert Server per Host"
                )
        options = dict(max_message_size=MAX_FRAME)
        rpc.add_handler(self.host, INFO_PROTOCOL, self.rpc_info, InfoRequest, ExpertSchema, **options)
        rpc.add_handler(
            self.host, FORWARD_PROTOCOL, self.rpc_forward, ExpertRequest, ExpertResponse, **options
        )
        rpc.add_handler(
            self.host, BACKWARD_PROTOCOL, self.rpc_backward, ExpertRequest, ExpertResponse, **options
        )
        rpc.add_handler(
            self.host,
            FORWARD_STREAM_PROTOCOL,
            self.rpc_forward_stream,
            ExpertRequest,
            ExpertResponse,
            stream_input=True,
            stream_output=True,
            **options,
        )
        rpc.add_handler(
            self.host,
            BACKWARD_STREAM_PROTOCOL,
            self.rpc_backward_stream,
            ExpertRequest,
            ExpertResponse,
            stream_input=True,
            stream_output=True,
            **options,
        )

    def unregister(self) -> None:
        for protocol in PROTOCOLS:
            self.host.remove_stream_handler(protocol)

    @contextlib.asynccontextmanager
    async def _serving(self, context: rpc.RPCContext):
        """Admit one call of the peer under `max_requests_per_peer`, bounded by `request_timeout`."""
        peer = context.remote_peer
        count = self._under_way.get(peer, 0)
        if count >= self.max_requests_per_peer:
            _refusals.warning(
                ("expert requests per peer", peer),
                f"refused a {context.protocol} call from {peer}: it has {count} calls "
                f"under way (max_requests_per_peer={self.max_requests_per_peer})",
            )
            raise ExpertRequestError(
                f"too many calls from you under way ({count}, the server's "
                f"max_requests_per_peer); wait for some to finish"
            )
        self._under_way[peer] = count + 1
        try:
            async with asyncio.timeout(self.request_timeout):
                yield
        except TimeoutError:
            raise ExpertTimeoutError(
                f"the request did not finish within the server's request_timeout of "
                f"{self.request_timeout} s (the server is busy or the expert is slow); "
                f"retry later or use another expert"
            ) from None
        finally:
            if self._under_way[peer] <= 1:
                del self._under_way[peer]
            else:
                self._under_way[peer] -= 1

    # --- the five methods ---------------------------------------------------------------------------

    async def rpc_info(self, request: InfoRequest, context: rpc.RPCContext) -> ExpertSchema:
        return self._backend(request.uid).schema

    async def rpc_forward(self, request: ExpertRequest, context: rpc.RPCContext) -> ExpertResponse:
        async with self._serving(context):
            backend = self._backend(request.uid)
            inputs = self._decode(backend, request.tensors)
            return self._unary_response(await self._run(backend, inputs, context.remote_peer, backward=False))

    async def rpc_backward(self, request: ExpertRequest, context: rpc.RPCContext) -> ExpertResponse:
        async with self._serving(context):
            backend = self._backend(request.uid)
            inputs = self._decode(backend, request.tensors, backward=True)
            return self._unary_response(await self._run(backend, inputs, context.remote_peer, backward=True))

    async def rpc_forward_stream(
        self, requests: AsyncIterator[ExpertRequest], context: rpc.RPCContext
    ) -> AsyncIterator[ExpertResponse]:
        async with self._serving(context):
            backend, inputs = await self._collect(requests, backward=False)
            outputs = await self._run(backend, inputs, context.remote_peer, backward=False)
        for chunks in stream_messages(outputs):
            yield ExpertResponse(chunks)

    async def rpc_backward_stream(
        self, requests: AsyncIterator[ExpertRequest], context: rpc.RPCContext
    ) -> AsyncIterator[ExpertResponse]:
        async with self._serving(context):
            backend, inputs = await self._collect(requests, backward=True)
            grads = await self._run(backend, inputs, context.remote_peer, backward=True)
        for chunks in stream_messages(grads):
            yield ExpertResponse(chunks)

    # --- checks -------------------------------------------------------------------------------------

    def _backend(self, uid: str) -> ModuleBackend:
        backend = self.module_backends.get(uid)
        if backend is None:
            examples = ", ".join(repr(name) for name in list(self.module_backends)[:3])
            raise ExpertRequestError(
                f"no expert {uid[:100]!r} on this server (it serves {len(self.module_backends)}"
                f" experts{', e.g. ' + examples if examples else ''})"
            )
        return backend

    @staticmethod
    def _expected(backend: ModuleBackend, backward: bool) -> tuple[BatchTensorDescriptor, ...]:
        inputs = backend.schema.inputs_schema
        return inputs + backend.schema.outputs_schema if backward else inputs

    @staticmethod
    def _describe(backend: ModuleBackend, index: int) -> str:
        n_inputs = len(backend.schema.inputs_schema)
        if index < n_inputs:
            return f"input {index}"
        return f"output gradient {index - n_inputs}"

    def _check_one(
        self,
        backend: ModuleBackend,
        backward: bool,
        index: int,
        shape: Sequence[int],
        dtype: str,
        batch_size: int | None,
    ) -> int:
        expected = self._expected(backend, backward)
        if index >= len(expected):
            raise ExpertRequestError(
                f"expert {backend.name!r} takes {len(expected)} tensors for "
                f"{'backward' if backward else 'forward'}, got more"
            )
        what = f"expert {backend.name!r}: {self._describe(backend, index)}"
        problem = expected[index].mismatch(tuple(shape), dtype)
        if problem is not None:
            raise ExpertRequestError(f"{what} has {problem}")
        rows = shape[0]
        if batch_size is not None and rows != batch_size:
            raise ExpertRequestError(f"{what} has {rows} rows, but the first tensor has {batch_size}")
        if rows < 1:
            raise ExpertRequestError(f"{what} is an empty batch")
        if rows > backend.max_batch_size:
            raise ExpertRequestError(
                f"{what} has {rows} rows, more than max_batch_size={backend.max_batch_size}; split the batch"
            )
        return rows

    def _check_count(self, backend: ModuleBackend, backward: bool, count: int) -> None:
        expected = len(self._expected(backend, backward))
        if count != expected:
            raise ExpertRequestError(
                f"expert {backend.name!r} takes {expected} tensors for "
                f"{'backward' if backward else 'forward'}, got {count}"
            )

    def _decode(
        self, backend: ModuleBackend, tensors: list[bytes], backward: bool = False
    ) -> list[torch.Tensor]:
        self._check_count(backend, backward, len(tensors))
        batch_size = [None]

        def check_header(index: int, header: SerializedTensor) -> None:
            batch_size[0] = self._check_one(
                backend, backward, index, header.size, header.dtype, batch_size[0]
            )

        try:
            decoded = deserialize_unary(tensors, check_header)
        except CompressionError as error:
            raise ExpertRequestError(f"expert {backend.name!r}: malformed tensor: {error}") from None
        for index, tensor in enumerate(decoded):  # what the data holds, not only what the header says
            self._check_one(backend, backward, index, tensor.shape, DTYPE_NAMES[tensor.dtype], batch_size[0])
        return decoded

    async def _collect(
        self, requests: AsyncIterator[ExpertRequest], backward: bool
    ) -> tuple[ModuleBackend, list[torch.Tensor]]:
        backend, collector, batch_size = None, None, [None]

        def check_header(index: int, header: SerializedTensor) -> None:
            batch_size[0] = self._check_one(
                backend, backward, index, header.size, header.dtype, batch_size[0]
            )

        try:
            async for message in requests:
                if backend is None:
                    backend = self._backend(message.uid)
                    collector = StreamCollector(check_header)
                elif message.uid not in ("", backend.name):
                    raise ExpertRequestError(
                        f"a stream for expert {backend.name!r} switched to {message.uid[:100]!r}"
                    )
                collector.feed(message.tensors)
            if backend is None:
                raise ExpertRequestError("the request stream was empty (the first message names the expert)")
            tensors = collector.finish()
        except CompressionError as error:
            name = backend.name if backend is not None else "?"
            raise ExpertRequestError(f"expert {name!r}: malformed tensor stream: {error}") from None
        self._check_count(backend, backward, len(tensors))
        return backend, tensors

    # --- compute ------------------------------------------------------------------------------------

    async def _run(
        self, backend: ModuleBackend, inputs: list[torch.Tensor], peer: PeerID, backward: bool
    ) -> list[SerializedTensor]:
        if (index := first_nonfinite(inputs)) is not None:
            self._refuse(peer, f"expert {backend.name!r}: {self._describe(backend, index)} holds NaN or inf")
        pool = backend.backward_pool if backward else backend.forward_pool
        try:
            future = pool.submit_task(*inputs, owner=peer)
        except TaskRejected as error:
            raise ExpertRequestError(str(error)) from None
        try:
            outputs = await future
        except NonFiniteError as error:
            self._refuse(peer, str(error))
        schema = backend.schema.grad_inputs_schema if backward else backend.schema.outputs_schema
        if len(outputs) != len(schema):
            raise RuntimeError(
                f"expert {backend.name!r} produced {len(outputs)} tensors, its schema says {len(schema)}"
            )
        return serialize_tensors(outputs, schema)

    @staticmethod
    def _refuse(peer: PeerID, problem: str):
        _refusals.warning((problem, peer), f"refused a request of {peer}: {problem}")
        raise ExpertRequestError(f"{problem}; the request was refused and the expert left unchanged")

    @staticmethod
    def _unary_response(serialized: list[SerializedTensor]) -> ExpertResponse:
        size = payload_size(serialized)
        if size > MAX_FRAME - (64 << 10):
            raise ExpertRequestError(
                f"the answer has {size} bytes, too many for one message; "
                f"use {FORWARD_STREAM_PROTOCOL} or {BACKWARD_STREAM_PROTOCOL}"
            )
        return ExpertResponse(unary_message(serialized))
