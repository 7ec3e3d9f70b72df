"""Serving experts: backends, the batching runtime, checkpoints, the RPC service and the Server."""

from ..expert_registry import declare_experts, get_experts
from .checkpoints import load_experts, store_experts
from .handler import ConnectionHandler, ExpertRequestError
from .layers import register_expert_class
from .module_backend import ModuleBackend
from .runtime import Runtime, TaskPool, TaskRejected
from .server import Server, background_server

__all__ = [
    "ConnectionHandler",
    "ExpertRequestError",
    "ModuleBackend",
    "Runtime",
    "Server",
    "TaskPool",
    "TaskRejected",
    "background_server",
    "declare_experts",
    "get_experts",
    "load_experts",
    "register_expert_class",
    "store_experts",
]
