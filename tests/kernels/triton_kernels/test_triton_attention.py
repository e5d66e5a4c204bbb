"""The unified paged-attention kernel against a plain-loop float32 reference.

Batches mix fresh prefills that cross page boundaries, prefix-cache hits (a cached
prefix plus a few new tokens), chunk continuations and decode rows at, just before and
just after page boundaries; pages are scattered through a cache full of random values.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from triton_cases import TOLERANCE, make_batch, reference_attention

MIXED = [(0, 20), (16, 5), (37, 1), (31, 1), (32, 1), (5, 11), (0, 1)]
DECODE_LONG = [(99, 1), (256, 1), (12, 1)]


def _run(b, scale, **kw):
    from aiolm.kernels.triton.attention import paged_attention

    out = torch.full_like(b.q, float("nan"))
    paged_attention(
        out, b.q, b.kv_cache[0], b.kv_cache[1], b.block_table, b.cu_seqlens_q, b.seq_lens, b.max_query_len, scale, **kw
    )
    return out


def _check(specs, heads, kv_heads, head_dim, block_size, dtype, device, window=None, soft_cap=None, **kw):
    b = make_batch(
        specs, heads, kv_heads, head_dim, block_size, dtype, device, seed=heads * 1000 + head_dim + block_size
    )
    scale = head_dim**-0.5
    got = _run(b, scale, window=window, soft_cap=soft_cap, **kw).float().cpu()
    want = reference_attention(b, scale, window, soft_cap)
    torch.testing.assert_close(got, want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])  # GQA 1, 3, 8
def test_mixed_batch_dtypes_and_gqa(dtype, heads, kv_heads, device):
    _check(MIXED, heads, kv_heads, 64, 16, dtype, device)


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_fp8_cache(q_dtype, heads, kv_heads, device):
    """A float8 e4m3 cache (--kv-cache-dtype fp8) read as its exact values: float32 queries
    take them as float32, 16-bit ones as float16 of value / 256 (scaled back in the kernel)."""
    b = make_batch(MIXED, heads, kv_heads, 64, 16, q_dtype, device, seed=heads + 7)
    b = dataclasses.replace(b, kv_cache=(b.kv_cache.float() * 40).to(torch.float8_e4m3fn))  # past 2^-6 and 256
    scale = 64**-0.5 / 40
    got = _run(b, scale).float().cpu()
    want = reference_attention(b, scale)
    torch.testing.assert_close(got, want, atol=TOLERANCE[q_dtype] * 40, rtol=TOLERANCE[q_dtype])


@pytest.mark.parametrize("splits", [2, 4])
def test_fp8_cache_split_kv(splits, device):
    b = make_batch(DECODE_LONG, 6, 2, 64, 16, torch.float16, device, seed=splits)
    b = dataclasses.replace(b, kv_cache=b.kv_cache.to(torch.float8_e4m3fn))
    got = _run(b, 0.125, num_splits=splits).float().cpu()
    torch.testing.assert_close(got, reference_attention(b, 0.125), atol=4e-3, rtol=4e-3)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32])
def test_head_sizes_and_block_sizes(head_dim, block_size, device):
    _check(MIXED, 6, 2, head_dim, block_size, torch.float16, device)


@pytest.mark.parametrize("window", [1, 4, 16, 21])
@pytest.mark.parametrize("block_size", [16, 32])
def test_sliding_window(window, block_size, device):
    """Window 1: each query sees only itself; 16 and 21 put the window's edge on and off a page."""
    _check(MIXED, 6, 2, 64, block_size, torch.float32, device, window=window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("soft_cap", [2.0, 30.0])
def test_soft_cap(dtype, soft_cap, device):
    """Cap 2 squashes almost every score; 30 is Gemma 2's value and barely touches them."""
    _check(MIXED, 4, 4, 64, 16, dtype, device, soft_cap=soft_cap)


def test_window_and_soft_cap_together(device):
    _check(MIXED, 8, 1, 128, 32, torch.float16, device, window=7, soft_cap=10.0)


@pytest.mark.parametrize("splits", [2, 3, 7])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 1)])
def test_split_kv_decode(splits, heads, kv_heads, device):
    """Shares of uneven size, and with 7 shares of the 12-token row some are empty."""
    _check(DECODE_LONG, heads, kv_heads, 64, 16, torch.float32, device, num_splits=splits)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_split_kv_with_window(dtype, device):
    _check(DECODE_LONG, 6, 2, 64, 16, dtype, device, num_splits=4, window=40)


def test_split_kv_on_a_mixed_batch(device):
    """The split path is correct for prefill tiles too, though only decode steps choose it."""
    _check(MIXED, 6, 2, 64, 16, torch.float32, device, num_splits=3)


@pytest.mark.parametrize("block_m", [16, 32, 128])
def test_query_tiles_split_a_chunk(block_m, device):
    """Group 1 and 16-row tiles cut the 20- and 11-token chunks into several query tiles."""
    _check(MIXED, 4, 4, 64, 16, torch.float32, device, block_m=block_m)


def test_head_dim_not_a_power_of_two(device):
    _check(MIXED, 6, 2, 80, 16, torch.float16, device)


@pytest.mark.parametrize("block_size", [8, 24])
def test_rejects_pages_a_dot_cannot_take(block_size, device):
    b = make_batch([(0, 3)], 4, 4, 64, block_size, torch.float32, device)
    with pytest.raises(ValueError, match="block_size"):
        _run(b, 0.125)


def test_choose_num_splits():
    from aiolm.kernels.triton.attention import choose_num_splits

    assert choose_num_splits(4, 2, max_query_len=8, max_seq_len=8192, block_size=16) == 1  # not decode
    assert choose_num_splits(64, 8, 1, 8192, 16) == 1  # enough programs already
    assert choose_num_splits(1, 1, 1, 64, 16) == 1  # too short to share
    assert choose_num_splits(1, 8, 1, 8192, 16) == 16
    assert choose_num_splits(2, 8, 1, 512, 16) == 4  # 32 pages, 8 a share
