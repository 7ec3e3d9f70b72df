"""Wire messages of state download (`/plexus/averaging/state/1.0.0`) and their bounds.

A newcomer opens one stream per request and writes one `StateRequest` frame (RPC framing, see
`plexus.p2p.rpc`). The donor answers with a `StateReply` frame and, for a CHUNKS request that it
accepts, one raw frame per requested chunk, in the order asked:

    MANIFEST request -> StateReply(OK, manifest)             (or BUSY / NOT_SHARING)
    CHUNKS request   -> StateReply(OK), chunk, chunk, ...     (or BUSY / NOT_SHARING / UNKNOWN_SNAPSHOT)

The state travels as one byte string: the buffers of the serialized tensors (`SerializedTensor`
of each, in order) concatenated, cut into `chunk_size` chunks (the last may be shorter). The
manifest carries everything else: the msgpack metadata, one `TensorHeader` per tensor, the
donor's priority when the snapshot was taken and the SHA-256 of every chunk, so each chunk is
checked on arrival and a chunk with a given hash may be fetched from any donor whose manifest
lists that hash. A request that is not a valid message is
answered with an RPC error frame; the statuses above are the refusals a well-behaved caller
handles (try another donor, back off, ask for a fresh manifest).

Every field is validated on construction, so a decoded message is always self-consistent, and
every size has a bound below.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from functools import cached_property

from ..compression.wire import (
    DTYPES,
    MAX_DIM,
    MAX_NDIM,
    CompressionError,
    CompressionType,
    expected_buffer_length,
)
from ..p2p.messages import Message

STATE_PROTOCOL = "/plexus/averaging/state/1.0.0"
HASH_SIZE = 32  # SHA-256
SNAPSHOT_ID_SIZE = 16
MAX_PREFIX_LENGTH = 256
MAX_CHUNKS_PER_REQUEST = 64
MIN_CHUNK_SIZE = 1 << 12
MAX_CHUNK_SIZE = 1 << 22  # fits the RPC layer's default 4 MiB frame bound on the reply side
MAX_CHUNKS = 1 << 18  # 8 MiB of hashes; 256 GiB of state at the largest chunk size
MAX_TENSORS = 1 << 17
MAX_METADATA_SIZE = 8 << 20
MAX_REQUEST_SIZE = 4 << 10
MAX_DETAIL_LENGTH = 1 << 10
MAX_REPLY_SIZE = MAX_METADATA_SIZE + MAX_CHUNKS * HASH_SIZE + MAX_TENSORS * 64 + (1 << 16)


class RequestKind(enum.IntEnum):
    MANIFEST = 0  # take (or reuse) a snapshot and describe it
    CHUNKS = 1  # send these chunks of that snapshot


class ReplyStatus(enum.IntEnum):
    OK = 0
    BUSY = 1  # too many downloads in flight here: back off or ask another donor
    NOT_SHARING = 2  # no state is shared under this prefix here (any more)
    UNKNOWN_SNAPSHOT = 3  # the snapshot was dropped: ask for a fresh manifest


@dataclass(frozen=True)
class StateRequest(Message):
    prefix: str
    kind: int
    snapshot_id: bytes = b""
    chunks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 0 < len(self.prefix) <= MAX_PREFIX_LENGTH:
            raise ValueError(f"prefix must have 1 to {MAX_PREFIX_LENGTH} characters, got {len(self.prefix)}")
        if self.kind == RequestKind.MANIFEST:
            if self.snapshot_id or self.chunks:
                raise ValueError("a MANIFEST request carries no snapshot id and no chunks")
        elif self.kind == RequestKind.CHUNKS:
            if len(self.snapshot_id) != SNAPSHOT_ID_SIZE:
                raise ValueError(f"snapshot_id must have {SNAPSHOT_ID_SIZE} bytes")
            if not 0 < len(self.chunks) <= MAX_CHUNKS_PER_REQUEST:
                raise ValueError(
                    f"a CHUNKS request asks for 1 to {MAX_CHUNKS_PER_REQUEST} chunks, not {len(self.chunks)}"
                )
            if any(index < 0 or index >= MAX_CHUNKS for index in self.chunks):
                raise ValueError(f"chunk indices must be in [0, {MAX_CHUNKS})")
        else:
            raise ValueError(f"unknown request kind {self.kind!r}")


@dataclass(frozen=True)
class TensorHeader(Message):
    """A serialized tensor without its buffer; `nbytes` is the buffer's exact length."""

    size: tuple[int, ...]
    dtype: str
    compression: int
    requires_grad: bool
    nbytes: int

    def __post_init__(self) -> None:
        if len(self.size) > MAX_NDIM or any(d < 0 or d > MAX_DIM for d in self.size):
            raise ValueError(
                f"tensor size {self.size} is outside the limits ({MAX_NDIM} dims of at most {MAX_DIM})"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}")
        if self.compression not in CompressionType._value2member_map_:
            raise ValueError(f"unknown compression type {self.compression!r}")
        try:
            expected = expected_buffer_length(self.compression, self.size, self.dtype)
        except CompressionError as error:
            raise ValueError(str(error)) from None
        if self.nbytes != expected:
            raise ValueError(
                f"a tensor of size {self.size}, {self.dtype}, compression {self.compression} "
                f"has {expected} bytes, not {self.nbytes}"
            )


