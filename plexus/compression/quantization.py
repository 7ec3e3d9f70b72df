"""8-bit methods: each element becomes one byte, an index into a 256-entry float32 codebook.

* Uniform8BitQuantization: 256 equal-width bins over mean ± 4 std; values further out fall in the
  edge bins. The codebook holds the mean of the values in each bin, so it adapts to the data.
  (hivemind bins ± 3 std; ± 4 nearly halves the error on normal data: 0.9% instead of 1.6%.)
* Quantile8BitQuantization: bins of equal population, their 255 inner borders estimated from the
  sorted tensor (or from a fixed-seed sample of 65536 elements when larger); codebook = bin means.
* BlockwiseQuantization: blocks of 4096 elements, each scaled by its largest magnitude into
  [-1, 1] and rounded to the nearest entry of a fixed codebook ("linear": 255 evenly spaced levels;
  "dynamic": sign(u)*|u|**2 over evenly spaced u, finer near zero; both hold 0 and ±1 exactly).
  bitsandbytes is used for CUDA tensors when it is installed; its output has the same layout
  (its own codebook travels in the message), so any peer decodes it without bitsandbytes.

All work is done by torch ops on the tensor's own device, in float32; only the codes and the
codebook cross to the host. Decoding is a numpy gather (`codebook[codes]`), one pass, one copy.

Non-finite values: statistics (mean, std, quantiles, block maxima) are computed over the finite
values only. When a tensor holds NaN or ±inf, the last three codes are set aside for them
(253 = NaN, 254 = +inf, 255 = -inf) and the finite values use the other 253, so NaN and ±inf
arrive exactly as they left and the finite values keep almost all their precision.
"""

from __future__ import annotations

import logging
import math
from typing import Literal

import numpy as np
import torch

from .base import CompressionBase, CompressionInfo, NoCompression, is_floating, join_buffers, read_array
from .floating import floating_ratio, restore_dtype
from .wire import BLOCK_SIZE, CODEBOOK_SIZE, CompressionType, SerializedTensor, dtype_name

logger = logging.getLogger(__name__)

