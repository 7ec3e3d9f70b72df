"""Decentralized mixture-of-experts: expert servers, remote experts, and (with the DHT) expert search.

Names follow hivemind.moe. Not here yet: declare_experts / get_experts and the DHT-driven
RemoteMixtureOfExperts / RemoteSwitchMixtureOfExperts, which wait for the DHT facade.
"""

from .client import RemoteExpert, RemoteExpertError
from .expert_uid import FLAT_EXPERT, UID_DELIMITER, ExpertInfo, ExpertPrefix, ExpertUID
from .schema import BatchTensorDescriptor
from .server import ModuleBackend, Server, background_server, register_expert_class

__all__ = [
    "FLAT_EXPERT", "UID_DELIMITER", "BatchTensorDescriptor", "ExpertInfo", "ExpertPrefix", "ExpertUID",
    "ModuleBackend", "RemoteExpert", "RemoteExpertError", "Server", "background_server", "register_expert_class",
]
