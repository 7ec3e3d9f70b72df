"""4-bit blockwise quantization: two elements per byte, for updates whose errors are fed back.

Blocks of 256 elements are scaled by their largest magnitude into [-1, 1] and rounded to the
nearest of 13 evenly spaced levels (-6/6 ... 6/6, with an exact 0), code = level + 6. Codes 13,
14 and 15 stand for NaN, +inf and -inf, which arrive as they left; block maxima are taken over
the finite values. Layout: ceil(numel / 256) float32 block maxima, then ceil(numel / 2) bytes of
codes, the even element in the low nibble. 4.125 bits per element; an element's error is at most
1/12 of its block's largest magnitude (about 15% norm-relative on normal data), so this is meant
for values whose error the sender keeps and re-sends (DiLoCo's error feedback), not parameters.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .base import CompressionBase, CompressionInfo, NoCompression, is_floating, join_buffers, read_array
from .floating import floating_ratio, restore_dtype
from .wire import BLOCK4_SIZE, CompressionType, SerializedTensor, dtype_name

LEVELS = 6  # per sign
SPECIAL_CODES = {13: math.nan, 14: math.inf, 15: -math.inf}


class Blockwise4BitQuantization(CompressionBase):
    """Blocks of 256 scaled by their absolute maximum, 13 levels, two codes per byte."""

    compression_type = CompressionType.BLOCKWISE_4BIT

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False
    ) -> SerializedTensor:
        if not is_floating(tensor):
            return NoCompression().compress(tensor, info, allow_inplace)
        x = tensor.detach().reshape(-1).float()
        n, n_blocks = x.numel(), -(-x.numel() // BLOCK4_SIZE)
        finite = torch.isfinite(x)
        blocks = torch.zeros(n_blocks * BLOCK4_SIZE, device=x.device)
        blocks[:n] = torch.where(finite, x, 0)
        blocks = blocks.view(n_blocks, BLOCK4_SIZE)
        absmax = blocks.abs().amax(dim=1) if n else blocks.new_zeros(0)
        absmax = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
        codes = (
            blocks.div_(absmax[:, None]).mul_(LEVELS).round_().add_(LEVELS).reshape(-1)[:n].to(torch.uint8)
        )
        codes[torch.isnan(x)] = 13
        codes[x == math.inf] = 14
        codes[x == -math.inf] = 15
        if n % 2:
            codes = torch.cat([codes, codes.new_zeros(1)])
        packed = codes[0::2] | (codes[1::2] << 4)
        return SerializedTensor(
            join_buffers(absmax, packed),
            tuple(tensor.shape),
            dtype_name(tensor.dtype),
            self.compression_type,
            tensor.requires_grad,
        )

    def extract(self, serialized: SerializedTensor) -> torch.Tensor:
        numel = math.prod(serialized.size)
        n_blocks = -(-numel // BLOCK4_SIZE)
        absmax = read_array(serialized, 0, n_blocks, np.dtype(np.float32))
        packed = read_array(serialized, 4 * n_blocks, -(-numel // 2), np.dtype(np.uint8))
        codes = np.empty(2 * packed.size, dtype=np.uint8)
        codes[0::2], codes[1::2] = packed & 0x0F, packed >> 4
        codes = codes[:numel]
        values = (codes.astype(np.float32) - LEVELS) / LEVELS
        scales = np.repeat(absmax, BLOCK4_SIZE)[:numel]
        with np.errstate(over="ignore", invalid="ignore"):
            values *= scales
        for code, special in SPECIAL_CODES.items():
            values[codes == code] = special
        return restore_dtype(values, serialized.dtype).reshape(serialized.size)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return floating_ratio(info, 4 + 32 / BLOCK4_SIZE)
