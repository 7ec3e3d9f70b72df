"""How one peer's pseudo-gradient is made ready for the wire, and what compression lost is kept.

Error feedback: what compression drops from this round's pseudo-gradient (`residual`) is added to
the next round's before it is compressed again, so nothing is lost for good, only delayed.

- "none": float32 buffers, sent raw; nothing is lost.
- "fp16", "bf16": the buffers themselves are float16 / bfloat16, sent raw; the cast is element-wise,
  so what it loses is known here exactly (float16 is clamped to its range: a value beyond it
  would become inf and be refused by the round).
- "topk": only the `fraction` largest magnitudes per tensor are kept (the rest zeroed, and kept
  in the residual); the zeros travel as a sparse message (`SparseCompression`: indices and values).

Reducers answer every member with the same average (see `DecentralizedAverager(lossy_answers=...)`),
so all peers apply one identical outer update.
"""

from __future__ import annotations

import torch

from ..compression import CompressionBase, NoCompression

FLOAT16_MAX = float(torch.finfo(torch.float16).max)
_BUFFER_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class PseudoGradientCodec:
    """Turns `delta` (round-start parameters minus the current ones) into what a round averages."""

    def __init__(self, mode: str, error_feedback: bool = True, topk_fraction: float = 0.01):
        self.mode, self.error_feedback, self.topk_fraction = mode, error_feedback, topk_fraction

    @property
    def buffer_dtype(self) -> torch.dtype:
        """The dtype of the averaged buffers."""
        return _BUFFER_DTYPES.get(self.mode, torch.float32)

    @property
    def wire_compression(self) -> CompressionBase:
        """The averager's compression for these buffers."""
        return NoCompression()

    @torch.no_grad()
    def encode(self, delta: torch.Tensor, buffer: torch.Tensor, residual: torch.Tensor | None) -> None:
        """Write this round's contribution into `buffer`; update `residual` (float32, like delta) to
        what it loses. `delta` may be overwritten."""
        if residual is not None:
            delta.add_(residual)
        if self.mode == "fp16":
            delta.clamp_(-FLOAT16_MAX, FLOAT16_MAX)
        if self.mode == "topk":
            flat = delta.reshape(-1)
            keep = max(1, round(self.topk_fraction * flat.numel()))
            mask = torch.zeros_like(flat, dtype=torch.bool)
            mask[flat.abs().topk(keep, sorted=False).indices] = True
            kept = torch.where(mask, flat, torch.zeros_like(flat))
            buffer.copy_(kept.view_as(buffer))
        else:
            buffer.copy_(delta)
        if residual is not None:
            residual.copy_(delta).sub_(buffer.float())
