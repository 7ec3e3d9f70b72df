"""Plexus: train one neural network together over the internet, with no master node.

The public names mirror hivemind's, so `import plexus as hivemind` runs hivemind scripts. They load
on first use (`plexus.DHT` imports the DHT, `plexus.Optimizer` the training stack), so that
`import plexus` and the `plexus` command start fast.
"""

from typing import TYPE_CHECKING

from .errors import PeerError, PeerMisbehaved, PhaseTimeout, PlexusError, UsageError
from .utils.exports import lazy_exports
from .version import __version__

_EXPORTS = {
    # subpackages, reachable as attributes the way `hivemind.dht.DHTNode` is
    "averaging": ".averaging",
    "compression": ".compression",
    "dht": ".dht",
    "moe": ".moe",
    "optim": ".optim",
    "p2p": ".p2p",
    "utils": ".utils",
    "BlockwiseQuantization": ".compression",
    "CompressionBase": ".compression",
    "CompressionInfo": ".compression",
    "DHT": ".dht.dht",
    "DecentralizedAverager": ".averaging.averager",
    "Float16Compression": ".compression",
    "GradScaler": ".optim",
    "GradientAverager": ".optim",
    "ModuleBackend": ".moe",
    "NoCompression": ".compression",
    "Optimizer": ".optim",
    "PeerID": ".p2p.identity",
    "PerTensorCompression": ".compression",
    "PowerSGDGradientAverager": ".optim",
    "ProgressTracker": ".optim",
    "Quantile8BitQuantization": ".compression",
    "RemoteExpert": ".moe",
    "RemoteMixtureOfExperts": ".moe",
    "RemoteSwitchMixtureOfExperts": ".moe",
    "RobustAggregation": ".averaging.aggregation",
    "RoleAdaptiveCompression": ".compression",
    "ScaledFloat16Compression": ".compression",
    "Server": ".moe",
    "SizeAdaptiveCompression": ".compression",
    "TensorRole": ".compression",
    "TrainingAverager": ".optim",
    "TrainingStateAverager": ".optim",
    "Uniform8BitQuantization": ".compression",
    "background_server": ".moe",
    "declare_experts": ".moe",
    "deserialize_torch_tensor": ".compression",
    "get_dht_time": ".utils.timing",
    "get_experts": ".moe",
    "register_expert_class": ".moe",
    "serialize_torch_tensor": ".compression",
}
__all__ = [
    "DHT",
    "BlockwiseQuantization",
    "CompressionBase",
    "CompressionInfo",
    "DecentralizedAverager",
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
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names above load on first use
    from .averaging.aggregation import RobustAggregation
    from .averaging.averager import DecentralizedAverager
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
    from .dht.dht import DHT
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