N_SPECIAL = 3  # codes reserved for NaN, +inf, -inf when a tensor has non-finite values
SPECIAL_VALUES = (math.nan, math.inf, -math.inf)
QUANTILE_SAMPLE_SIZE = 2**16
QUANTILE_SAMPLE_SEED = 0x5EED  # fixed: the same tensor always gets the same borders


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as a flat float32 tensor on its device (may alias it: never write to it)."""
    return tensor.detach().reshape(-1).float()


def _finite_mask(x: torch.Tensor) -> torch.Tensor | None:
    """None when every value is finite (the common case, one reduction), else the finite mask."""
    finite = torch.isfinite(x)
    return None if bool(finite.all()) else finite


def _mark_special_codes(codes: torch.Tensor, x: torch.Tensor) -> None:
    """Give NaN and ±inf their reserved codes (in place)."""
    first = CODEBOOK_SIZE - N_SPECIAL
    codes[torch.isnan(x)] = first
    codes[x == math.inf] = first + 1
    codes[x == -math.inf] = first + 2


def _set_special_entries(codebook: torch.Tensor) -> torch.Tensor:
    """Put NaN, +inf, -inf in the reserved codebook entries (in place); returns the codebook."""
    codebook[CODEBOOK_SIZE - N_SPECIAL :] = torch.tensor(SPECIAL_VALUES, device=codebook.device)
    return codebook


def _bin_means(codes: torch.Tensor, values: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """Mean of `values` per code (float64 sums, so huge bins stay exact); `fallback` where empty."""
    counts = torch.bincount(codes, minlength=CODEBOOK_SIZE)
    sums = torch.bincount(codes, weights=values.double(), minlength=CODEBOOK_SIZE)
    return torch.where(counts > 0, sums / counts.clamp_min(1), fallback.double()).float()


def _serialize(tensor: torch.Tensor, kind: CompressionType, *arrays: torch.Tensor) -> SerializedTensor:
    return SerializedTensor(
        join_buffers(*arrays), tuple(tensor.shape), dtype_name(tensor.dtype), kind, tensor.requires_grad
    )


def _decode_codes(serialized: SerializedTensor, codes_offset: int) -> np.ndarray:
    """codebook[codes] as a fresh, writable float32 numpy array."""
    numel = len(serialized.buffer) - codes_offset
    codebook = read_array(serialized, 0, CODEBOOK_SIZE, np.dtype(np.float32))
    codes = read_array(serialized, codes_offset, numel, np.dtype(np.uint8))
    return codebook[codes]


class Uniform8BitQuantization(CompressionBase):
    """Equal-width bins over mean ± 4 std, codebook of bin means; 1 byte per element."""

    compression_type = CompressionType.UNIFORM_8BIT
    RANGE_IN_STDS = 8.0  # width of the binned range; beyond it values share the edge bins

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False
    ) -> SerializedTensor:
        if not is_floating(tensor):
            return NoCompression().compress(tensor, info, allow_inplace)
        x = _flat(tensor)
        finite = _finite_mask(x)
        levels = CODEBOOK_SIZE if finite is None else CODEBOOK_SIZE - N_SPECIAL
        if finite is None:
            std, mean = torch.std_mean(x, correction=0) if x.numel() else (x.new_zeros(()),) * 2
            clean = x
        else:
            kept = x[finite]
            std, mean = torch.std_mean(kept, correction=0) if kept.numel() else (x.new_zeros(()),) * 2
            clean = torch.where(finite, x, mean)
        scale = self.RANGE_IN_STDS * float(std) / levels
        scale = scale if scale > 0 and math.isfinite(scale) else 1.0
        codes = (clean - mean).div_(scale).add_(levels / 2).floor_().clamp_(0, levels - 1).to(torch.uint8)
        centres = mean + (torch.arange(CODEBOOK_SIZE, device=x.device) + 0.5 - levels / 2) * scale
        if finite is not None:
            _mark_special_codes(codes, x)
        codebook = _bin_means(codes, clean, centres)
        if finite is not None:
            _set_special_entries(codebook)
        return _serialize(tensor, self.compression_type, codebook, codes)

    def extract(self, serialized: SerializedTensor) -> torch.Tensor:
        values = _decode_codes(serialized, CODEBOOK_SIZE * 4)
        return restore_dtype(values, serialized.dtype).reshape(serialized.size)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return floating_ratio(info, 8)


class Quantile8BitQuantization(CompressionBase):
    """Equal-population bins (borders from quantiles), codebook of bin means; 1 byte per element.
    Adapts to heavy tails better than uniform bins; costs a sort of at most 65536 values."""

    compression_type = CompressionType.QUANTILE_8BIT

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False
    ) -> SerializedTensor:
        if not is_floating(tensor):
            return NoCompression().compress(tensor, info, allow_inplace)
        x = _flat(tensor)
        finite = _finite_mask(x)
        n_bins = CODEBOOK_SIZE if finite is None else CODEBOOK_SIZE - N_SPECIAL
        kept = x if finite is None else x[finite]
        zeros = torch.zeros(CODEBOOK_SIZE, device=x.device)
        if kept.numel() == 0:  # empty, or nothing finite: every code is special (or there are none)
            codes = torch.zeros_like(x, dtype=torch.uint8)
            if finite is not None:
                _mark_special_codes(codes, x)
                _set_special_entries(zeros)
            return _serialize(tensor, self.compression_type, zeros, codes)
        borders = self._borders(kept, n_bins)
        clean = x if finite is None else torch.where(finite, x, borders[0])
        codes = torch.bucketize(clean, borders, out_int32=True).to(torch.uint8)
        if finite is not None:
            _mark_special_codes(codes, x)
        codebook = _bin_means(codes, clean, zeros)
        if finite is not None:
            _set_special_entries(codebook)
        return _serialize(tensor, self.compression_type, codebook, codes)

    @staticmethod
    def _borders(values: torch.Tensor, n_bins: int) -> torch.Tensor:
        """The n_bins - 1 inner borders of equal-population bins, from a bounded, fixed sample."""
        if values.numel() > QUANTILE_SAMPLE_SIZE:
            generator = torch.Generator().manual_seed(QUANTILE_SAMPLE_SEED)
            index = torch.randint(values.numel(), (QUANTILE_SAMPLE_SIZE,), generator=generator)
            values = values[index.to(values.device)]
        ordered = values.sort().values
        positions = torch.arange(1, n_bins, device=values.device) * (ordered.numel() - 1) // n_bins
        return ordered[positions].contiguous()

    def extract(self, serialized: SerializedTensor) -> torch.Tensor:
        values = _decode_codes(serialized, CODEBOOK_SIZE * 4)
        return restore_dtype(values, serialized.dtype).reshape(serialized.size)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return floating_ratio(info, 8)


def make_codebook(kind: str, levels: int) -> torch.Tensor:
    """`levels` sorted values in [-1, 1], symmetric, with an exact 0 (levels is odd)."""
    half = levels // 2
    u = torch.arange(-half, half + 1, dtype=torch.float64) / half  # exact 0 and ±1, symmetric
    if kind == "linear":
        return u.float()
    if kind == "dynamic":
        return (u.sign() * u.abs().square()).float()
    raise ValueError(f"unknown codebook {kind!r}: use 'dynamic' or 'linear'")


_BITSANDBYTES: object | None = None
_BITSANDBYTES_TRIED = False


def _bitsandbytes():
    """bitsandbytes.functional if it imports, else None (tried once per process)."""
    global _BITSANDBYTES, _BITSANDBYTES_TRIED
    if not _BITSANDBYTES_TRIED:
        _BITSANDBYTES_TRIED = True
        try:
            import bitsandbytes.functional as functional

            _BITSANDBYTES = functional
        except Exception:  # absent, or present but broken for this platform: our own code serves
            _BITSANDBYTES = None
    return _BITSANDBYTES


class BlockwiseQuantization(CompressionBase):
    """Blocks of 4096 scaled by their absolute maximum, rounded to a 256-entry codebook.

    Args:
        codebook: "dynamic" (finer near zero; the default, like bitsandbytes') or "linear".
        use_bitsandbytes: None (default) uses bitsandbytes for CUDA tensors when installed; False
            never; True for CUDA tensors, failing loudly when it is missing. The wire format is the
            same either way.
    """

    compression_type = CompressionType.BLOCKWISE_8BIT

    def __init__(
        self, codebook: Literal["dynamic", "linear"] = "dynamic", use_bitsandbytes: bool | None = None
    ):
        make_codebook(codebook, 3)  # validate the name now, not at the first tensor
        self.codebook, self.use_bitsandbytes = codebook, use_bitsandbytes
        if use_bitsandbytes and _bitsandbytes() is None:
            raise ImportError(
                "use_bitsandbytes=True but bitsandbytes is not importable; pip install bitsandbytes"
            )

    def __repr__(self) -> str:
        return f"BlockwiseQuantization(codebook={self.codebook!r})"

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False
    ) -> SerializedTensor:
        if not is_floating(tensor):
            return NoCompression().compress(tensor, info, allow_inplace)
        x = tensor.detach().reshape(-1)
        finite = _finite_mask(x)
        wants_bitsandbytes = x.is_cuda and self.use_bitsandbytes is not False
        if finite is None and wants_bitsandbytes and _bitsandbytes() is not None:
            result = self._compress_bitsandbytes(tensor, x)
            if result is not None:
                return result
        levels = CODEBOOK_SIZE - 1 if finite is None else CODEBOOK_SIZE - N_SPECIAL
        n, n_blocks = x.numel(), -(-x.numel() // BLOCK_SIZE)
        blocks = torch.zeros(n_blocks * BLOCK_SIZE, device=x.device)  # our own copy: free to scale in place
        blocks[:n] = x if finite is None else torch.where(finite, x, 0)
        blocks = blocks.view(n_blocks, BLOCK_SIZE)
        absmax = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg()) if n else blocks.new_zeros(0)
        absmax = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
        blocks.div_(absmax[:, None])
        codebook = make_codebook(self.codebook, levels).to(x.device)
        if self.codebook == "linear":
            codes = blocks.add_(1.0).mul_((levels - 1) / 2).round_()
        else:
            codes = torch.bucketize(blocks, (codebook[1:] + codebook[:-1]) / 2, out_int32=True)
        codes = codes.reshape(-1)[:n].to(torch.uint8)
        full = torch.cat([codebook, codebook[-1:].expand(CODEBOOK_SIZE - levels)])
        if finite is not None:
            _mark_special_codes(codes, x)
            _set_special_entries(full)
        return _serialize(tensor, self.compression_type, full, absmax, codes)

    def _compress_bitsandbytes(self, tensor: torch.Tensor, x: torch.Tensor) -> SerializedTensor | None:
        try:
            codes, state = _bitsandbytes().quantize_blockwise(x.float().contiguous(), blocksize=BLOCK_SIZE)
            absmax, code = (state.absmax, state.code) if hasattr(state, "absmax") else state
            return _serialize(tensor, self.compression_type, code.float(), absmax.float(), codes.reshape(-1))
        except Exception as e:
            if self.use_bitsandbytes:
                raise
            logger.warning("bitsandbytes quantize_blockwise failed (%s); using our own implementation", e)
            self.use_bitsandbytes = False
            return None

    def extract(self, serialized: SerializedTensor) -> torch.Tensor:
        numel = math.prod(serialized.size)
        n_blocks, n_full = -(-numel // BLOCK_SIZE), numel // BLOCK_SIZE
        absmax = read_array(serialized, CODEBOOK_SIZE * 4, n_blocks, np.dtype(np.float32))
        values = _decode_codes(serialized, CODEBOOK_SIZE * 4 + 4 * n_blocks)
        full_blocks = values[: n_full * BLOCK_SIZE].reshape(n_full, BLOCK_SIZE)  # a view: scaled in place
        with np.errstate(over="ignore", invalid="ignore"):  # inf * 0 is NaN, as it should be
            full_blocks *= absmax[:n_full, None]
            if n_blocks > n_full:
                values[n_full * BLOCK_SIZE :] *= absmax[n_full]
        return restore_dtype(values, serialized.dtype).reshape(serialized.size)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return floating_ratio(info, 8 + 32 / BLOCK_SIZE)
