"""Expert modules a server can host: the registry, the built-ins, and optimizer helpers."""

from . import common, dropout  # noqa: F401  (importing registers the built-in experts)
from .optim import ClippingWrapper, get_linear_schedule_with_warmup, schedule_name_to_scheduler
from .registry import name_to_block, name_to_input, register_expert_class

__all__ = [
    "ClippingWrapper",
    "get_linear_schedule_with_warmup",
    "name_to_block",
    "name_to_input",
    "register_expert_class",
    "schedule_name_to_scheduler",
]
