"""Checks on tensors that several layers make before they trust them (all torch ops, no copies)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def first_nonfinite(tensors: Sequence[torch.Tensor]) -> int | None:
    """The index of the first floating tensor holding NaN or inf, or None when all are finite."""
    for index, tensor in enumerate(tensors):
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return index
    return None


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every tensor is finite, with one device sync in all instead of one per tensor."""
    checks = [torch.isfinite(tensor).all() for tensor in tensors if tensor.is_floating_point()]
    return not checks or bool(torch.stack([check.to(checks[0].device) for check in checks]).all())