@dataclass(frozen=True)
class StateManifest(Message):
    """One snapshot of a donor's state: what it holds and the hash of every chunk."""

    snapshot_id: bytes
    metadata: bytes  # MSGPackSerializer bytes of the donor's metadata
    tensors: tuple[TensorHeader, ...]
    chunk_size: int
    chunk_hashes: bytes  # HASH_SIZE bytes per chunk, in order
    # the donor's priority (e.g. its epoch) when the snapshot was taken; None from donors that
    # predate this field. Its DHT declaration may lag behind a step, this may not.
    priority: float | None = None

    def __post_init__(self) -> None:
        if len(self.snapshot_id) != SNAPSHOT_ID_SIZE:
            raise ValueError(f"snapshot_id must have {SNAPSHOT_ID_SIZE} bytes")
        if self.priority is not None and not math.isfinite(self.priority):
            raise ValueError(f"priority must be finite, got {self.priority}")
        if len(self.metadata) > MAX_METADATA_SIZE:
            raise ValueError(f"metadata of {len(self.metadata)} bytes exceeds {MAX_METADATA_SIZE}")
        if len(self.tensors) > MAX_TENSORS:
            raise ValueError(f"{len(self.tensors)} tensors exceed the limit of {MAX_TENSORS}")
        if not MIN_CHUNK_SIZE <= self.chunk_size <= MAX_CHUNK_SIZE:
            raise ValueError(f"chunk_size {self.chunk_size} is outside [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}]")
        num_chunks = math.ceil(self.total_bytes / self.chunk_size)
        if num_chunks > MAX_CHUNKS:
            raise ValueError(f"{num_chunks} chunks exceed the limit of {MAX_CHUNKS}")
        if len(self.chunk_hashes) != num_chunks * HASH_SIZE:
            raise ValueError(
                f"{self.total_bytes} bytes in {self.chunk_size}-byte chunks need {num_chunks} "
                f"hashes, got {len(self.chunk_hashes) / HASH_SIZE:g}"
            )

    @cached_property
    def total_bytes(self) -> int:
        return sum(tensor.nbytes for tensor in self.tensors)

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_hashes) // HASH_SIZE

    def chunk_hash(self, index: int) -> bytes:
        return self.chunk_hashes[index * HASH_SIZE : (index + 1) * HASH_SIZE]

    def chunk_length(self, index: int) -> int:
        return min(self.chunk_size, self.total_bytes - index * self.chunk_size)


@dataclass(frozen=True)
class StateReply(Message):
    status: int
    detail: str = ""
    manifest: StateManifest | None = None

    def __post_init__(self) -> None:
        if self.status not in ReplyStatus._value2member_map_:
            raise ValueError(f"unknown reply status {self.status!r}")
        if len(self.detail) > MAX_DETAIL_LENGTH:
            raise ValueError(f"detail exceeds {MAX_DETAIL_LENGTH} characters")
