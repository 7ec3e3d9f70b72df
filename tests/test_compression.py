"""Compression: exact round trips, stated error bounds, NaN/inf policy, adaptive wrappers,
streaming, and the decoding invariant (any bytes either decode or raise CompressionError)."""

import asyncio
import math

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from plexus.compression import (
    BlockwiseQuantization,
    CompressionError,
    CompressionInfo,
    CompressionType,
    Float16Compression,
    NoCompression,
    PerTensorCompression,
    Quantile8BitQuantization,
    RoleAdaptiveCompression,
    ScaledFloat16Compression,
    SerializedTensor,
    SizeAdaptiveCompression,
    TensorRole,
    Uniform8BitQuantization,
    combine_from_streaming,
    deserialize_tensor_stream,
    deserialize_torch_tensor,
    serialize_torch_tensor,
    split_for_streaming,
)
from plexus.compression.wire import DTYPES

pytestmark = pytest.mark.timeout(60)

LOSSY = [t for t in CompressionType if t != CompressionType.NONE]
SHAPES = [(), (0,), (3, 0, 2), (1,), (7,), (4, 5), (2, 3, 4097)]


def roundtrip(tensor, compression=CompressionType.NONE):
    """Serialize, go through bytes, come back."""
    wire = serialize_torch_tensor(tensor, compression).to_bytes()
    return deserialize_torch_tensor(SerializedTensor.from_bytes(wire))


def rel_error(x, y):
    """Norm-relative error ||x - y|| / ||x||: the figure that matters for averaging."""
    return ((x.double() - y.double()).norm() / x.double().norm()).item()


def sample(dtype, shape, seed=0):
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_complex:
        return torch.randn(shape, generator=generator, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=generator, dtype=torch.int64).to(dtype)


# ---- NONE: bit-exact for every dtype and shape ---------------------------------------------------


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_none_roundtrip_is_exact(dtype, shape):
    x = sample(dtype, shape)
    y = roundtrip(x)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(
        x.view(-1).view(torch.uint8) if x.numel() else x, y.view(-1).view(torch.uint8) if y.numel() else y
    )


def test_none_keeps_nan_and_inf_bits():
    x = torch.tensor([math.nan, math.inf, -math.inf, -0.0, 1e-45])
    assert torch.equal(roundtrip(x).view(torch.int32), x.view(torch.int32))


def test_bfloat16_travels_as_bfloat16():
    x = torch.randn(1000).bfloat16()
    serialized = serialize_torch_tensor(x)
    assert serialized.dtype == "bfloat16" and len(serialized.buffer) == 2 * x.numel()
    assert torch.equal(roundtrip(x), x)
    for compression in LOSSY:  # every lossy method gives bfloat16 back
        assert roundtrip(x, compression).dtype == torch.bfloat16


def test_decoded_tensor_is_writable_and_owns_its_memory():
    x = torch.arange(10.0)
    wire = serialize_torch_tensor(x)
    y = deserialize_torch_tensor(wire)
    y += 1  # must not write into the message's immutable bytes
    assert torch.equal(deserialize_torch_tensor(wire), x)


def test_non_contiguous_and_requires_grad():
    x = torch.randn(6, 5).t()
    assert torch.equal(roundtrip(x), x)
    w = torch.randn(4, 4, requires_grad=True)
    for compression in CompressionType:
        y = roundtrip(w, compression)
        assert y.requires_grad and y.is_leaf


# ---- lossy methods: stated error bounds on N(0, 1) data ------------------------------------------

# Measured with this seed (100_000 elements): FLOAT16 2.1e-4, MEANSTD_16BIT 2.1e-4, UNIFORM_8BIT 9.2e-3,
# QUANTILE_8BIT 2.8e-2, BLOCKWISE_8BIT dynamic 7.9e-3, linear 8.7e-3, BLOCKWISE_4BIT 0.148 (meant for
# updates whose error is fed back). The bounds leave some room.
ERROR_BOUNDS = {
    CompressionType.FLOAT16: 1e-3,
    CompressionType.MEANSTD_16BIT: 1e-3,
    CompressionType.UNIFORM_8BIT: 0.015,
    CompressionType.QUANTILE_8BIT: 0.04,
    CompressionType.BLOCKWISE_8BIT: 0.012,
    CompressionType.BLOCKWISE_4BIT: 0.17,
}


