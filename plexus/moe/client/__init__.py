"""Using experts that live on other peers."""

from .expert import RemoteExpert, RemoteExpertError, expert_backward, expert_forward, get_expert_schema

__all__ = ["RemoteExpert", "RemoteExpertError", "expert_backward", "expert_forward", "get_expert_schema"]
