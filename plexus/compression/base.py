"""What a compression method is, what it is told about a tensor, and the lossless method.

A method turns a tensor into a `SerializedTensor` (`compress`) and back (`extract`), and predicts
its ratio (`estimate_compression_ratio`) so that the all-reduce can cut parts of a given wire size
before compressing them. `CompressionInfo` tells a method what it compresses (key, role, part),
which is what the adaptive wrappers choose by.

Copies: `compress` makes one copy of the data (torch storage -> the message's bytes); `extract`
makes one (bytes -> a fresh, writable tensor). Tensors on an accelerator are reduced there and only
the result crosses to the host.
"""

from __future__ import annotations

import enum
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .wire import DTYPES, FLOATING_DTYPES, CompressionError, CompressionType, SerializedTensor, dtype_name


class TensorRole(enum.Enum):
    """What a tensor is for; `RoleAdaptiveCompression` chooses its method by this."""

    ACTIVATION = enum.auto()
    PARAMETER = enum.auto()
    GRADIENT = enum.auto()
    OPTIMIZER = enum.auto()
    UNSPECIFIED = enum.auto()


@dataclass(frozen=True)
class TensorDescriptor:
    """Shape and type of a tensor, without its data."""

    size: tuple[int, ...]
    dtype: torch.dtype | None = None
    layout: torch.layout = torch.strided
    device: torch.device | None = None
    requires_grad: bool = False
    pin_memory: bool = False

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> TensorDescriptor:
        return cls(tuple(tensor.shape), tensor.dtype, tensor.layout, tensor.device, tensor.requires_grad)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.size

    def numel(self) -> int:
        return math.prod(self.size)

    def make_zeros(self, **kwargs: Any) -> torch.Tensor:
        options: dict[str, Any] = dict(
            dtype=self.dtype, layout=self.layout, device=self.device, requires_grad=self.requires_grad
        )
        options.update(kwargs)
        return torch.zeros(self.size, **options)


@dataclass(frozen=True)
class CompressionInfo:
    """Everything a method may want to know about the tensor it compresses."""

    key: Any
    descriptor: TensorDescriptor
    role: TensorRole = TensorRole.UNSPECIFIED
    part_index: int = 0
    part_size: int | None = None

    @classmethod
    def from_tensor(
        cls,
        tensor: torch.Tensor,
        key: Any = None,
        descriptor: TensorDescriptor | None = None,
        role: TensorRole = TensorRole.UNSPECIFIED,
    ) -> CompressionInfo:
        return cls(key, descriptor or TensorDescriptor.from_tensor(tensor), role)

    def get_part(self, part_index: int, part_size: int | None) -> CompressionInfo:
        """The same tensor's info for one part of it (the all-reduce compresses parts)."""
        return CompressionInfo(self.key, self.descriptor, self.role, part_index, part_size)


class CompressionBase(ABC):
    """A way to put a tensor on the wire. Stateless: one instance may serve many threads."""

    compression_type: CompressionType

    @abstractmethod
    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False
    ) -> SerializedTensor:
        """Serialize `tensor`. With `allow_inplace` a method may scribble on it to save memory
        (hivemind's contract); the built-in methods never need to and leave it untouched."""

    @abstractmethod
    def extract(self, serialized: SerializedTensor) -> torch.Tensor:
        """Rebuild a CPU tensor of the original size and dtype from a validated message."""

    @abstractmethod
    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        """Wire bytes per original byte, for large tensors (fixed per-message overhead ignored)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def contiguous_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` detached, on the host and contiguous: a view when it already is all three."""
    return tensor.detach().to("cpu").contiguous()


def tensor_bytes_view(tensor: torch.Tensor) -> memoryview:
    """A zero-copy view of a contiguous CPU tensor's bytes (bfloat16 as its 16-bit pattern)."""
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    array = tensor.reshape(-1).numpy()
    return memoryview(array).cast("B")  # type: ignore[arg-type]  # numpy declares its buffer for 3.12+ only


def join_buffers(*tensors: torch.Tensor) -> bytes:
    """Concatenate the bytes of several CPU tensors into one `bytes`, copying each once."""
    return b"".join(tensor_bytes_view(contiguous_cpu(t)) for t in tensors)


def read_array(serialized: SerializedTensor, offset: int, count: int, dtype: np.dtype) -> np.ndarray:
    """A read-only numpy view of part of the buffer (no copy; lengths were checked on decode)."""
    return np.frombuffer(serialized.buffer, dtype=dtype, count=count, offset=offset)


FLOATING_TORCH_DTYPES = frozenset(DTYPES[name] for name in FLOATING_DTYPES)
# numpy dtype of each wire dtype's bytes (bfloat16 has none: it travels as its int16 pattern)
NUMPY_DTYPES = {
    name: np.dtype(np.int16) if name == "bfloat16" else torch.empty(0, dtype=dtype).numpy().dtype
    for name, dtype in DTYPES.items()
}


def is_floating(tensor: torch.Tensor) -> bool:
    """Whether a lossy method applies: the four float dtypes we carry (not complex, not float8)."""
    return tensor.dtype in FLOATING_TORCH_DTYPES


class NoCompression(CompressionBase):
    """Raw bytes, bit-exact for every dtype; bfloat16 travels as bfloat16 (its int16 pattern),
    NaN and inf travel unchanged."""

    compression_type = CompressionType.NONE

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False
    ) -> SerializedTensor:
        name = dtype_name(tensor.dtype)
        data = contiguous_cpu(tensor)
        buffer = bytes(tensor_bytes_view(data))
        size = tuple(tensor.shape)
        return SerializedTensor(buffer, size, name, self.compression_type, tensor.requires_grad)

    def extract(self, serialized: SerializedTensor) -> torch.Tensor:
        dtype = DTYPES[serialized.dtype]
        array = np.frombuffer(serialized.buffer, dtype=NUMPY_DTYPES[serialized.dtype])
        if dtype == torch.bool and array.size and array.view(np.uint8).max() > 1:
            raise CompressionError("a bool tensor's bytes must each be 0 or 1")
        tensor = torch.from_numpy(array.copy())  # the one copy: bytes are immutable, tensors are not
        if dtype == torch.bfloat16:
            tensor = tensor.view(torch.bfloat16)
        return tensor.reshape(serialized.size)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return 1.0
