"""Plexus: train one neural network together over the internet, with no master node.

The public names mirror hivemind's, so `import plexus as hivemind` runs hivemind scripts.
"""

from .averaging.aggregation import RobustAggregation
from .averaging.allreduce import AllReduceError
from .averaging.averager import AveragingError, DecentralizedAverager, LeftOutError, NoPeersError
from .averaging.matchmaking_state import MatchmakingStateError
from .averaging.state_download import StateDownloadError, StateDownloadTimeout
from .compression import (
    BlockwiseQuantization,
    CompressionBase,
    CompressionInfo,
    Float16Compression,
    NoCompression,
    PerTensorCompression,
    Quantile8BitQuantization,
    RoleAdaptiveCompression,
    ScaledFloat16Compression,
    SizeAdaptiveCompression,
    TensorRole,
    Uniform8BitQuantization,
    deserialize_torch_tensor,
    serialize_torch_tensor,
)
from .compression.wire import CompressionError
from .dht.dht import DHT
from .dht.transport import DHTBootstrapError
from .errors import PeerError, PeerMisbehaved, PhaseTimeout, PlexusError, UsageError
from .moe import (
    ModuleBackend,
    RemoteExpert,
    RemoteMixtureOfExperts,
    RemoteSwitchMixtureOfExperts,
    Server,
    background_server,
    declare_experts,
    get_experts,
    register_expert_class,
)
from .moe.client.expert import RemoteExpertError
from .optim import (
    GradientAverager,
    GradScaler,
    Optimizer,
    PowerSGDGradientAverager,
    ProgressTracker,
    TrainingAverager,
    TrainingStateAverager,
)
from .optim.state_averager import StateLoadError
from .p2p.auth import AuthorizationError
from .p2p.host import DialError
from .p2p.identity import IdentityError, PeerID
from .p2p.multiaddr import MultiaddrError
from .p2p.pnet import SwarmKeyError
from .p2p.rpc import RPCError
from .utils.timing import get_dht_time
from .version import __version__

__all__ = [
    "DHT",
    "AllReduceError",
    "AuthorizationError",
    "AveragingError",
    "BlockwiseQuantization",
    "CompressionBase",
    "CompressionError",
    "CompressionInfo",
    "DHTBootstrapError",
    "DecentralizedAverager",
    "DialError",
    "Float16Compression",
    "GradScaler",
    "GradientAverager",
    "IdentityError",
    "LeftOutError",
    "MatchmakingStateError",
    "ModuleBackend",
    "MultiaddrError",
    "NoCompression",
    "NoPeersError",
    "Optimizer",
    "PeerError",
    "PeerID",
    "PeerMisbehaved",
    "PerTensorCompression",
    "PhaseTimeout",
    "PlexusError",
    "PowerSGDGradientAverager",
    "ProgressTracker",
    "Quantile8BitQuantization",
    "RPCError",
    "RemoteExpert",
    "RemoteExpertError",
    "RemoteMixtureOfExperts",
    "RemoteSwitchMixtureOfExperts",
    "RobustAggregation",
    "RoleAdaptiveCompression",
    "ScaledFloat16Compression",
    "Server",
    "SizeAdaptiveCompression",
    "StateDownloadError",
    "StateDownloadTimeout",
    "StateLoadError",
    "SwarmKeyError",
    "TensorRole",
    "TrainingAverager",
    "TrainingStateAverager",
    "Uniform8BitQuantization",
    "UsageError",
    "__version__",
    "background_server",
    "declare_experts",
    "deserialize_torch_tensor",
    "get_dht_time",
    "get_experts",
    "register_expert_class",
    "serialize_torch_tensor",
]
