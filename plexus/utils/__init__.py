"""Leaf helpers with no networking: DHT time, logging, msgpack, expiring storage, nested structures,
throughput estimates and the process's background event loop. Names load on first use."""

from .exports import lazy_exports

_EXPORTS = {
    "DHTExpiration": ".timing",
    "MAX_DHT_TIME_DISCREPANCY_SECONDS": ".timing",
    "get_dht_time": ".timing",
    "get_logger": ".logging",
    "use_plexus_log_handler": ".logging",
    "MSGPackSerializer": ".serializer",
    "SerializationError": ".serializer",
    "TimedStorage": ".timed_storage",
    "ValueWithExpiration": ".timed_storage",
    "PerformanceEMA": ".performance_ema",
    "nested_flatten": ".nested",
    "nested_map": ".nested",
    "nested_pack": ".nested",
    "AwaitableFuture": ".futures",
    "get_background_loop": ".background_loop",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
