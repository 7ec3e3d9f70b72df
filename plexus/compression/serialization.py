"""Tensor <-> message by method name, the hivemind-compatible entry points.

`deserialize_torch_tensor` picks the method from the message itself, so one function decodes
whatever any peer sent, whichever wrapper chose the method on its side.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

import torch

from .base import CompressionBase, CompressionInfo, NoCompression
from .blockwise4 import Blockwise4BitQuantization
from .floating import Float16Compression, ScaledFloat16Compression
from .quantization import BlockwiseQuantization, Quantile8BitQuantization, Uniform8BitQuantization
from .wire import ChunkAssembler, CompressionError, CompressionType, SerializedTensor

BASE_COMPRESSION_TYPES: dict[str, CompressionBase] = {
    "NONE": NoCompression(),
    "FLOAT16": Float16Compression(),
    "MEANSTD_16BIT": ScaledFloat16Compression(),
    "UNIFORM_8BIT": Uniform8BitQuantization(),
    "QUANTILE_8BIT": Quantile8BitQuantization(),
    "BLOCKWISE_8BIT": BlockwiseQuantization(),
    "BLOCKWISE_4BIT": Blockwise4BitQuantization(),
}
"""One instance of each basic method, by its `CompressionType` name."""
_BY_CODE = {CompressionType[name]: method for name, method in BASE_COMPRESSION_TYPES.items()}


def serialize_torch_tensor(
    tensor: torch.Tensor,
    compression_type: CompressionType = CompressionType.NONE,
    info: CompressionInfo | None = None,
    allow_inplace: bool = False,
) -> SerializedTensor:
    """Serialize `tensor` with one of the base methods (lossy ones apply to float tensors only)."""
    method = _BY_CODE[CompressionType(compression_type)]
    return method.compress(tensor, info or CompressionInfo.from_tensor(tensor), allow_inplace)


def deserialize_torch_tensor(serialized: SerializedTensor) -> torch.Tensor:
    """Rebuild a CPU tensor from a whole message; CompressionError if it is not one."""
    if not isinstance(serialized, SerializedTensor):
        raise CompressionError(f"expected a SerializedTensor, got {type(serialized).__name__}")
    if serialized.chunks != 1:
        raise CompressionError("this is a streaming chunk; combine_from_streaming the chunks first")
    tensor = _BY_CODE[CompressionType(serialized.compression)].extract(serialized)
    return tensor.requires_grad_(serialized.requires_grad) if serialized.requires_grad else tensor


async def deserialize_tensor_stream(stream: AsyncIterator[Iterable[SerializedTensor]]) -> list[torch.Tensor]:
    """Read a stream whose items are lists of chunks (as `split_for_streaming` makes them, any
    number per item) to its end, and return the tensors in order."""
    assembler, tensors = ChunkAssembler(), []
    async for chunks in stream:
        for chunk in chunks:
            whole = assembler.feed(chunk)
            if whole is not None:
                tensors.append(deserialize_torch_tensor(whole))
    assembler.finish()
    return tensors
