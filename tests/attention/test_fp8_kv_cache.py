"""The fp8 KV cache (--kv-cache-dtype fp8: float8 e4m3 with per-layer scales) on the CPU: the
C++ kernel reads every e4m3 value exactly, and the CPU backend (C++) and the torch
reference backend write the same bytes and attend alike, scales included."""

from __future__ import annotations

import pytest
import torch

from aiolm.attention.cpu_backend import CpuPagedAttention
from aiolm.attention.metadata import AttentionMetadata
from aiolm.attention.torch_backend import FP8, TorchAttention, kv_cache_shape
from aiolm.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ compiler for the CPU kernels")


@pytest.mark.parametrize("head_dim", [64, 128, 16])  # the AVX-512 row kernels, and the 8-wide loads
def test_kernel_reads_every_e4m3_value_exactly(head_dim):
    """A query with one key attends to it alone: the output is that key's V, so V holding every
    finite byte shows the kernel's conversion of each (subnormals, signs, 448)."""
    values = torch.arange(256, dtype=torch.uint8)
    values = values[(values & 0x7F) != 0x7F]  # e4m3's two NaNs are never written (saturation)
    kv_heads = -(-values.numel() // head_dim)
    row = torch.zeros(kv_heads * head_dim, dtype=torch.uint8)
    row[: values.numel()] = values
    cache = torch.zeros(kv_cache_shape(2, 16, kv_heads, head_dim), dtype=FP8)
    cache.view(torch.uint8)[1, 1, 0] = row.view(kv_heads, head_dim)  # V of block 1's first slot
    meta = AttentionMetadata.build([1], [1], [[1]], 16)
    q = torch.randn(1, kv_heads, head_dim)
    out = torch.empty_like(q)
    torch.ops.aiolm.paged_attention(
        out, q, cache[0], cache[1], meta.block_table, meta.query_start_loc, meta.seq_lens, 1.0
    )
    want = row.view(FP8).float()
    assert torch.equal(out.flatten(), want)
    assert want.abs().max() == 448 and (want.abs() == 2**-9).any()  # the largest and the smallest


@pytest.mark.parametrize(("k_scale", "v_scale"), [(1.0, 1.0), (0.05, 3.0)])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (7, 30.0)])
def test_cpu_backend_matches_torch_backend(k_scale, v_scale, window, soft_cap):
    """Decode rows and prefill chunks (tiles) over scattered pages: the same bytes written,
    outputs within float32 rounding of the reference's, which dequantizes the pages."""
    g = torch.Generator().manual_seed(int(k_scale * 100) + (window or 0))
    qlens, slens = [1, 23, 1, 9], [37, 23, 130, 40]
    tables, nxt = [], 1
    for s in slens:
        n = -(-s // 16)
        tables.append(list(range(nxt + n - 1, nxt - 1, -1)))
        nxt += n
    meta = AttentionMetadata.build(qlens, slens, tables, 16)
    t, heads, kv_heads, d = sum(qlens), 9, 3, 64
    q = torch.randn(t, heads, d, generator=g)
    k = torch.randn(t, kv_heads, d, generator=g) * 5
    v = torch.randn(t, kv_heads, d, generator=g)
    cache = (torch.randn(kv_cache_shape(nxt, 16, kv_heads, d), generator=g) * 3).to(FP8)
    ref_cache, ours_cache = cache.clone(), cache.clone()
    backends = []
    for cls in (TorchAttention, CpuPagedAttention):
        b = cls(heads, kv_heads, d, d**-0.5, window, soft_cap)
        b.k_scale, b.v_scale = k_scale, v_scale
        backends.append(b)
    want = backends[0].forward(q, k, v, ref_cache, meta)
    got = backends[1].forward(q, k, v, ours_cache, meta)
    assert torch.equal(ours_cache.view(torch.uint8), ref_cache.view(torch.uint8))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * v_scale)


def test_scales_divide_on_the_way_in_and_multiply_on_the_way_out():
    """k_scale 0.01: k / 0.01 saturates at 448 (4.48 after scaling back), not at NaN; a cache
    written with scale s reads back within e4m3's rounding of the values written."""
    from aiolm.attention.torch_backend import from_cache, to_cache

    x = torch.tensor([0.001, 0.3, -2.0, 4.0, 100.0])
    stored = to_cache(x, FP8, 0.01)
    back = from_cache(stored, torch.float32, 0.01)
    assert torch.isfinite(back).all()
    assert abs(back[-1].item() - 4.48) < 1e-6
    torch.testing.assert_close(back[:4], x[:4], rtol=2**-4, atol=0)
