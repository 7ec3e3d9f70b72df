"""Averaging tensors with whoever is looking for a group: matchmaking through the DHT, a butterfly
all-reduce, load balancing by bandwidth, and state download for newcomers. Names load on first use."""

from ..utils.exports import lazy_exports

_EXPORTS = {
    "DecentralizedAverager": ".averager",
    "AveragingError": ".averager",
    "AveragingMode": ".allreduce",
    "AllReduceError": ".allreduce",
    "StepControl": ".control",
    "AveragingStage": ".control",
    "GroupInfo": ".group_info",
    "load_balance_peers": ".load_balancing",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
