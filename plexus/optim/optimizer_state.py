"""A torch optimizer's state as plain tensors plus msgpack-able metadata, so peers can average it
and send it to each other, and a way to create that state before the first real step.

Both `TrainingStateAverager` and the legacy `TrainingAverager` share and load optimizer state;
these helpers are the part they have in common and do not depend on either. `unflatten_optimizer_state`
reads data from a peer, so it checks everything against the local optimizer before anything is loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def optimizer_parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [param for group in optimizer.param_groups for param in group["params"]]


@torch.no_grad()
def initialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's statistics with one zero-gradient step, leaving the model as it was.

    Parameters and gradients are restored afterwards and a ``step`` counter is reset to 0, so the
    first real step matches a fresh optimizer (exactly for Adam, AdamW and SGD without weight decay).
    """
    params = optimizer_parameters(optimizer)
    saved = [(param.detach().clone(), param.grad) for param in params]
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    for param, (value, grad) in zip(params, saved):
        param.copy_(value)
        param.grad = grad
    for state in optimizer.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            step.zero_()
        elif isinstance(step, (int, float)) and not isinstance(step, bool):
            state["step"] = type(step)(0)


def flatten_optimizer_state(optimizer: torch.optim.Optimizer) -> tuple[dict, list[torch.Tensor]]:
    """Split `optimizer.state_dict()` into msgpack-able metadata and a list of its tensors.

    Metadata: ``{"param_groups": [...], "state": [[param_index, key, is_tensor, value], ...]}``,
    where a tensor entry's value is None and its tensor is the next one in the list.
    """
    state_dict = optimizer.state_dict()
    entries, tensors = [], []
    for index, param_state in sorted(state_dict["state"].items()):
        for key, value in param_state.items():
            if isinstance(value, torch.Tensor):
                entries.append([index, key, True, None])
                tensors.append(value)
            else:
                entries.append([index, key, False, value])
    return {"param_groups": state_dict["param_groups"], "state": entries}, tensors


def unflatten_optimizer_state(
    metadata: Any, tensors: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer
) -> dict:
    """The inverse of `flatten_optimizer_state`, checked against `optimizer` (data from a peer).

    Raises ValueError naming what does not fit: group count or sizes, indices, tensor shapes.
    """
    if (
        not isinstance(metadata, dict)
        or not isinstance(metadata.get("param_groups"), list)
        or not isinstance(metadata.get("state"), list)
    ):
        raise ValueError("optimizer metadata must be a dict with 'param_groups' and 'state' lists")
    groups = metadata["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"{len(groups)} parameter groups, ours has {len(optimizer.param_groups)}")
    for theirs, ours in zip(groups, optimizer.param_groups):
        if (
            not isinstance(theirs, dict)
            or not isinstance(theirs.get("params"), list)
            or len(theirs["params"]) != len(ours["params"])
        ):
            raise ValueError("a parameter group's size differs from ours")
    params = optimizer_parameters(optimizer)
    current = optimizer.state_dict()["state"]
    state: dict[int, dict] = {}
    remaining = iter(tensors)
    used = 0
    for entry in metadata["state"]:
        if not (
            isinstance(entry, list)
            and len(entry) == 4
            and isinstance(entry[0], int)
            and isinstance(entry[1], str)
            and isinstance(entry[2], bool)
        ):
            raise ValueError(f"malformed optimizer state entry {entry!r:.80}")
        index, key, is_tensor, value = entry
        if not 0 <= index < len(params):
            raise ValueError(f"optimizer state for parameter {index}, but there are {len(params)}")
        if is_tensor:
            value = next(remaining, None)
            if value is None:
                raise ValueError("fewer optimizer tensors than the metadata lists")
            used += 1
            ours = current.get(index, {}).get(key)
            if isinstance(ours, torch.Tensor) and ours.shape != value.shape:
                raise ValueError(
                    f"optimizer state {key!r} of parameter {index} has shape "
                    f"{tuple(value.shape)}, ours is {tuple(ours.shape)}"
                )
        state.setdefault(index, {})[key] = value
    if used != len(tensors):
        raise ValueError(f"{len(tensors)} optimizer tensors, but the metadata lists {used}")
    return {"state": state, "param_groups": groups}
