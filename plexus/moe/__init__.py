"""Decentralized mixture-of-experts: expert servers, remote experts, and expert search in the DHT.

Names follow hivemind.moe: a `Server` hosts experts and announces them in a DHT
(`declare_experts`); clients use one expert (`get_experts` -> `RemoteExpert`) or a whole grid
through a gated layer (`RemoteMixtureOfExperts`, `RemoteSwitchMixtureOfExperts`).
"""

from .client import (
    MoEBeamSearcher,
    RemoteExpert,
    RemoteExpertError,
    RemoteMixtureOfExperts,
    RemoteSwitchMixtureOfExperts,
    TooFewExpertsError,
)
from .expert_registry import create_remote_experts, declare_experts, get_experts
from .expert_uid import FLAT_EXPERT, UID_DELIMITER, ExpertInfo, ExpertPrefix, ExpertUID
from .schema import BatchTensorDescriptor
from .server import ModuleBackend, Server, background_server, register_expert_class

__all__ = [
    "FLAT_EXPERT",
    "UID_DELIMITER",
    "BatchTensorDescriptor",
    "ExpertInfo",
    "ExpertPrefix",
    "ExpertUID",
    "MoEBeamSearcher",
    "ModuleBackend",
    "RemoteExpert",
    "RemoteExpertError",
    "RemoteMixtureOfExperts",
    "RemoteSwitchMixtureOfExperts",
    "Server",
    "TooFewExpertsError",
    "background_server",
    "create_remote_experts",
    "declare_experts",
    "get_experts",
    "register_expert_class",
]
