"""TensorPartition: spans and parts cover the vector exactly once, views write in place."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from plexus.averaging.partition import TensorPartition, spans_from_fractions
from plexus.compression import Float16Compression, NoCompression, Uniform8BitQuantization

pytestmark = pytest.mark.timeout(60)


def make_tensors(sizes, dtypes=(torch.float32,)):
    return [
        torch.arange(n, dtype=torch.float64).to(dtypes[i % len(dtypes)]) + 1000 * i
        for i, n in enumerate(sizes)
    ]


def covered(partition):
    """(tensor_index, element) pairs in the order the parts visit them, over all spans."""
    seen = []
    for reducer in range(partition.group_size):
        for part in partition.parts(reducer):
            seen.extend((part.tensor_index, e) for e in range(part.start, part.stop))
    return seen


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=6),
    fractions=st.lists(st.floats(0, 1), min_size=1, max_size=5).filter(lambda f: sum(f) > 0.01),
    part_size=st.integers(1, 700),
)
def test_parts_cover_every_element_once_in_order(sizes, fractions, part_size):
    tensors = make_tensors(sizes, (torch.float32, torch.float16, torch.bfloat16))
    spans = spans_from_fractions(sum(sizes), fractions)
    partition = TensorPartition(tensors, spans, NoCompression(), part_size)
    assert covered(partition) == [(i, e) for i, n in enumerate(sizes) for e in range(n)]
    start = 0
    for reducer, span in enumerate(spans):
        parts = list(partition.parts(reducer))
        assert len(parts) == partition.num_parts(reducer)
        assert sum(p.numel for p in parts) == span
        for k, part in enumerate(parts):
            assert part.index == k and part == partition.part(reducer, k)
            assert 0 < part.numel and part.numel * tensors[part.tensor_index].element_size() <= max(
                part_size, 4
            )
        start += span


def test_part_size_follows_the_compression_estimate():
    tensors = [torch.zeros(10_000), torch.zeros(10_000, dtype=torch.float16)]
    plain = TensorPartition(tensors, [20_000], NoCompression(), 4000)
    half = TensorPartition(tensors, [20_000], Float16Compression(), 4000)
    byte = TensorPartition(tensors, [20_000], Uniform8BitQuantization(), 4000)
    assert plain.part(0, 0).numel == 1000 and half.part(0, 0).numel == 2000 and byte.part(0, 0).numel == 4000
    # float16 tensor: float16 compression changes nothing, 8-bit halves its size
    assert plain.part(0, 10).numel == 2000 and half.part(0, 5).numel == 2000 and byte.part(0, 3).numel == 4000


def test_views_write_in_place_and_apply():
    a, b = torch.zeros(5), torch.zeros(3, 2, dtype=torch.float16)
    partition = TensorPartition([a, b], [4, 7], NoCompression(), 8)  # 2 float32 or 4 float16 per part
    parts = list(partition.parts(1))
    assert [(p.tensor_index, p.start, p.stop) for p in parts] == [(0, 4, 5), (1, 0, 4), (1, 4, 6)]
    assert partition.view(parts[1]).data_ptr() == b.data_ptr()  # a view, not a copy
    partition.apply_average(parts[1], torch.tensor([1.0, 2, 3, 4]))
    assert b.view(-1).tolist() == [1, 2, 3, 4, 0, 0]
    partition.apply_average(parts[2], torch.tensor([8.0, 8.0]), alpha=0.25)
    assert b.view(-1)[4:].tolist() == [2, 2]
    partition.apply_delta(parts[0], torch.tensor([3.0]), alpha=0.5)
    assert a.tolist() == [0, 0, 0, 0, 1.5]


def test_with_outputs_results_go_there_and_the_tensors_are_only_read():
    a = torch.arange(4.0)
    out = torch.full((4,), float("nan"))
    partition = TensorPartition([a], [4], NoCompression(), 8, outputs=[out])  # 2 float32 per part
    first, second = partition.parts(0)
    partition.apply_average(first, torch.tensor([8.0, 8.0]), alpha=0.5)
    partition.apply_delta(second, torch.tensor([1.0, 1.0]), alpha=2.0)
    assert out.tolist() == [4, 4.5, 4, 5] and a.tolist() == [0, 1, 2, 3]
    partition.keep(first)
    assert out.tolist() == [0, 1, 4, 5]
    with pytest.raises(ValueError, match="outputs must be"):
        TensorPartition([a], [4], outputs=[torch.zeros(4, dtype=torch.float64)])


def test_fractions_give_the_same_integers_everywhere():
    assert spans_from_fractions(10, [1, 1, 1]) == (4, 3, 3)
    assert spans_from_fractions(10, [0.5, 0, 0.5]) == (5, 0, 5)
    with pytest.raises(ValueError, match="nobody would reduce"):
        spans_from_fractions(10, [0, 0])
    with pytest.raises(ValueError, match="finite"):
        spans_from_fractions(10, [float("nan"), 1])


def test_bad_inputs_are_refused_with_reasons():
    with pytest.raises(ValueError, match="not contiguous"):
        TensorPartition([torch.zeros(4, 4).t()], [16])
    with pytest.raises(ValueError, match="floating"):
        TensorPartition([torch.zeros(4, dtype=torch.int64)], [4])
    with pytest.raises(ValueError, match="sum to"):
        TensorPartition([torch.zeros(4)], [3])
    with pytest.raises(ValueError, match="part_size_bytes"):
        TensorPartition([torch.zeros(4)], [4], part_size_bytes=0)
    with pytest.raises(IndexError):
        TensorPartition([torch.zeros(4)], [4]).part(0, 1)
