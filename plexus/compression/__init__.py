"""Tensor compression for the wire: methods, adaptive wrappers and (de)serialization helpers.

Names mirror hivemind.compression; the message (`SerializedTensor`) is Plexus's own.
"""

from .adaptive import (
    AdaptiveCompressionBase,
    PerTensorCompression,
    RoleAdaptiveCompression,
    SizeAdaptiveCompression,
)
from .base import CompressionBase, CompressionInfo, NoCompression, TensorDescriptor, TensorRole
from .blockwise4 import Blockwise4BitQuantization
from .floating import Float16Compression, ScaledFloat16Compression
from .quantization import BlockwiseQuantization, Quantile8BitQuantization, Uniform8BitQuantization
from .serialization import (
    BASE_COMPRESSION_TYPES,
    deserialize_tensor_stream,
    deserialize_torch_tensor,
    serialize_torch_tensor,
)
from .wire import (
    CompressionError,
    CompressionType,
    SerializedTensor,
    combine_from_streaming,
    split_for_streaming,
)

__all__ = [
    "BASE_COMPRESSION_TYPES",
    "AdaptiveCompressionBase",
    "Blockwise4BitQuantization",
    "BlockwiseQuantization",
    "CompressionBase",
    "CompressionError",
    "CompressionInfo",
    "CompressionType",
    "Float16Compression",
    "NoCompression",
    "PerTensorCompression",
    "Quantile8BitQuantization",
    "RoleAdaptiveCompression",
    "ScaledFloat16Compression",
    "SerializedTensor",
    "SizeAdaptiveCompression",
    "TensorDescriptor",
    "TensorRole",
    "Uniform8BitQuantization",
    "combine_from_streaming",
    "deserialize_tensor_stream",
    "deserialize_torch_tensor",
    "serialize_torch_tensor",
    "split_for_streaming",
]