@pytest.mark.parametrize("compression", LOSSY, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_lossy_error_bounds(compression, dtype):
    x = sample(torch.float32, (100_000,)).to(dtype)
    y = roundtrip(x, compression)
    assert y.dtype == dtype and y.shape == x.shape
    # a bf16/fp16 input cannot come back more precise than its own dtype allows
    slack = {torch.bfloat16: 8e-3, torch.float16: 1e-3}.get(dtype, 0.0)
    assert rel_error(x, y) < ERROR_BOUNDS[compression] + slack


def test_float16_relative_error_per_element():
    x = sample(torch.float32, (100_000,))
    y = roundtrip(x, CompressionType.FLOAT16)
    normal = x.abs() > 6.2e-5  # float16 normal range: relative rounding error at most 2**-11
    assert ((x - y).abs()[normal] / x.abs()[normal]).max() <= 2**-11


@pytest.mark.parametrize("codebook, bound", [("dynamic", 0.012), ("linear", 0.012)])
def test_blockwise_codebooks(codebook, bound):
    x = sample(torch.float32, (3, 10_000))
    method = BlockwiseQuantization(codebook)
    y = method.extract(method.compress(x, CompressionInfo.from_tensor(x)))
    assert y.shape == x.shape and rel_error(x, y) < bound
    assert method.extract(method.compress(torch.zeros(5000), None)).abs().max() == 0  # zero is exact


def test_scaled_float16_handles_any_scale_per_row():
    rows = torch.stack(
        [sample(torch.float32, (1000,), seed=1) * 1e-6, sample(torch.float32, (1000,), seed=2) * 1e6 + 3e6]
    )
    y = roundtrip(rows, CompressionType.MEANSTD_16BIT)
    for row, back in zip(rows, y):
        assert rel_error(row - row.mean(), back - row.mean()) < 1e-3


@pytest.mark.parametrize("compression", LOSSY, ids=lambda t: t.name)
def test_lossy_constant_and_tiny_tensors(compression):
    for x in (torch.full((100,), 7.25), torch.tensor(3.5), torch.tensor([-2.0])):
        assert torch.allclose(roundtrip(x, compression), x, rtol=1e-3)


@pytest.mark.parametrize("compression", LOSSY, ids=lambda t: t.name)
def test_lossy_methods_pass_non_float_tensors_uncompressed(compression):
    for x in (torch.arange(10), torch.tensor([True, False]), torch.randn(3, dtype=torch.complex64)):
        serialized = serialize_torch_tensor(x, compression)
        assert serialized.compression == CompressionType.NONE
        assert torch.equal(deserialize_torch_tensor(serialized), x)


@pytest.mark.parametrize("compression", CompressionType, ids=lambda t: t.name)
def test_input_untouched_without_allow_inplace(compression):
    x = sample(torch.float32, (5000,))
    copy = x.clone()
    serialize_torch_tensor(x, compression)
    assert torch.equal(x, copy)


def test_quantile_borders_are_deterministic_for_large_tensors():
    x = sample(torch.float32, (300_000,))
    first = serialize_torch_tensor(x, CompressionType.QUANTILE_8BIT)
    assert serialize_torch_tensor(x.clone(), CompressionType.QUANTILE_8BIT) == first


def test_compression_ratio_estimates():
    info32 = CompressionInfo.from_tensor(torch.zeros(1000))
    info16 = CompressionInfo.from_tensor(torch.zeros(1000, dtype=torch.float16))
    assert NoCompression().estimate_compression_ratio(info32) == 1.0
    assert Float16Compression().estimate_compression_ratio(info32) == 0.5
    assert Float16Compression().estimate_compression_ratio(info16) == 1.0
    assert ScaledFloat16Compression().estimate_compression_ratio(info32) == 0.5
    assert Uniform8BitQuantization().estimate_compression_ratio(info32) == 0.25
    assert Quantile8BitQuantization().estimate_compression_ratio(info32) == 0.25
    assert BlockwiseQuantization().estimate_compression_ratio(info32) == (8 + 32 / 4096) / 32
    assert (
        Uniform8BitQuantization().estimate_compression_ratio(CompressionInfo.from_tensor(torch.arange(3)))
        == 1.0
    )
    # the estimate matches the real size of a large tensor to within the fixed overhead
    x = sample(torch.float32, (1 << 20,))
    for compression in LOSSY:
        method = deserialize_method(compression)
        real = len(method.compress(x, CompressionInfo.from_tensor(x)).buffer) / (4 * x.numel())
        assert abs(real - method.estimate_compression_ratio(CompressionInfo.from_tensor(x))) < 1e-3


def deserialize_method(compression):
    from plexus.compression import BASE_COMPRESSION_TYPES

    return BASE_COMPRESSION_TYPES[compression.name]


# ---- NaN and inf: documented policy --------------------------------------------------------------
# NONE: bit-exact. FLOAT16: NaN -> NaN, ±inf -> ±inf, finite beyond ±65504 saturates to ±65504.
# MEANSTD_16BIT, UNIFORM_8BIT, QUANTILE_8BIT, BLOCKWISE_8BIT, BLOCKWISE_4BIT: NaN -> NaN, ±inf -> ±inf; statistics
# are taken over the finite values only, so the finite values keep their usual precision.


@pytest.mark.parametrize("compression", LOSSY, ids=lambda t: t.name)
def test_nan_and_inf_pass_through_and_do_not_spoil_finite_values(compression):
    x = sample(torch.float32, (20_000,))
    special = torch.tensor([math.nan, math.inf, -math.inf])
    x[[5, 500, 15_000]] = special
    y = roundtrip(x, compression)
    assert torch.isnan(y[5]) and y[500] == math.inf and y[15_000] == -math.inf
    finite = torch.isfinite(x)
    assert torch.isfinite(y[finite]).all()
    assert rel_error(x[finite], y[finite]) < ERROR_BOUNDS[compression] * 1.2


@pytest.mark.parametrize("compression", LOSSY, ids=lambda t: t.name)
def test_all_non_finite(compression):
    x = torch.tensor([math.nan, math.inf, -math.inf, math.nan])
    y = roundtrip(x, compression)
    assert torch.isnan(y[0]) and torch.isnan(y[3]) and y[1] == math.inf and y[2] == -math.inf


def test_float16_saturates_finite_overflow():
    x = torch.tensor([1e6, -1e6, 70000.0, 1.0], dtype=torch.float64)
    assert roundtrip(x, CompressionType.FLOAT16).tolist() == [65504.0, -65504.0, 65504.0, 1.0]
    big = torch.tensor([3e38, -1.0]).bfloat16()  # bf16 beyond float16's range: saturates, stays bf16
    y = roundtrip(big, CompressionType.FLOAT16)
    assert y.dtype == torch.bfloat16 and y.float().tolist() == [65536.0, -1.0]  # 65504 rounded to bf16


# ---- adaptive wrappers ---------------------------------------------------------------------------


def test_size_adaptive_chooses_by_numel():
    method = SizeAdaptiveCompression(
        threshold=1000, less=Float16Compression(), greater_equal=Uniform8BitQuantization()
    )
    small, large = torch.randn(999), torch.randn(10, 100)
    assert method.compress(small, CompressionInfo.from_tensor(small)).compression == CompressionType.FLOAT16
    assert (
        method.compress(large, CompressionInfo.from_tensor(large)).compression == CompressionType.UNIFORM_8BIT
    )
    assert method.estimate_compression_ratio(CompressionInfo.from_tensor(large)) == 0.25
    serialized = method.compress(large, CompressionInfo.from_tensor(large))
    assert method.extract(serialized).shape == large.shape


def test_role_adaptive_chooses_by_role():
    method = RoleAdaptiveCompression(gradient=Float16Compression(), optimizer=Uniform8BitQuantization())
    x = torch.randn(100)
    expected = {
        TensorRole.GRADIENT: CompressionType.FLOAT16,
        TensorRole.OPTIMIZER: CompressionType.UNIFORM_8BIT,
        TensorRole.PARAMETER: CompressionType.NONE,
        TensorRole.ACTIVATION: CompressionType.NONE,
        TensorRole.UNSPECIFIED: CompressionType.NONE,
    }
    for role, kind in expected.items():
        assert method.compress(x, CompressionInfo.from_tensor(x, role=role)).compression == kind
    custom_default = RoleAdaptiveCompression(activation=NoCompression(), default=ScaledFloat16Compression())
    info = CompressionInfo.from_tensor(x, role=TensorRole.PARAMETER)
    assert custom_default.compress(x, info).compression == CompressionType.MEANSTD_16BIT


def test_per_tensor_by_index_and_by_key():
    by_index = PerTensorCompression([NoCompression(), Float16Compression()])
    by_key = PerTensorCompression({"weight": BlockwiseQuantization(), "bias": NoCompression()})
    x = torch.randn(50)
    assert by_index.compress(x, CompressionInfo.from_tensor(x, key=1)).compression == CompressionType.FLOAT16
    assert (
        by_key.compress(x, CompressionInfo.from_tensor(x, key="weight")).compression
        == CompressionType.BLOCKWISE_8BIT
    )
    with pytest.raises(KeyError, match="no method for tensor key 'gamma'"):
        by_key.compress(x, CompressionInfo.from_tensor(x, key="gamma"))


def test_compression_info():
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    info = CompressionInfo.from_tensor(x, key="w", role=TensorRole.PARAMETER)
    assert (
        info.descriptor.size == (3, 4)
        and info.descriptor.dtype == torch.float64
        and info.descriptor.requires_grad
    )
    assert (
        info.descriptor.numel() == 12
        and CompressionInfo.from_tensor(torch.tensor(1.0)).descriptor.numel() == 1
    )
    part = info.get_part(2, 100)
    assert (part.key, part.role, part.part_index, part.part_size) == ("w", TensorRole.PARAMETER, 2, 100)


# ---- streaming -----------------------------------------------------------------------------------


@pytest.mark.parametrize("compression", CompressionType, ids=lambda t: t.name)
@pytest.mark.parametrize("chunk_size", [1, 1000, 4096, 1 << 20])
def test_split_and_combine(compression, chunk_size):
    x = sample(torch.float32, (1234,))
    serialized = serialize_torch_tensor(x, compression)
    chunks = list(split_for_streaming(serialized, chunk_size))
    assert len(chunks) == max(1, -(-len(serialized.buffer) // chunk_size))
    assert all(len(c.buffer) <= chunk_size for c in chunks)
    wire_chunks = [SerializedTensor.from_bytes(c.to_bytes()) for c in chunks]
    assert combine_from_streaming(wire_chunks) == serialized


def test_deserialize_tensor_stream():
    tensors = [sample(torch.float32, (1000,)), torch.tensor(2.0), torch.empty(0), torch.arange(7)]
    chunks = [c for t in tensors for c in split_for_streaming(serialize_torch_tensor(t), 333)]
    assert [c.chunks for c in chunks if c.is_header] == [13, 1, 1, 1]

    async def stream(items, per_message):
        for start in range(0, len(items), per_message):
            yield items[start : start + per_message]

    for per_message in (1, 2, 5, len(chunks)):
        result = asyncio.run(deserialize_tensor_stream(stream(chunks, per_message)))
        assert len(result) == len(tensors) and all(torch.equal(a, b) for a, b in zip(result, tensors))

    broken_streams = {
        "stream ended inside": chunks[:12],  # the first tensor has 13 chunks
        "continuation chunk arrived": chunks[1:],
        "ended after": chunks[:2] + chunks[13:],
    }
    for message, items in broken_streams.items():
        with pytest.raises(CompressionError, match=message):
            asyncio.run(deserialize_tensor_stream(stream(items, 3)))


def test_combine_rejects_bad_chunk_sequences():
    serialized = serialize_torch_tensor(torch.randn(100))
    chunks = list(split_for_streaming(serialized, 64))
    with pytest.raises(CompressionError):
        combine_from_streaming([])
    with pytest.raises(CompressionError):
        combine_from_streaming(chunks + chunks[1:2])
    with pytest.raises(CompressionError):
        combine_from_streaming(chunks[:1] + chunks[2:] + chunks[2:])  # too many bytes for the header
    with pytest.raises(CompressionError):
        deserialize_torch_tensor(chunks[0])  # a first chunk is not a whole tensor


# ---- validation of messages from peers -----------------------------------------------------------


def packed(buffer=b"\0" * 4, size=(1,), dtype="float32", compression=0, requires_grad=False, chunks=1):
    return msgpack.packb([buffer, list(size), dtype, compression, requires_grad, chunks], use_bin_type=True)


@pytest.mark.parametrize(
    "fields, reason",
    [
        (dict(dtype="float128"), "unknown dtype"),
        (dict(dtype="torch.float32"), "unknown dtype"),
        (dict(size=(-1,)), "outside"),
        (dict(size=(2**60,)), "outside"),
        (dict(size=(1,) * 33), "more than the limit"),
        (dict(size=(0, 2**40, 2**40), buffer=b""), "spans more than"),
        (dict(buffer=b"\0" * 3), "needs exactly 4 bytes"),
        (dict(buffer=b"\0" * 5), "needs exactly 4 bytes"),
        (dict(compression=9), "unknown compression"),
        (dict(compression=-1), "unknown compression"),
        (dict(compression=1, dtype="int64", buffer=b"\0" * 2), "applies to floating"),
        (dict(dtype="int32", requires_grad=True), "requires_grad"),
        (dict(requires_grad=1), "requires_grad must be a bool"),
        (dict(buffer="text"), "buffer must be bytes"),
        (dict(size=(1.0,)), "size must be"),
        (dict(chunks=-1), "chunks"),
        (dict(chunks=0), "continuation chunk"),
        (dict(compression=3, buffer=b"\0" * 1024), "needs exactly 1025 bytes"),
        (dict(compression=5, size=(4097,), buffer=b"\0" * (1024 + 4 + 4097)), "needs exactly 5129 bytes"),
    ],
)
def test_inconsistent_messages_rejected(fields, reason):
    with pytest.raises(CompressionError, match=reason):
        SerializedTensor.from_bytes(packed(**fields))


def test_not_msgpack_or_wrong_shape_rejected():
    for data in (
        b"",
        b"\xc1",
        b"\x93\x01\x02\x03",
        msgpack.packb({"buffer": b""}),
        msgpack.packb([1] * 6),
        b"\x96" + b"\xc0" * 6,
    ):
        with pytest.raises(CompressionError):
            SerializedTensor.from_bytes(data)


def test_bool_bytes_must_be_zero_or_one():
    message = SerializedTensor.from_bytes(packed(buffer=b"\x00\x01\x02", size=(3,), dtype="bool"))
    with pytest.raises(CompressionError, match="bool"):
        deserialize_torch_tensor(message)


VALID_MESSAGES = [
    serialize_torch_tensor(sample(torch.float32, (300,)), compression).to_bytes()
    for compression in CompressionType
] + [
    serialize_torch_tensor(sample(torch.bool, (9,))).to_bytes(),
    serialize_torch_tensor(torch.tensor(1.5).bfloat16()).to_bytes(),
]


def decode_or_compression_error(data):
    """The invariant: bytes from a peer decode to a tensor or raise CompressionError, nothing else."""
    try:
        message = SerializedTensor.from_bytes(data)
        if message.chunks == 1:
            tensor = deserialize_torch_tensor(message)
            assert tuple(tensor.shape) == message.size
    except CompressionError:
        pass


@pytest.mark.parametrize("index", range(len(VALID_MESSAGES)))
def test_every_truncation_rejected(index):
    data = VALID_MESSAGES[index]
    for cut in range(len(data)):
        with pytest.raises(CompressionError):
            SerializedTensor.from_bytes(data[:cut])


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=2048))
def test_fuzz_garbage_bytes(data):
    decode_or_compression_error(data)


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(VALID_MESSAGES),
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=8),
)
def test_fuzz_mutated_valid_messages(data, flips):
    mutated = bytearray(data)
    for position, value in flips:
        mutated[position % len(mutated)] = value
    decode_or_compression_error(bytes(mutated))


