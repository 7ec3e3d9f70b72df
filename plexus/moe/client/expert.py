"""A remote expert as a torch module: forward and backward run on the server that hosts it.

`RemoteExpert(ExpertInfo(uid, peer_id), host)(*args, **kwargs)` sends the inputs to the server
and returns its outputs; autograd's backward sends the inputs and output gradients back and
returns the input gradients (the server trains the expert on the way). Both go through one
`torch.autograd.Function` that always receives a dummy tensor requiring grad, so backward reaches
the server even when no input requires grad: the expert learns from every batch.

Synchronous torch code submits the network calls to the process's background event loop
(`plexus.utils.background_loop`); the `host` must run on that loop. The async functions below
(`get_expert_schema`, `expert_forward`, `expert_backward`) are the same calls for asyncio code,
such as a mixture-of-experts layer talking to many experts at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from ...compression import CompressionError
from ...compression.wire import DTYPE_NAMES
from ...errors import PeerError
from ...p2p import rpc
from ...p2p.host import Host
from ...utils.background_loop import get_background_loop
from ..expert_uid import ExpertInfo
from ..messages import (
    BACKWARD_PROTOCOL,
    BACKWARD_STREAM_PROTOCOL,
    FORWARD_PROTOCOL,
    FORWARD_STREAM_PROTOCOL,
    INFO_PROTOCOL,
    MAX_FRAME,
    MAX_UNARY_PAYLOAD,
    ExpertRequest,
    ExpertResponse,
    ExpertSchema,
    InfoRequest,
    collect_stream,
    deserialize_unary,
    payload_size,
    serialize_tensors,
    stream_messages,
    unary_message,
)
from ..schema import BatchTensorDescriptor

DEFAULT_TIMEOUT = 60.0
DUMMY = torch.empty(0, requires_grad=True)  # makes every call part of the autograd graph


class RemoteExpertError(PeerError, RuntimeError):
    """The server answered something that does not fit the expert's schema (the server's fault)."""


async def get_expert_schema(
    host: Host, expert: ExpertInfo, timeout: float | None = DEFAULT_TIMEOUT
) -> ExpertSchema:
    """Ask the server for the expert's schema (rpc.RPCError if it does not serve that uid)."""
    schema = await rpc.call(
        host,
        expert.peer_id,
        INFO_PROTOCOL,
        InfoRequest(expert.uid),
        ExpertSchema,
        timeout=timeout,
        max_message_size=MAX_FRAME,
    )
    if schema.uid != expert.uid:
        raise RemoteExpertError(
            f"{expert.peer_id} answered the schema of {schema.uid!r} when asked for {expert.uid!r}"
        )
    return schema


def _expected_bytes(schema: Sequence[BatchTensorDescriptor], batch_size: int) -> int:
    return sum(
        batch_size * math.prod(1 if d is None else d for d in s.shape) * s.torch_dtype.itemsize
        for s in schema
    )


async def _call(
    host: Host,
    expert: ExpertInfo,
    protocols: tuple[str, str],
    tensors: Sequence[torch.Tensor],
    schema: Sequence[BatchTensorDescriptor],
    answer: Sequence[BatchTensorDescriptor],
    timeout: float | None,
) -> list[torch.Tensor]:
    serialized = serialize_tensors(tensors, schema)
    batch_size = tensors[0].shape[0]
    unary, streaming = protocols
    if max(payload_size(serialized), _expected_bytes(answer, batch_size)) <= MAX_UNARY_PAYLOAD:
        response = await rpc.call(
            host,
            expert.peer_id,
            unary,
            ExpertRequest(expert.uid, unary_message(serialized)),
            ExpertResponse,
            timeout=timeout,
            max_message_size=MAX_FRAME,
        )
        try:
            outputs = deserialize_unary(response.tensors)
        except CompressionError as error:
            raise RemoteExpertError(
                f"{expert.peer_id} sent a malformed answer for {expert.uid!r}: {error}"
            ) from None
    else:

        async def requests():
            for i, chunks in enumerate(stream_messages(serialized)):
                yield ExpertRequest(expert.uid if i == 0 else "", chunks)

        try:
            outputs = await collect_stream(
                rpc.call_stream(
                    host,
                    expert.peer_id,
                    streaming,
                    requests(),
                    ExpertResponse,
                    timeout=timeout,
                    max_message_size=MAX_FRAME,
                )
            )
        except CompressionError as error:
            raise RemoteExpertError(
                f"{expert.peer_id} sent a malformed answer for {expert.uid!r}: {error}"
            ) from None
    if len(outputs) != len(answer) or any(
        d.mismatch(tuple(t.shape), DTYPE_NAMES.get(t.dtype, str(t.dtype))) or t.shape[0] != batch_size
        for t, d in zip(outputs, answer)
    ):
        raise RemoteExpertError(
            f"{expert.peer_id} answered {expert.uid!r} with tensors "
            f"{[(tuple(t.shape), t.dtype) for t in outputs]} that do not fit its schema {answer}"
        )
    return outputs


