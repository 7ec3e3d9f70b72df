"""Half-precision methods: plain float16, and float16 after centring and scaling each row.

Both apply to floating tensors only (float64, float32, float16, bfloat16); any other tensor goes
out uncompressed (its message says NONE), so a mixed state dict needs no special casing. The
receiver gets the original dtype back.

Non-finite values: NaN stays NaN and ±inf stays ±inf in both methods. Float16Compression saturates
finite values beyond float16's range to ±65504 (and, from bfloat16 or float32, flushes values
below float16's smallest subnormal, about 6e-8, to zero). ScaledFloat16Compression computes each
row's mean and std over the row's finite values, so one inf does not spoil its neighbours.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from .base import (
    FLOATING_TORCH_DTYPES,
    CompressionBase,
    CompressionInfo,
    NoCompression,
    is_floating,
    join_buffers,
    read_array,
)
from .wire import DTYPES, CompressionType, SerializedTensor, dtype_name, meanstd_rows

FP16_MAX = 65504.0


def _to_float16(x: torch.Tensor) -> torch.Tensor:
    """Cast to float16, saturating finite overflow to ±65504 and keeping ±inf and NaN."""
    half = x.to(torch.float16)
    peak = float(half.abs().max()) if half.numel() else 0.0  # 9x cheaper than isinf().any()
    if peak <= FP16_MAX:
        return half
    overflow = torch.isinf(half)
    if bool(overflow.any()):  # rare path: touch only the overflowing elements
        original = x[overflow].float()  # clamp in float32: ±65504 is not a bfloat16 value
        half[overflow] = torch.where(torch.isinf(original), original, original.clamp(-FP16_MAX, FP16_MAX)).to(
            torch.float16
        )
    return half


def restore_dtype(values: np.ndarray, name: str) -> torch.Tensor:
    """A fresh float tensor of the wire dtype from float16/float32 numpy values (one conversion)."""
    dtype = DTYPES[name]
    if values.dtype == np.float16 and dtype in (torch.float32, torch.bfloat16, torch.float64) and values.size:
        with warnings.catch_warnings():  # read-only bytes: safe, `.to` below copies before anyone writes
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            half = torch.frombuffer(memoryview(values), dtype=torch.float16)  # type: ignore[arg-type]  # (numpy's stubs)
        return half.to(dtype).reshape(values.shape)  # torch converts half vectorised, numpy element-wise
    target = {torch.float16: np.float16, torch.float64: np.float64}.get(dtype, np.float32)
    if values.dtype != target or not values.flags.writeable:
        with np.errstate(over="ignore", invalid="ignore"):  # out of range -> inf, NaN stays NaN
            values = values.astype(target)
    result = torch.from_numpy(values)
    return result.to(torch.bfloat16) if dtype == torch.bfloat16 else result


def floating_ratio(info: CompressionInfo, bits: float) -> float:
    """`bits` per element over the original width, for the dtypes a lossy method applies to."""
    dtype = info.descriptor.dtype
    if dtype is None or dtype not in FLOATING_TORCH_DTYPES:
        return 1.0
    return min(1.0, bits / (dtype.itemsize * 8))


class Float16Compression(CompressionBase):
    """Send float16; 2 bytes per element, relative error at most 2**-11 for normal values."""

    compression_type = CompressionType.FLOAT16

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False
    ) -> SerializedTensor:
        if not is_floating(tensor):
            return NoCompression().compress(tensor, info, allow_inplace)
        x = tensor.detach()
        half = x if x.dtype == torch.float16 else _to_float16(x)
        name = dtype_name(x.dtype)
        buffer = join_buffers(half)
        return SerializedTensor(buffer, tuple(x.shape), name, self.compression_type, tensor.requires_grad)

    def extract(self, serialized: SerializedTensor) -> torch.Tensor:
        numel = len(serialized.buffer) // 2
        values = read_array(serialized, 0, numel, np.dtype(np.float16))
        return restore_dtype(values, serialized.dtype).reshape(serialized.size)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return floating_ratio(info, 16)


class ScaledFloat16Compression(CompressionBase):
    """Centre and scale each row (last axis) to unit variance, then send float16 plus a float32
    mean and std per row; precise for rows whose values share a scale, whatever that scale is."""

    compression_type = CompressionType.MEANSTD_16BIT

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False
    ) -> SerializedTensor:
        if not is_floating(tensor):
            return NoCompression().compress(tensor, info, allow_inplace)
        size = tuple(tensor.shape)
        name = dtype_name(tensor.dtype)
        rows = meanstd_rows(size)
        if rows == 0:  # empty: no values, no statistics
            return SerializedTensor(b"", size, name, self.compression_type, tensor.requires_grad)
        x = tensor.detach().float().reshape(rows, -1)
        finite = torch.isfinite(x)
        if bool(finite.all()):
            std, mean = torch.std_mean(x, dim=1, correction=0, keepdim=True)
            std = torch.where(std > 0, std, torch.ones_like(std))
            z = (x - mean).div_(std).clamp_(-FP16_MAX, FP16_MAX)
        else:
            count = finite.sum(dim=1, keepdim=True).clamp_min(1)
            mean = torch.where(finite, x, 0.0).sum(dim=1, keepdim=True) / count
            centred = x - mean
            var = torch.where(finite, centred, 0.0).square().sum(dim=1, keepdim=True) / count
            std = var.sqrt()
            std = torch.where(std > 0, std, torch.ones_like(std))
            z = centred.div_(std)
            z = torch.where(finite, z.clamp(-FP16_MAX, FP16_MAX), x)  # NaN, ±inf pass through
        buffer = join_buffers(z.to(torch.float16), mean.reshape(-1), std.reshape(-1))
        return SerializedTensor(buffer, size, name, self.compression_type, tensor.requires_grad)

    def extract(self, serialized: SerializedTensor) -> torch.Tensor:
        rows = meanstd_rows(serialized.size)
        if rows == 0:
            return restore_dtype(np.zeros(0, np.float32), serialized.dtype).reshape(serialized.size)
        numel = (len(serialized.buffer) - 8 * rows) // 2
        z = read_array(serialized, 0, numel, np.dtype(np.float16))
        mean = read_array(serialized, 2 * numel, rows, np.dtype(np.float32))
        std = read_array(serialized, 2 * numel + 4 * rows, rows, np.dtype(np.float32))
        values = z.astype(np.float32).reshape(rows, -1)
        with np.errstate(over="ignore", invalid="ignore"):  # inf/NaN statistics give inf/NaN values
            values *= std[:, None]
            values += mean[:, None]
        return restore_dtype(values, serialized.dtype).reshape(serialized.size)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return floating_ratio(info, 16)
