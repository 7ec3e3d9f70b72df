"""How one peer's pseudo-gradient is made ready for the wire, and what compression lost is kept.

Error feedback: what compression drops from this round's pseudo-gradient (`residual`) is added to
the next round's before it is compressed again, so nothing is lost for good, only delayed.

- "none": float32 buffers, sent raw; nothing is lost.
- "fp16", "bf16": the buffers themselves are float16 / bfloat16, sent raw; the cast is element-wise,
  so what it loses is known here exactly (float16 is clamped to its range: a value beyond it
  would become inf and be refused by the round).
- "int8", "int4": float32 buffers, sent blockwise-quantized (`BlockwiseQuantization`,
  `Blockwise4BitQuantization`). The averager cuts them into parts whose boundaries depend on the
  group, so what the codec loses is known only when a part is sent: the round writes it into the
  residual (`DecentralizedAverager(compression_residuals=...)`). Reducers answer every member with
  the same quantized average (`shared_lossy_answers`), so all peers apply one outer update.
"""

from __future__ import annotations

import torch

from ..compression import Blockwise4BitQuantization, BlockwiseQuantization, CompressionBase, NoCompression

FLOAT16_MAX = float(torch.finfo(torch.float16).max)
_BUFFER_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
_WIRE_CODECS = {"int8": BlockwiseQuantization(), "int4": Blockwise4BitQuantization()}


class PseudoGradientCodec:
    """Turns `delta` (round-start parameters minus the current ones) into what a round averages."""

    def __init__(self, mode: str, error_feedback: bool = True):
        self.mode, self.error_feedback = mode, error_feedback

    @property
    def buffer_dtype(self) -> torch.dtype:
        """The dtype of the averaged buffers."""
        return _BUFFER_DTYPES.get(self.mode, torch.float32)

    @property
    def wire_compression(self) -> CompressionBase:
        """The averager's compression for these buffers."""
        return _WIRE_CODECS.get(self.mode, NoCompression())

    @property
    def loses_on_the_wire(self) -> bool:
        """Whether the round itself (not `encode`) finds out what compression lost."""
        return self.mode in _WIRE_CODECS

    @torch.no_grad()
    def encode(self, delta: torch.Tensor, buffer: torch.Tensor, residual: torch.Tensor | None) -> None:
        """Write this round's contribution into `buffer`; update `residual` (float32, like delta) to
        what it loses. `delta` may be overwritten."""
        if residual is not None:
            delta.add_(residual)
        if self.mode == "fp16":
            delta.clamp_(-FLOAT16_MAX, FLOAT16_MAX)
        buffer.copy_(delta)
        if residual is not None and self.loses_on_the_wire:
            residual.zero_()  # the round writes what its parts lose; alone, nothing is lost
        elif residual is not None:
            residual.copy_(delta).sub_(buffer.float())
