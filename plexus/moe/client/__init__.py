"""Using experts that live on other peers: one at a time, or a mixture found through the DHT."""

from .beam_search import MoEBeamSearcher
from .expert import RemoteExpert, RemoteExpertError, expert_backward, expert_forward, get_expert_schema
from .moe import RemoteMixtureOfExperts
from .quorum import TooFewExpertsError
from .switch_moe import RemoteSwitchMixtureOfExperts

__all__ = [
    "MoEBeamSearcher",
    "RemoteExpert",
    "RemoteExpertError",
    "RemoteMixtureOfExperts",
    "RemoteSwitchMixtureOfExperts",
    "TooFewExpertsError",
    "expert_backward",
    "expert_forward",
    "get_expert_schema",
]
