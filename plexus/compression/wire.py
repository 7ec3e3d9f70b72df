"""The wire message for one (possibly compressed) tensor, and how it is chunked for streaming.

Theory of operation
-------------------
A `SerializedTensor` is what every compression method produces and consumes: an opaque `buffer`,
the original tensor's `size` and `dtype` name, the `compression` method (a `CompressionType`) and
`requires_grad`. It is ours, not hivemind's protobuf: `to_bytes()` packs it as a msgpack array
``[buffer, size, dtype, compression, requires_grad, chunks]``.

Everything the peer sends is checked before any tensor memory is touched, because the length of
the buffer is a pure function of (compression, size, dtype) (`expected_buffer_length`). A message
whose buffer does not have exactly that length, whose dtype is not one we know, whose dims are
negative or too many, is refused with `CompressionError` (a `ValueError`) and nothing else: that
is the one exception type the decoding side ever lets out, whatever the bytes.

Streaming: a large tensor is cut into chunks (`split_for_streaming`). The first chunk is a normal
header (size, dtype, compression) with `chunks=N` and a prefix of the buffer; the N-1 chunks after
it carry only buffer bytes and have ``dtype=""``, ``chunks=0``. A complete, unchunked message has
``chunks=1``. `combine_from_streaming` glues them back and checks the total length.

Layouts of `buffer` (little-endian, as torch and numpy store them on every platform we support):

=============== ============================================================================
NONE            the raw bytes of the tensor (bfloat16 as its 16-bit pattern)
FLOAT16         numel float16 values
MEANSTD_16BIT   numel float16 values, then per row (last axis) float32 means, float32 stds
UNIFORM_8BIT    256 float32 codebook entries, then numel uint8 codes
QUANTILE_8BIT   256 float32 codebook entries, then numel uint8 codes
BLOCKWISE_8BIT  256 float32 codebook entries, ceil(numel/4096) float32 absmax, numel uint8 codes
BLOCKWISE_4BIT  ceil(numel/256) float32 absmax, ceil(numel/2) bytes of two 4-bit codes (Plexus's own)
=============== ============================================================================
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

import msgpack
import torch

from ..errors import PlexusError

MAX_NDIM = 32  # torch itself allows 64; no real parameter comes near either
MAX_DIM = 2**48  # per-dimension bound; the buffer-length rule bounds the product of non-empty tensors
MAX_SPAN = 2**48  # bound on the product of dims counted as at least 1 (the strides of empty tensors)
MAX_CHUNKS = 2**24
CODEBOOK_SIZE = 256
BLOCK_SIZE = 4096  # elements per block of BLOCKWISE_8BIT; fixed so the layout is self-describing
BLOCK4_SIZE = 256  # elements per block of BLOCKWISE_4BIT: smaller blocks, since 4 bits are coarse
DEFAULT_CHUNK_SIZE_BYTES = 2**16


class CompressionError(PlexusError, ValueError):
    """A serialized tensor is malformed, truncated or inconsistent (the sender's fault), or a
    tensor cannot be serialized as asked (the caller's fault); the message says which."""


class CompressionType(enum.IntEnum):
    """The compression method of a `SerializedTensor`; the integer values are part of the wire.

    The values are hivemind's (runtime.proto), so `compression=2` means FLOAT16 in both; so are the
    protobuf-enum helpers `Name`, `Value`, `keys`, `values` and `items`.
    """

    NONE = 0
    MEANSTD_16BIT = 1
    FLOAT16 = 2
    QUANTILE_8BIT = 3
    UNIFORM_8BIT = 4
    BLOCKWISE_8BIT = 5
    BLOCKWISE_4BIT = 6  # Plexus's own (hivemind has no 4-bit method)

    @classmethod
    def Name(cls, number: int) -> str:  # protobuf's enum API
        return cls(number).name

    @classmethod
    def Value(cls, name: str) -> int:
        return int(cls[name])

    @classmethod
    def keys(cls) -> list[str]:
        return [member.name for member in cls]

    @classmethod
    def values(cls) -> list[int]:
        return [int(member) for member in cls]

    @classmethod
    def items(cls) -> list[tuple[str, int]]:
        return [(member.name, int(member)) for member in cls]


# Wire names of the dtypes we carry, and the torch dtype each stands for.
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
FLOATING_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16"})


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype; CompressionError for dtypes we do not carry."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise CompressionError(
            f"cannot serialize a tensor of dtype {dtype}: supported dtypes are {sorted(DTYPES)}"
        ) from None


def expected_buffer_length(compression: int, size: Sequence[int], dtype: str) -> int:
    """Exact byte length of the buffer of a complete message with these fields."""
    numel = math.prod(size)
    if compression == CompressionType.NONE:
        return numel * DTYPES[dtype].itemsize
    if compression == CompressionType.FLOAT16:
        return numel * 2
    if compression == CompressionType.MEANSTD_16BIT:
        return numel * 2 + meanstd_rows(size) * 8
    if compression in (CompressionType.UNIFORM_8BIT, CompressionType.QUANTILE_8BIT):
        return CODEBOOK_SIZE * 4 + numel
    if compression == CompressionType.BLOCKWISE_8BIT:
        return CODEBOOK_SIZE * 4 + 4 * -(-numel // BLOCK_SIZE) + numel
    if compression == CompressionType.BLOCKWISE_4BIT:
        return 4 * -(-numel // BLOCK4_SIZE) + -(-numel // 2)
    raise CompressionError(f"unknown compression type {compression!r}")


def meanstd_rows(size: Sequence[int]) -> int:
    """Number of (mean, std) pairs of MEANSTD_16BIT: one per row of the last axis (a 0-d tensor
    is one row of one element; an empty tensor has none)."""
    numel = math.prod(size)
    if numel == 0:
        return 0
    return numel // size[-1] if size else 1


@dataclass(frozen=True)
class SerializedTensor:
    """One tensor (or one streaming chunk of it) as it travels between peers.

    Fields are validated on construction, so an instance is always self-consistent: `buffer` has
    exactly the length its method implies (for `chunks=1`), at most that (for a first chunk of a
    stream) or any length (for a continuation chunk, ``dtype=""``).
    """

    buffer: bytes
    size: tuple[int, ...]
    dtype: str
    compression: int
    requires_grad: bool = False
    chunks: int = 1  # 1: a whole tensor; N > 1: first of N streaming chunks; 0: continuation chunk

    def __post_init__(self) -> None:
        if not isinstance(self.buffer, bytes):
            raise CompressionError(f"buffer must be bytes, got {type(self.buffer).__name__}")
        if not isinstance(self.size, tuple) or not all(type(d) is int for d in self.size):
            raise CompressionError(f"size must be a tuple of ints, got {self.size!r}")
        if len(self.size) > MAX_NDIM:
            raise CompressionError(f"tensor has {len(self.size)} dims, more than the limit of {MAX_NDIM}")
        if any(d < 0 or d > MAX_DIM for d in self.size):
            raise CompressionError(f"size {self.size} has a dimension outside [0, {MAX_DIM}]")
        if math.prod(max(d, 1) for d in self.size) > MAX_SPAN:
            raise CompressionError(f"size {self.size} spans more than {MAX_SPAN} elements")
        if type(self.requires_grad) is not bool:
            raise CompressionError(f"requires_grad must be a bool, got {self.requires_grad!r}")
        if type(self.chunks) is not int or not 0 <= self.chunks <= MAX_CHUNKS:
            raise CompressionError(f"chunks must be an int in [0, {MAX_CHUNKS}], got {self.chunks!r}")
        if type(self.compression) is not int and not isinstance(self.compression, CompressionType):
            raise CompressionError(f"compression must be an int, got {self.compression!r}")
        if self.chunks == 0:
            if self.dtype != "" or self.size != () or self.compression != 0 or self.requires_grad:
                raise CompressionError("a continuation chunk must carry only buffer bytes (dtype='')")
            return
        if self.dtype not in DTYPES:
            raise CompressionError(f"unknown dtype {self.dtype!r}; expected one of {sorted(DTYPES)}")
        if self.compression not in CompressionType._value2member_map_:
            raise CompressionError(f"unknown compression type {self.compression!r}")
        if self.compression != CompressionType.NONE and self.dtype not in FLOATING_DTYPES:
            raise CompressionError(
                f"{CompressionType(self.compression).name} applies to floating dtypes, not {self.dtype}"
            )
        if self.requires_grad and self.dtype not in FLOATING_DTYPES | {"complex64", "complex128"}:
            raise CompressionError(f"requires_grad=True is impossible for dtype {self.dtype}")
        expected = expected_buffer_length(self.compression, self.size, self.dtype)
        if self.chunks == 1 and len(self.buffer) != expected:
            raise CompressionError(
                f"buffer of {len(self.buffer)} bytes does not match {CompressionType(self.compression).name} "
                f"of size {self.size} and dtype {self.dtype}, which needs exactly {expected} bytes"
            )
        if self.chunks > 1 and len(self.buffer) > expected:
            raise CompressionError(f"first chunk has {len(self.buffer)} bytes, more than all {expected}")

    @property
    def is_header(self) -> bool:
        return self.chunks != 0

    def to_bytes(self) -> bytes:
        """Pack as msgpack (the buffer is written once, as a bin field)."""
        fields = [self.buffer, list(self.size), self.dtype, int(self.compression)]
        return msgpack.packb([*fields, self.requires_grad, self.chunks], use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> SerializedTensor:
        """Unpack and validate a message from a peer; any malformed input raises CompressionError."""
        try:
            fields = msgpack.unpackb(data, raw=False, use_list=False, strict_map_key=True)
        except Exception as e:  # msgpack raises several unrelated types on garbage; translate once
            raise CompressionError(f"serialized tensor is not valid msgpack: {e}") from e
        if type(fields) is not tuple or len(fields) != 6:
            raise CompressionError("serialized tensor must be a msgpack array of 6 fields")
        buffer, size, dtype, compression, requires_grad, chunks = fields
        if type(size) is not tuple:
            raise CompressionError(f"size must be an array of ints, got {type(size).__name__}")
        if type(dtype) is not str:
            raise CompressionError(f"dtype must be a string, got {type(dtype).__name__}")
        if type(compression) is not int:
            raise CompressionError(f"compression must be an int, got {type(compression).__name__}")
        return cls(buffer, size, dtype, compression, requires_grad, chunks)


def split_for_streaming(
    serialized: SerializedTensor, chunk_size_bytes: int = DEFAULT_CHUNK_SIZE_BYTES
) -> Iterator[SerializedTensor]:
    """Cut a whole message into a header chunk and continuation chunks of at most
    `chunk_size_bytes` of buffer each (always at least one chunk, even for an empty buffer)."""
    if chunk_size_bytes <= 0:
        raise ValueError(f"chunk_size_bytes must be positive, got {chunk_size_bytes}")
    if serialized.chunks != 1:
        raise ValueError("split_for_streaming takes a whole tensor (chunks=1), not a chunk")
    view = memoryview(serialized.buffer)
    n_chunks = max(1, -(-len(view) // chunk_size_bytes))
    if n_chunks > MAX_CHUNKS:
        raise ValueError(f"{n_chunks} chunks exceed the limit of {MAX_CHUNKS}; use larger chunks")
    if n_chunks == 1:
        yield serialized
        return
    yield replace(serialized, buffer=bytes(view[:chunk_size_bytes]), chunks=n_chunks)
    for start in range(chunk_size_bytes, len(view), chunk_size_bytes):
        yield SerializedTensor(bytes(view[start : start + chunk_size_bytes]), (), "", 0, False, chunks=0)


class ChunkAssembler:
    """Reassembles whole messages from a stream of chunks, one chunk at a time (no I/O here).

    `feed` returns the completed message when its last chunk arrives, else None; `finish` checks
    that the stream did not end inside a tensor. Memory is bounded by the size the header declared.
    """

    def __init__(self) -> None:
        self._header: SerializedTensor | None = None
        self._parts: list[bytes] = []
        self._received = 0
        self._expected = 0
        self.completed = 0

    def feed(self, chunk: SerializedTensor) -> SerializedTensor | None:
        if not isinstance(chunk, SerializedTensor):
            raise CompressionError(f"expected a SerializedTensor chunk, got {type(chunk).__name__}")
        if chunk.is_header:
            if self._header is not None:
                raise CompressionError(
                    f"tensor {self.completed} ended after {len(self._parts)} of {self._header.chunks} chunks"
                )
            if chunk.chunks == 1:
                self.completed += 1
                return chunk
            self._header, self._parts, self._received = chunk, [chunk.buffer], len(chunk.buffer)
            self._expected = expected_buffer_length(chunk.compression, chunk.size, chunk.dtype)
            return None
        if self._header is None:
            raise CompressionError(f"a continuation chunk arrived where tensor {self.completed} should begin")
        self._received += len(chunk.buffer)
        if self._received > self._expected:
            declared = self._expected
            raise CompressionError(f"tensor {self.completed} got more than the {declared} bytes declared")
        self._parts.append(chunk.buffer)
        if len(self._parts) < self._header.chunks:
            return None
        header, parts = self._header, self._parts
        self._header, self._parts = None, []
        self.completed += 1
        return replace(header, buffer=b"".join(parts), chunks=1)  # validates the total length

    def finish(self) -> None:
        if self._header is not None:
            raise CompressionError(
                f"stream ended inside tensor {self.completed} "
                f"({len(self._parts)} of {self._header.chunks} chunks)"
            )


def combine_from_streaming(chunks: Iterable[SerializedTensor]) -> SerializedTensor:
    """Inverse of `split_for_streaming`: exactly one tensor's chunks in, one whole message out."""
    assembler, result = ChunkAssembler(), None
    for chunk in chunks:
        if result is not None:
            raise CompressionError("chunks continue after the tensor was complete")
        result = assembler.feed(chunk)
    assembler.finish()
    if result is None:
        raise CompressionError("no chunks given")
    return result
