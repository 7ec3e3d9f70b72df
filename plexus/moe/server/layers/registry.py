"""The expert-class registry: a name for each module a server can host, and how to make a sample batch.

`Server.create(expert_cls="ffn", hidden_dim=1024)` builds `name_to_block["ffn"](1024)` and derives
the expert's input schema from `name_to_input["ffn"](batch_size, 1024)`. Users add their own with
`@register_expert_class("my_expert", lambda batch_size, hidden_dim: torch.empty(batch_size, hidden_dim))`.
"""

from collections.abc import Callable

import torch
from torch import nn

SampleInputFn = Callable[[int, int], "torch.Tensor | tuple[torch.Tensor, ...]"]

name_to_block: dict[str, Callable[[int], nn.Module]] = {}
name_to_input: dict[str, SampleInputFn] = {}


def register_expert_class(name: str, sample_input: SampleInputFn):
    """Class decorator: register `cls(hidden_dim)` as the expert class `name`.

    `sample_input(batch_size, hidden_dim)` returns one batch-first tensor or a tuple of them (the
    positional inputs); the server derives the expert's input schema from it.
    """
    if not callable(sample_input):
        raise TypeError("sample_input must be a function (batch_size, hidden_dim) -> tensor(s)")

    def register(cls):
        if name in name_to_block:
            raise ValueError(
                f"an expert class named {name!r} is already registered ({name_to_block[name]}); "
                f"pick another name"
            )
        name_to_block[name] = cls
        name_to_input[name] = sample_input
        return cls

    return register
