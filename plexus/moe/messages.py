"""The expert RPC protocol: protocol ids, messages, and how tensors ride in them.

Theory of operation
-------------------
A client asks a server for an expert's schema once (`INFO`), then calls `FORWARD` and
`BACKWARD` with batch-first tensors in schema order: forward sends the args, then the keyword
args in `kwargs_names` order; backward sends the same inputs followed by one gradient per output.
Forward answers with the outputs, backward with one gradient per input whose descriptor has
`requires_grad`. Every tensor is a `SerializedTensor` (plexus.compression) packed to bytes.

Small payloads go as one unary message each way. When the request or the expected answer would
pass `MAX_UNARY_PAYLOAD`, the client uses the `*-stream` protocol instead: the tensors are cut into
chunks of at most `STREAM_CHUNK_BYTES`, sent as a sequence of messages (the uid only in the first),
and the answer comes back the same way. Each frame stays far below the RPC frame limit, and the
server checks each tensor's header against the schema before it accepts the rest of its chunks,
so a peer cannot make it buffer more than `max_batch_size` rows of the declared shape.

Protocol ids are versioned strings of their own; no Python name travels on the wire.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass

import torch

from ..compression import (
    CompressionError,
    CompressionType,
    SerializedTensor,
    deserialize_torch_tensor,
    serialize_torch_tensor,
    split_for_streaming,
)
from ..compression.wire import ChunkAssembler
from ..p2p.messages import Message
from .schema import BatchTensorDescriptor

INFO_PROTOCOL = "/plexus/moe/info/1.0.0"
FORWARD_PROTOCOL = "/plexus/moe/forward/1.0.0"
BACKWARD_PROTOCOL = "/plexus/moe/backward/1.0.0"
FORWARD_STREAM_PROTOCOL = "/plexus/moe/forward-stream/1.0.0"
BACKWARD_STREAM_PROTOCOL = "/plexus/moe/backward-stream/1.0.0"

MAX_UNARY_PAYLOAD = 2 << 20  # above this a call streams (the RPC frame limit is 4 MiB)
STREAM_CHUNK_BYTES = 1 << 20
MAX_FRAME = 4 << 20
MAX_TENSORS = 256  # per request; an expert with more inputs than this is not a thing


@dataclass(frozen=True)
class InfoRequest(Message):
    uid: str


@dataclass(frozen=True)
class ExpertSchema(Message):
    """An expert's contract, as the server enforces it."""

    uid: str
    args_schema: tuple[BatchTensorDescriptor, ...]
    kwargs_names: tuple[str, ...]
    kwargs_schema: tuple[BatchTensorDescriptor, ...]
    outputs_schema: tuple[BatchTensorDescriptor, ...]
    outputs_tuple: bool  # the module returns a tuple (else a single tensor)
    max_batch_size: int

    def __post_init__(self):
        if len(self.kwargs_names) != len(self.kwargs_schema):
            raise ValueError("kwargs_names and kwargs_schema differ in length")
        if len(self.args_schema) + len(self.kwargs_schema) + len(self.outputs_schema) > MAX_TENSORS:
            raise ValueError(f"an expert may take and return at most {MAX_TENSORS} tensors in all")

    @property
    def inputs_schema(self) -> tuple[BatchTensorDescriptor, ...]:
        return self.args_schema + self.kwargs_schema

    @property
    def grad_inputs_schema(self) -> tuple[BatchTensorDescriptor, ...]:
        return tuple(d for d in self.inputs_schema if d.requires_grad)

    def as_dict(self) -> dict:
        """hivemind's `RemoteExpert.info` keys, plus Plexus's own."""
        kwargs = dict(zip(self.kwargs_names, self.kwargs_schema))
        outputs = self.outputs_schema if self.outputs_tuple else self.outputs_schema[0]
        return {
            "forward_schema": (self.args_schema, kwargs),
            "outputs_schema": outputs,
            "keyword_names": self.kwargs_names,
            "args_schema": self.args_schema,
            "kwargs_schema": kwargs,
            "max_batch_size": self.max_batch_size,
        }


@dataclass(frozen=True)
class ExpertRequest(Message):
    """Tensors for an expert; in a stream, the uid is set in the first message only."""

    uid: str
    tensors: list[bytes]


@dataclass(frozen=True)
class ExpertResponse(Message):
    tensors: list[bytes]


def serialize_tensors(
    tensors: Iterable[torch.Tensor], schema: Iterable[BatchTensorDescriptor]
) -> list[SerializedTensor]:
    """Each tensor with its descriptor's compression (lossy methods apply to floating tensors only)."""
    result = []
    for tensor, descriptor in zip(tensors, schema, strict=True):
        compression = (
            CompressionType(descriptor.compression) if tensor.is_floating_point() else CompressionType.NONE
        )
        result.append(serialize_torch_tensor(tensor.detach(), compression))
    return result


def payload_size(serialized: Iterable[SerializedTensor]) -> int:
    return sum(len(s.buffer) for s in serialized)


def unary_message(serialized: list[SerializedTensor]) -> list[bytes]:
    return [s.to_bytes() for s in serialized]


def stream_messages(
    serialized: list[SerializedTensor], chunk_bytes: int = STREAM_CHUNK_BYTES
) -> Iterator[list[bytes]]:
    """The tensors as lists of chunk bytes, each list holding at most about `chunk_bytes` of data."""
    batch: list[bytes] = []
    size = 0
    for tensor in serialized:
        for chunk in split_for_streaming(tensor, chunk_bytes):
            if batch and size + len(chunk.buffer) > chunk_bytes:
                yield batch
                batch, size = [], 0
            batch.append(chunk.to_bytes())
            size += len(chunk.buffer)
    yield batch  # possibly empty: a stream always carries at least one message


def deserialize_unary(tensors: list[bytes], check_header=None) -> list[torch.Tensor]:
    """Whole tensors from one message; CompressionError on anything malformed. `check_header(index,
    serialized)` may veto each tensor by its header (shape, dtype) before any is decoded."""
    if len(tensors) > MAX_TENSORS:
        raise CompressionError(f"{len(tensors)} tensors in one message, more than {MAX_TENSORS}")
    serialized = [SerializedTensor.from_bytes(data) for data in tensors]
    if check_header is not None:
        for index, header in enumerate(serialized):
            check_header(index, header)
    return [deserialize_torch_tensor(tensor) for tensor in serialized]


class StreamCollector:
    """Reassembles tensors from streamed chunk lists; `check_header(index, header)` may veto each
    tensor as soon as its header chunk arrives, before its data is buffered."""

    def __init__(self, check_header=None):
        self._assembler = ChunkAssembler()
        self._check_header = check_header
        self.tensors: list[torch.Tensor] = []

    def feed(self, chunks: list[bytes]) -> None:
        for data in chunks:
            chunk = SerializedTensor.from_bytes(data)
            if chunk.is_header:
                index = self._assembler.completed
                if index >= MAX_TENSORS:
                    raise CompressionError(f"more than {MAX_TENSORS} tensors in one stream")
                if self._check_header is not None:
                    self._check_header(index, chunk)
            whole = self._assembler.feed(chunk)
            if whole is not None:
                self.tensors.append(deserialize_torch_tensor(whole))

    def finish(self) -> list[torch.Tensor]:
        self._assembler.finish()
        return self.tensors


async def collect_stream(messages: AsyncIterator, check_header=None) -> list[torch.Tensor]:
    collector = StreamCollector(check_header)
    async for message in messages:
        collector.feed(message.tensors)
    return collector.finish()
