"""hivemind's compression API: CompressionType's numbers and protobuf-enum helpers, and adaptive
methods whose own `compress` runs during all-reduce."""

import threading

import pytest
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.compression import (
    CompressionBase,
    CompressionInfo,
    Float16Compression,
    NoCompression,
    deserialize_torch_tensor,
    serialize_torch_tensor,
)
from hivemind.compression.adaptive import AdaptiveCompressionBase
from hivemind.proto.runtime_pb2 import CompressionType

pytestmark = pytest.mark.timeout(60)


def test_compression_type_has_hiveminds_numbers_and_enum_api():
    assert CompressionType.items()[:6] == [  # hivemind's; Plexus adds its own after them
        ("NONE", 0),
        ("MEANSTD_16BIT", 1),
        ("FLOAT16", 2),
        ("QUANTILE_8BIT", 3),
        ("UNIFORM_8BIT", 4),
        ("BLOCKWISE_8BIT", 5),
    ]
    assert CompressionType.items()[6:] == [("BLOCKWISE_4BIT", 6)]
    assert CompressionType.values()[:6] == [0, 1, 2, 3, 4, 5] and CompressionType.keys()[2] == "FLOAT16"
    assert CompressionType.Name(2) == "FLOAT16" and CompressionType.Value("UNIFORM_8BIT") == 4
    serialized = serialize_torch_tensor(torch.randn(100), 2)  # the number hivemind code writes for FLOAT16
    assert serialized.compression == CompressionType.FLOAT16 and len(serialized.buffer) == 200
    ramp = torch.linspace(0, 1, 50)
    restored = deserialize_torch_tensor(serialize_torch_tensor(ramp, CompressionType.Value("FLOAT16")))
    assert torch.allclose(restored, ramp, atol=1e-3)


class CountingCompression(AdaptiveCompressionBase):
    """An adaptive method that overrides compress(), as hivemind users write them."""

    def __init__(self, compression: CompressionBase):
        self.compression, self.calls, self.lock = compression, 0, threading.Lock()

    def choose_compression(self, info: CompressionInfo) -> CompressionBase:
        return self.compression

    def compress(self, tensor, info, allow_inplace=False):
        with self.lock:
            self.calls += 1
        return self.compression.compress(tensor, info, allow_inplace)


@pytest.mark.parametrize("leaf", [Float16Compression(), NoCompression()], ids=["float16", "none"])
def test_an_adaptive_methods_own_compress_runs_during_all_reduce(leaf, dht_pair):
    counting = [CountingCompression(leaf), CountingCompression(leaf)]
    tensors = [[torch.full((1000,), 1.0)], [torch.full((1000,), 3.0)]]
    averagers = [
        DecentralizedAverager(
            t,
            dht=dht,
            prefix="counted",
            target_group_size=2,
            min_matchmaking_time=1.0,
            compression=compression,
            start=True,
        )
        for t, dht, compression in zip(tensors, dht_pair, counting)
    ]
    try:
        futures = [averager.step(wait=False, timeout=20) for averager in averagers]
        assert all(future.result() for future in futures)
        assert torch.allclose(tensors[0][0], torch.full((1000,), 2.0), atol=1e-2)
        assert all(method.calls > 0 for method in counting), [method.calls for method in counting]
    finally:
        for averager in averagers:
            averager.shutdown()