@settings(max_examples=200, deadline=None)
@given(
    buffer=st.binary(max_size=1100),
    size=st.lists(st.integers(-3, 2**50), max_size=4) | st.lists(st.integers(0, 40), max_size=3),
    dtype=st.sampled_from(list(DTYPES) + ["", "float", "int128"]),
    compression=st.integers(-2, 7),
    requires_grad=st.booleans() | st.integers(0, 2) | st.none(),
    chunks=st.integers(-1, 3),
)
def test_fuzz_structured_fields(buffer, size, dtype, compression, requires_grad, chunks):
    decode_or_compression_error(packed(buffer, size, dtype, compression, requires_grad, chunks))


@settings(max_examples=200, deadline=None)
@given(
    compression=st.sampled_from(list(CompressionType)),
    size=st.lists(st.integers(0, 9), max_size=3),
    dtype=st.sampled_from(sorted(DTYPES)),
    data=st.data(),
)
def test_fuzz_random_buffers_of_the_right_length(compression, size, dtype, data):
    """Length-consistent messages with random contents (codebooks, absmax, codes) always decode."""
    from plexus.compression.wire import FLOATING_DTYPES, expected_buffer_length

    if compression != CompressionType.NONE and dtype not in FLOATING_DTYPES:
        dtype = "float32"
    length = expected_buffer_length(compression, size, dtype)
    buffer = data.draw(st.binary(min_size=length, max_size=length))
    message = SerializedTensor.from_bytes(packed(buffer, size, dtype, int(compression)))
    try:
        tensor = deserialize_torch_tensor(message)
    except CompressionError:
        assert dtype == "bool"  # only bytes other than 0/1 in a bool tensor are refused
        return
    assert tuple(tensor.shape) == tuple(size) and tensor.dtype == DTYPES[dtype]
