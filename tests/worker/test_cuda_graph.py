"""CUDA-graph bookkeeping, pure and on the CPU: sizes, padding, when to run eagerly.

The padded run through the real Triton kernels, and capture on a GPU, are tested in
tests/kernels/triton_kernels/test_triton_graph_runner.py.
"""

from __future__ import annotations

import pytest
import torch

from aiolm.attention.metadata import AttentionMetadata
from aiolm.worker.cuda_graph import DecodeBuffers, capture_sizes, padded_size, plan_step


def test_capture_sizes_default():
    sizes = capture_sizes(max_num_seqs=512)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24]
    assert sizes[-1] == 256 and len(sizes) == 3 + 32
    assert all(b - a == 8 for a, b in zip(sizes[3:], sizes[4:]))


@pytest.mark.parametrize(
    "max_num_seqs,max_size,want",
    [
        (256, 256, [1, 2, 4, 8] + list(range(16, 257, 8))),
        (10, 256, [1, 2, 4, 8, 10]),  # the limit itself is captured, so every decode batch has a graph
        (64, 20, [1, 2, 4, 8, 16, 20]),
        (1, 256, [1]),
        (3, 256, [1, 2, 3]),
        (8, 256, [1, 2, 4, 8]),
    ],
)
def test_capture_sizes_limits(max_num_seqs, max_size, want):
    assert capture_sizes(max_num_seqs, max_size) == want


def test_capture_sizes_rejects_zero():
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


def test_padded_size_is_the_smallest_that_fits():
    sizes = capture_sizes(256)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 255, 256)] == [
        1,
        2,
        4,
        4,
        8,
        8,
        16,
        16,
        24,
        256,
        256,
    ]
    assert padded_size(257, sizes) is None


def test_plan_step():
    sizes = capture_sizes(64, 32)
    assert plan_step(3, 3, sizes).size == 4
    assert plan_step(32, 32, sizes).size == 32
    big = plan_step(33, 33, sizes)
    assert big.eager and "largest" in big.reason
    mixed = plan_step(3, 9, sizes)  # two decode rows and a 7-token prefill chunk
    assert mixed.eager and "prefill" in mixed.reason
    assert plan_step(1, 5, sizes).eager  # one prefill chunk
    assert plan_step(0, 0, sizes).eager
    forced = plan_step(3, 3, sizes, enforce_eager=True)
    assert forced.eager and forced.reason == "enforce_eager"


def _decode_meta(seq_lens: list[int], block_ids: list[list[int]], block_size: int = 16) -> AttentionMetadata:
    return AttentionMetadata.build([1] * len(seq_lens), seq_lens, block_ids, block_size)


def test_fill_pads_rows_so_they_touch_nothing():
    buf = DecodeBuffers(max_size=8, max_blocks_per_seq=4, block_size=16, max_model_len=64, device="cpu")
    # a previous, larger step left real-looking values in every row
    big = _decode_meta([20] * 8, [[1, 2]] * 8)
    buf.fill(8, torch.arange(8), torch.full((8,), 19), big)
    meta = _decode_meta([5, 17, 33], [[3], [4, 5], [6, 7, 8]])
    buf.fill(8, torch.tensor([11, 12, 13]), torch.tensor([4, 16, 32]), meta)
    assert buf.slot_mapping[:3].tolist() == meta.slot_mapping.tolist() == [3 * 16 + 4, 5 * 16 + 0, 8 * 16 + 0]
    assert buf.slot_mapping[3:].tolist() == [-1] * 5  # padding never reaches a real slot
    assert buf.seq_lens.tolist() == [5, 17, 33, 0, 0, 0, 0, 0]
    assert buf.block_table[3:].eq(0).all()  # only the null block
    assert buf.block_table[:3, :3].tolist() == [[3, 0, 0], [4, 5, 0], [6, 7, 8]]
    assert buf.input_ids.tolist() == [11, 12, 13, 0, 0, 0, 0, 0]
    assert buf.positions.tolist() == [4, 16, 32, 0, 0, 0, 0, 0]
    assert buf.slot_mapping.dtype == buf.seq_lens.dtype == buf.block_table.dtype == torch.int32


def test_meta_of_a_size_views_the_buffers():
    buf = DecodeBuffers(max_size=8, max_blocks_per_seq=4, block_size=16, max_model_len=64, device="cpu")
    m = buf.meta(4)
    assert m.num_reqs == 4 and m.max_query_len == 1 and m.max_seq_len == 64  # host lists: the worst case
    assert m.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    buf.fill(4, torch.tensor([7, 8]), torch.tensor([1, 2]), _decode_meta([2, 3], [[9], [10]]))
    assert m.seq_lens.tolist() == [2, 3, 0, 0]  # a view: filled in place, as a graph needs
    assert m.slot_mapping.tolist() == [9 * 16 + 1, 10 * 16 + 2, -1, -1]


def test_fill_rejects_what_does_not_fit():
    buf = DecodeBuffers(max_size=4, max_blocks_per_seq=2, block_size=16, max_model_len=32, device="cpu")
    with pytest.raises(ValueError, match="does not fit"):
        buf.fill(2, torch.arange(3), torch.arange(3), _decode_meta([1, 1, 1], [[1], [2], [3]]))
    prefill = AttentionMetadata.build([2], [2], [[1]], 16)
    with pytest.raises(ValueError, match="does not fit"):
        buf.fill(4, torch.arange(2), torch.arange(2), prefill)
    with pytest.raises(ValueError, match="wider"):
        buf.fill(4, torch.arange(1), torch.arange(1), _decode_meta([40], [[1, 2, 3]]))
