"""Wire messages of the all-reduce part stream (`{prefix}/allreduce/1.0.0`).

One bidirectional RPC stream runs from each sender to each reducer it sends a span to. Every part
travels as two RPC frames: a msgpack `PartHeader`, then the part's raw buffer (the `buffer` of a
`SerializedTensor`, sent straight from the tensor's memory when uncompressed). Keeping the buffer
out of the msgpack saves two full copies of the data on each side compared with nesting
`SerializedTensor.to_bytes()` inside a message. The reducer answers each part with an
`AnswerHeader`, followed by a buffer frame unless the answer is KEEP.

Only the first `PartHeader` of a stream carries `group_id` and `weight` (they hold for the whole
stream); later headers must leave them out. Buffers are validated against (numel, dtype,
compression) by `SerializedTensor` before any tensor memory is touched; `encode_tensor` and
`decode_tensor` turn a part into (dtype, compression, buffer) and back.

With reducer verification (`RobustAggregation.verify`), both directions go on after the last
part: the sender sends `VerifyDone` once it has every answer of every span, the reducer answers
`VerifySeed`, the sender sends its `VerifyReport` (scalars, see `verification.py`) and the
reducer closes with its `VerifyVerdict`. Answers then also carry the CenteredClip `radius`, and
the first answer the `weight` the reducer gave the sender.
"""

from __future__ import annotations

import enum
import math
import warnings
from dataclasses import dataclass

import torch

from ..compression import (
    AdaptiveCompressionBase,
    CompressionBase,
    CompressionInfo,
    NoCompression,
    SerializedTensor,
    deserialize_torch_tensor,
)
from ..compression.base import tensor_bytes_view
from ..compression.wire import DTYPES, CompressionType, dtype_name
from ..p2p.messages import Message

MAX_GROUP_ID_BYTES = 64


class AnswerKind(enum.IntEnum):
    """What an answer's buffer holds; the integer values are part of the wire."""

    AVERAGE = 0  # the group's average of the part (sent when the part came uncompressed)
    DELTA = 1  # average minus the sender's part as the reducer decoded it (after lossy compression)
    KEEP = 2  # no average exists (total weight 0): keep your local values; no buffer follows


def _check_tensor_fields(index: int, numel: int, dtype: str, compression: int) -> None:
    if index < 0 or numel <= 0:
        raise ValueError(f"part index must be >= 0 and numel > 0, got index={index}, numel={numel}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}")
    if compression not in CompressionType._value2member_map_:
        raise ValueError(f"unknown compression type {compression!r}")


@dataclass(frozen=True)
class PartHeader(Message):
    """Announces the next buffer frame: part `index` of the reducer's span, `numel` elements of
    `dtype`, encoded with `compression` (a CompressionType value)."""

    index: int
    numel: int
    dtype: str
    compression: int
    group_id: bytes | None = None
    weight: float | None = None

    def __post_init__(self) -> None:
        _check_tensor_fields(self.index, self.numel, self.dtype, self.compression)
        if (self.group_id is None) != (self.weight is None):
            raise ValueError("group_id and weight come together, on the first part of a stream only")
        if self.group_id is not None and not 0 < len(self.group_id) <= MAX_GROUP_ID_BYTES:
            raise ValueError(f"group_id must be 1 to {MAX_GROUP_ID_BYTES} bytes, got {len(self.group_id)}")
        if self.weight is not None and (not math.isfinite(self.weight) or self.weight < 0):
            raise ValueError(f"weight must be finite and >= 0, got {self.weight}")


@dataclass(frozen=True)
class AnswerHeader(Message):
    """The reducer's answer to part `index`; a buffer frame follows unless kind is KEEP."""

    index: int
    kind: int
    numel: int
    dtype: str
    compression: int
    radius: float | None = None  # robust mode: the CenteredClip radius of this part
    weight: float | None = None  # with verification, first answer only: the weight the sender got

    def __post_init__(self) -> None:
        _check_tensor_fields(self.index, self.numel, self.dtype, self.compression)
        if self.kind not in AnswerKind._value2member_map_:
            raise ValueError(f"unknown answer kind {self.kind!r}")
        for name in ("radius", "weight"):
            value = getattr(self, name)
            if value is not None and (not math.isfinite(value) or value < 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")


# --- reducer verification (after the last part) ------------------------------------------------------


@dataclass(frozen=True)
class VerifyDone(Message):
    """Sender -> reducer: this sender has every answer of every span it sent (or gave up on them)."""


@dataclass(frozen=True)
class VerifySeed(Message):
    """Reducer -> sender: the seed of this verifier's random directions, revealed only now."""

    seed: bytes

    def __post_init__(self) -> None:
        if len(self.seed) != 32:
            raise ValueError(f"a verification seed has 32 bytes, got {len(self.seed)}")


@dataclass(frozen=True)
class VerifyReport(Message):
    """Sender -> reducer: for each span of the group, the weight its reducer gave this sender and
    one `verification.PART_FIELDS` row of float64 per part it received, all rows in `rows`."""

    weights: list[float]
    parts: list[int]
    rows: bytes

    def __post_init__(self) -> None:
        if len(self.weights) != len(self.parts) or any(count < 0 for count in self.parts):
            raise ValueError("a report needs one weight and one part count >= 0 per span")
        if len(self.rows) != sum(self.parts) * 8 * 4:
            raise ValueError(
                f"{sum(self.parts)} parts need {sum(self.parts) * 32} bytes of rows, got {len(self.rows)}"
            )


@dataclass(frozen=True)
class VerifyVerdict(Message):
    """Reducer -> sender: per span, the indices of the parts this verifier found wrong, or None for
    a span it did not judge (its own, or one it lacked reports for)."""

    bad_parts: list[list[int] | None]


# --- buffers ---------------------------------------------------------------------------------------


def base_method(compression: CompressionBase, info: CompressionInfo) -> CompressionBase:
    """The method that will encode this part. Adaptive wrappers are looked through (so that a part
    that goes uncompressed is sent as a view, without a copy) only while they delegate in the
    standard way: a wrapper that overrides `compress` (to count, log or adjust) is called itself."""
    while (
        isinstance(compression, AdaptiveCompressionBase)
        and type(compression).compress is AdaptiveCompressionBase.compress
    ):
        compression = compression.choose_compression(info)
    return compression


def encode_tensor(tensor: torch.Tensor, info: CompressionInfo, compression: CompressionBase):
    """(dtype name, compression type, buffer) for a 1-D tensor; uncompressed data is a zero-copy
    view of the tensor's memory (valid until the tensor is written to)."""
    method = base_method(compression, info)
    if isinstance(method, NoCompression):
        return dtype_name(tensor.dtype), int(CompressionType.NONE), tensor_bytes_view(tensor.detach().cpu())
    serialized = method.compress(tensor, info)
    return serialized.dtype, int(serialized.compression), serialized.buffer


def decode_tensor(numel: int, dtype: str, compression: int, buffer: bytes) -> torch.Tensor:
    """A 1-D CPU tensor from a validated buffer; CompressionError if it does not fit the header.
    Uncompressed buffers become a read-only view (no copy): callers only read it."""
    serialized = SerializedTensor(buffer, (numel,), dtype, compression)  # checks the exact length
    if compression == CompressionType.NONE:
        with warnings.catch_warnings():  # torch warns that bytes are read-only; we never write
            warnings.simplefilter("ignore")
            return torch.frombuffer(buffer, dtype=DTYPES[dtype])
    return deserialize_torch_tensor(serialized).reshape(-1)
