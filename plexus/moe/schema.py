"""What an expert takes and returns: one `BatchTensorDescriptor` per tensor, without the batch dim.

A server describes its expert with these (the args, the keyword args by name, the outputs), sends
them to clients on request, and checks every incoming tensor against them before any compute.
The descriptor is a wire message itself, so the schema a client reads is exactly what the server
enforces. A `None` dimension accepts any length (all tensors of one batch must still agree to be
concatenated; the runtime only batches requests whose shapes match).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..compression.wire import DTYPE_NAMES, DTYPES, FLOATING_DTYPES, CompressionType
from ..p2p.messages import Message


@dataclass(frozen=True, init=False)
class BatchTensorDescriptor(Message):
    """One batch-first tensor of an expert's inputs or outputs.

    `shape` excludes the batch dimension; `requires_grad` says whether the expert returns a
    gradient for it (floating dtypes only); `compression` is how it travels on the wire.
    """

    shape: tuple[int | None, ...]
    dtype: str = "float32"
    requires_grad: bool = False
    compression: int = CompressionType.NONE

    def __init__(
        self,
        *sizes,
        shape: Sequence[int | None] | None = None,
        dtype: str | torch.dtype = "float32",
        requires_grad: bool = False,
        compression: int = CompressionType.NONE,
    ):
        """`BatchTensorDescriptor((16, 4))` or, as in hivemind, `BatchTensorDescriptor(16, 4)`: the
        sizes after the batch dimension. `dtype` is a wire name ("float32") or a torch dtype."""
        if shape is None:
            shape = sizes[0] if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)) else sizes
        elif sizes:
            raise TypeError("give the shape either as positional sizes or as shape=, not both")
        if isinstance(dtype, torch.dtype):
            if dtype not in DTYPE_NAMES:
                raise ValueError(f"tensors of dtype {dtype} cannot travel to an expert")
            dtype = DTYPE_NAMES[dtype]
        for name, value in (
            ("shape", tuple(shape)),
            ("dtype", dtype),
            ("requires_grad", requires_grad),
            ("compression", compression),
        ):
            object.__setattr__(self, name, value)
        self.__post_init__()

    def __post_init__(self):
        if any(d is not None and (type(d) is not int or d < 0) for d in self.shape):
            raise ValueError(f"descriptor shape {self.shape} must hold non-negative ints or None")
        if self.dtype not in DTYPES:
            raise ValueError(f"descriptor dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        if self.requires_grad and self.dtype not in FLOATING_DTYPES:
            raise ValueError(f"a {self.dtype} tensor cannot require grad")
        if self.compression not in CompressionType._value2member_map_:
            raise ValueError(f"unknown compression {self.compression!r}")
        object.__setattr__(self, "compression", CompressionType(self.compression))

    @classmethod
    def from_tensor(
        cls, tensor: torch.Tensor, compression: int = CompressionType.NONE, requires_grad: bool | None = None
    ) -> BatchTensorDescriptor:
        """Describe a sample batch; floating tensors require grad unless told otherwise, and only
        they are compressed."""
        if tensor.dim() == 0:
            raise ValueError("an expert's tensors are batch-first; a 0-d tensor has no batch dimension")
        dtype = DTYPE_NAMES.get(tensor.dtype)
        if dtype is None:
            raise ValueError(f"tensors of dtype {tensor.dtype} cannot travel to an expert")
        if requires_grad is None:
            requires_grad = dtype in FLOATING_DTYPES
        if dtype not in FLOATING_DTYPES:
            compression = (
                CompressionType.NONE
            )  # lossy methods are for floats; masks and ids travel as they are
        return cls(
            shape=tuple(tensor.shape[1:]),
            dtype=dtype,
            requires_grad=requires_grad,
            compression=CompressionType(compression),
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def make_zeros(self, batch_size: int, device: torch.device | str | None = None) -> torch.Tensor:
        """A zero batch of this shape (`None` dims become 1)."""
        shape = (batch_size, *(1 if d is None else d for d in self.shape))
        return torch.zeros(shape, dtype=self.torch_dtype, device=device)

    def mismatch(self, shape: tuple[int, ...], dtype: str) -> str | None:
        """Why a batch of this (full) shape and dtype does not fit, or None when it does."""
        if dtype != self.dtype:
            return f"dtype {dtype}, expected {self.dtype}"
        if len(shape) != len(self.shape) + 1 or any(
            want is not None and got != want for got, want in zip(shape[1:], self.shape)
        ):
            expected = ", ".join("*" if d is None else str(d) for d in self.shape)
            return (
                f"shape {tuple(shape)}, expected (batch, {expected})"
                if self.shape
                else f"shape {tuple(shape)}, expected (batch,)"
            )
        return None

    def __repr__(self) -> str:
        shape = ", ".join("*" if d is None else str(d) for d in self.shape)
        return (
            f"BatchTensorDescriptor((batch, {shape}), {self.dtype}"
            f"{', requires_grad' if self.requires_grad else ''}, {CompressionType(self.compression).name})"
        )
