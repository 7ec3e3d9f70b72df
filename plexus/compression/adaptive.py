"""Wrappers that pick a method per tensor: by size, by role, or by key.

The choice is made on the sending side only. Every message names the method that actually
encoded it, so the receiver decodes with `deserialize_torch_tensor` and needs no configuration.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, Sequence

import torch

from .base import CompressionBase, CompressionInfo, NoCompression, TensorRole
from .wire import SerializedTensor


class AdaptiveCompressionBase(CompressionBase):
    """Delegates to the method `choose_compression` picks for each tensor."""

    @abstractmethod
    def choose_compression(self, info: CompressionInfo) -> CompressionBase: ...

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False
    ) -> SerializedTensor:
        return self.choose_compression(info).compress(tensor, info, allow_inplace)

    def extract(self, serialized: SerializedTensor) -> torch.Tensor:
        from .serialization import deserialize_torch_tensor  # the registry imports every method

        return deserialize_torch_tensor(serialized)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self.choose_compression(info).estimate_compression_ratio(info)


class SizeAdaptiveCompression(AdaptiveCompressionBase):
    """`less` for tensors of fewer than `threshold` elements, `greater_equal` for the rest
    (counted over the whole tensor, not the part being sent)."""

    def __init__(self, threshold: int, less: CompressionBase, greater_equal: CompressionBase):
        self.threshold, self.less, self.greater_equal = threshold, less, greater_equal

    def choose_compression(self, info: CompressionInfo) -> CompressionBase:
        return self.greater_equal if info.descriptor.numel() >= self.threshold else self.less

    def __repr__(self) -> str:
        return (
            f"SizeAdaptiveCompression({self.threshold}, less={self.less!r}, "
            f"greater_equal={self.greater_equal!r})"
        )


class RoleAdaptiveCompression(AdaptiveCompressionBase):
    """One method per `TensorRole`; a role given no method uses `default`."""

    def __init__(
        self,
        *,
        activation: CompressionBase | None = None,
        parameter: CompressionBase | None = None,
        gradient: CompressionBase | None = None,
        optimizer: CompressionBase | None = None,
        default: CompressionBase = NoCompression(),
    ):
        self.default = default
        self.role_compressions = {
            TensorRole.ACTIVATION: activation or default,
            TensorRole.PARAMETER: parameter or default,
            TensorRole.GRADIENT: gradient or default,
            TensorRole.OPTIMIZER: optimizer or default,
        }

    def choose_compression(self, info: CompressionInfo) -> CompressionBase:
        return self.role_compressions.get(info.role, self.default)

    def __repr__(self) -> str:
        roles = ", ".join(f"{role.name.lower()}={m!r}" for role, m in self.role_compressions.items())
        return f"RoleAdaptiveCompression({roles}, default={self.default!r})"


class PerTensorCompression(AdaptiveCompressionBase):
    """A method per tensor key: a sequence indexed by position, or a mapping by name."""

    def __init__(self, tensor_compressions: Sequence[CompressionBase] | Mapping[object, CompressionBase]):
        self.tensor_compressions = tensor_compressions

    def choose_compression(self, info: CompressionInfo) -> CompressionBase:
        try:
            return self.tensor_compressions[info.key]
        except (KeyError, IndexError, TypeError):
            raise KeyError(
                f"PerTensorCompression has no method for tensor key {info.key!r}; pass CompressionInfo "
                f"with a key present in its {type(self.tensor_compressions).__name__}"
            ) from None

    def __repr__(self) -> str:
        return f"PerTensorCompression({self.tensor_compressions!r})"
