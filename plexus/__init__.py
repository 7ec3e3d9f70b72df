"""Plexus: train one neural network together over the internet, with no master node.

The public names mirror hivemind's, so `import plexus as hivemind` runs hivemind scripts. They load
on first use (`plexus.DHT` imports the DHT, `plexus.Optimizer` the training stack), so that
`import plexus` and the `plexus` command start fast.
"""

from typing import TYPE_CHECKING

from .errors import PeerError, PeerMisbehaved, PhaseTimeout, PlexusError, RankFailed, UsageError
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
    "Blockwise4BitQuantization": ".compression",
    "BlockwiseQuantization": ".compression",
    "DiLoCoOptimizer": ".optim",
    "DiLoCoOptions": ".optim",
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
    # the errors a caller meets (their roots, in .errors, are imported above)
    "AllReduceError": ".averaging.allreduce",
    "AuthorizationError": ".p2p.auth",
    "AveragingError": ".averaging.averager",
    "CompressionError": ".compression.wire",
    "DHTBootstrapError": ".dht.transport",
    "DialError": ".p2p.host",
    "IdentityError": ".p2p.identity",
    "LeftOutError": ".averaging.averager",
    "MatchmakingStateError": ".averaging.matchmaking_state",
    "MultiaddrError": ".p2p.multiaddr",
    "NoPeersError": ".averaging.averager",
    "RPCError": ".p2p.rpc",
    "RemoteExpertError": ".moe.client.expert",
    "StateDownloadError": ".averaging.state_download",
    "StateDownloadTimeout": ".averaging.state_download",
    "StateLoadError": ".optim.state_averager",
    "SwarmKeyError": ".p2p.pnet",
}
__all__ = [
    "DHT",
    "AllReduceError",
    "AuthorizationError",
    "AveragingError",
    "Blockwise4BitQuantization",
    "BlockwiseQuantization",
    "CompressionBase",
    "CompressionError",
    "CompressionInfo",
    "DHTBootstrapError",
    "DecentralizedAverager",
    "DiLoCoOptimizer",
    "DiLoCoOptions",
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
    "RankFailed",
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
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names above load on first use
    from .averaging.aggregation import RobustAggregation
    from .averaging.allreduce import AllReduceError
    from .averaging.averager import AveragingError, DecentralizedAverager, LeftOutError, NoPeersError
    from .averaging.matchmaking_state import MatchmakingStateError
    from .averaging.state_download import StateDownloadError, StateDownloadTimeout
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
    from .compression.wire import CompressionError
    from .dht.dht import DHT
    from .dht.transport import DHTBootstrapError
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
    from .optim.state_averager import StateLoadError
    from .p2p.auth import AuthorizationError
    from .p2p.host import DialError
    from .p2p.identity import IdentityError, PeerID
    from .p2p.multiaddr import MultiaddrError
    from .p2p.pnet import SwarmKeyError
    from .p2p.rpc import RPCError
    from .utils.timing import get_dht_time
