"""Plexus: train one neural network together over the internet, with no master node.

The public names mirror hivemind's, so `import plexus as hivemind` runs hivemind scripts.
"""

from .averaging.aggregation import RobustAggregation
from .averaging.averager import DecentralizedAverager
from .compression import (
    Blockwise4BitQuantization,
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
from .dht.dht import DHT
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
from .optim import (
    DiLoCoOptimizer,
    DiLoCoOptions,
    GradientAverager,
    GradScaler,
    Optimizer,
    PowerSGDGradientAverager,
    ProgressTracker,
    TrainingAverager,
    TrainingStateAverager,
)
from .p2p.identity import PeerID
from .utils.timing import get_dht_time
from .version import __version__

__all__ = [
    "DHT",
    "Blockwise4BitQuantization",
    "BlockwiseQuantization",
    "CompressionBase",
    "CompressionInfo",
    "DecentralizedAverager",
    "DiLoCoOptimizer",
    "DiLoCoOptions",
    "Float16Compression",
    "GradScaler",
    "GradientAverager",
    "ModuleBackend",
    "NoCompression",
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
    "RemoteExpert",
    "RemoteMixtureOfExperts",
    "RemoteSwitchMixtureOfExperts",
    "RobustAggregation",
    "RoleAdaptiveCompression",
    "ScaledFloat16Compression",
    "Server",
    "SizeAdaptiveCompression",
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