async def expert_forward(
    host: Host,
    expert: ExpertInfo,
    schema: ExpertSchema,
    inputs: Sequence[torch.Tensor],
    timeout: float | None = DEFAULT_TIMEOUT,
) -> list[torch.Tensor]:
    """Outputs of the expert for flat inputs (args, then kwargs in `schema.kwargs_names` order)."""
    return await _call(
        host,
        expert,
        (FORWARD_PROTOCOL, FORWARD_STREAM_PROTOCOL),
        inputs,
        schema.inputs_schema,
        schema.outputs_schema,
        timeout,
    )


async def expert_backward(
    host: Host,
    expert: ExpertInfo,
    schema: ExpertSchema,
    inputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor],
    timeout: float | None = DEFAULT_TIMEOUT,
) -> list[torch.Tensor]:
    """Gradients for the inputs whose descriptor requires grad (the server also trains the expert)."""
    return await _call(
        host,
        expert,
        (BACKWARD_PROTOCOL, BACKWARD_STREAM_PROTOCOL),
        [*inputs, *grad_outputs],
        schema.inputs_schema + schema.outputs_schema,
        schema.grad_inputs_schema,
        timeout,
    )


class RemoteExpert(nn.Module):
    """A module whose forward and backward run on the server hosting `expert_info.uid`.

    Args:
        expert_info: the uid and the server's peer id (the host must know or find its addresses).
        host: a started Host running on the background loop (or what `DHT.replicate_p2p()` or
            `plexus.compat`'s P2P hands out: anything with a `.host`).
        timeout: seconds allowed for each network call.
    """

    def __init__(self, expert_info: ExpertInfo, host: Host, *, timeout: float = DEFAULT_TIMEOUT):
        super().__init__()
        self.expert_info, self.timeout = ExpertInfo(*expert_info), timeout
        self.host = getattr(host, "host", host)
        self._schema: ExpertSchema | None = None

    @property
    def uid(self) -> str:
        return self.expert_info.uid

    @property
    def peer_id(self):
        return self.expert_info.peer_id

    def _run(self, coroutine):
        return get_background_loop().run(coroutine, None if self.timeout is None else self.timeout + 5)

    async def get_schema(self) -> ExpertSchema:
        if self._schema is None:
            self._schema = await get_expert_schema(self.host, self.expert_info, self.timeout)
        return self._schema

    @property
    def schema(self) -> ExpertSchema:
        """The expert's schema, fetched from the server on first use."""
        if self._schema is None:
            return self._run(self.get_schema())
        return self._schema

    @property
    def info(self) -> dict:
        """hivemind's info dict: forward_schema, outputs_schema, keyword_names (and more)."""
        return self.schema.as_dict()

    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor):
        schema = self.schema
        if len(args) != len(schema.args_schema) or set(kwargs) != set(schema.kwargs_names):
            raise TypeError(
                f"expert {self.uid!r} takes {len(schema.args_schema)} positional tensors and keywords "
                f"{list(schema.kwargs_names)}, got {len(args)} and {sorted(kwargs)}"
            )
        inputs = [*args, *(kwargs[name] for name in schema.kwargs_names)]
        outputs = _RemoteCall.apply(DUMMY, self, *inputs)
        return outputs if schema.outputs_tuple else outputs[0]

    def extra_repr(self) -> str:
        return f"uid={self.uid!r}, peer_id={self.peer_id}"


class _RemoteCall(torch.autograd.Function):
    """Autograd glue: forward and backward are each one call to the server."""

    @staticmethod
    def forward(ctx, dummy: torch.Tensor, expert: RemoteExpert, *inputs: torch.Tensor):
        inputs = tuple(t.detach() for t in inputs)
        ctx.expert = expert
        ctx.save_for_backward(*inputs)
        outputs = expert._run(
            expert_forward(expert.host, expert.expert_info, expert.schema, inputs, expert.timeout)
        )
        device = inputs[0].device if inputs else torch.device("cpu")
        outputs = tuple(t.to(device) for t in outputs)
        ctx.mark_non_differentiable(*(t for t in outputs if not t.is_floating_point()))
        return outputs

    @staticmethod
    @once_differentiable
    def backward(ctx, *grad_outputs: torch.Tensor):
        expert: RemoteExpert = ctx.expert
        inputs = ctx.saved_tensors
        grads = iter(
            expert._run(
                expert_backward(
                    expert.host, expert.expert_info, expert.schema, inputs, grad_outputs, expert.timeout
                )
            )
        )
        grad_inputs = [
            next(grads).to(device=t.device, dtype=t.dtype) if d.requires_grad else None
            for t, d in zip(inputs, expert.schema.inputs_schema)
        ]
        return (None, None, *grad_inputs)
