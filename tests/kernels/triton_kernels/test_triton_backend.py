"""TritonAttention, the backend, against the torch reference backend on the same metadata."""

from __future__ import annotations

import pytest
import torch
from triton_cases import PagedBatch, on_device, reference_attention

from aiolm.attention.metadata import AttentionMetadata
from aiolm.attention.torch_backend import TorchAttention, kv_cache_shape


def _case(cache_dtype, block_size=16, seed=0):
    """A fresh prefill, a prefix hit (two cached pages plus 3 tokens) and two decode rows;
    int64 metadata as AttentionMetadata.build makes it."""
    g = torch.Generator().manual_seed(seed)
    qlens, slens = [19, 3, 1, 1], [19, 2 * block_size + 3, 40, 16]
    blocks, nxt = [], 1
    for s in slens:
        n = -(-s // block_size)
        blocks.append(list(range(nxt + n - 1, nxt - 1, -1)))  # pages in reverse order
        nxt += n
    meta = AttentionMetadata.build(qlens, slens, blocks, block_size)
    heads, kv_heads, d = 6, 2, 64
    t = sum(qlens)
    q = torch.randn(t, heads, d, generator=g)
    k = torch.randn(t, kv_heads, d, generator=g)
    v = torch.randn(t, kv_heads, d, generator=g)
    cache = torch.randn(kv_cache_shape(nxt, block_size, kv_heads, d), generator=g).to(cache_dtype)
    return q, k, v, cache, meta, (heads, kv_heads, d)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("block_size", [16, 32])
def test_backend_matches_torch_backend(cache_dtype, block_size, device):
    """float8 e4m3 (--kv-cache-dtype fp8) with per-layer scales other than 1: both backends
    write the same bytes and read them back scaled."""
    from aiolm.attention.triton_backend import TritonAttention

    q, k, v, cache, meta, (h, hk, d) = _case(cache_dtype, block_size)
    want_cache = cache.clone()
    ref, ours = TorchAttention(h, hk, d, d**-0.5), TritonAttention(h, hk, d, d**-0.5)
    if cache_dtype == torch.float8_e4m3fn:
        for backend in (ref, ours):
            backend.k_scale, backend.v_scale = 0.5, 2.0
    want = ref.forward(q, k, v, want_cache, meta)

    dev_meta = on_device(meta, device)
    got_cache = cache.to(device)
    got = ours.forward(q.to(device), k.to(device), v.to(device), got_cache, dev_meta)
    assert got.shape == want.shape == (meta.num_tokens, h * d)
    # the same K/V in the same slots
    assert torch.equal(got_cache.cpu().view(torch.uint8), want_cache.view(torch.uint8))
    tol = 2e-5 if cache_dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.cpu(), want, atol=tol, rtol=tol)


def test_backend_window_and_soft_cap(device):
    from aiolm.attention.triton_backend import TritonAttention

    q, k, v, cache, meta, (h, hk, d) = _case(torch.float32)
    backend = TritonAttention(h, hk, d, 0.1, sliding_window=5, soft_cap=3.0)
    got_cache = cache.to(device)
    got = backend.forward(q.to(device), k.to(device), v.to(device), got_cache, on_device(meta, device))
    written = got_cache.cpu()
    pages = [row[: -(-s // meta.block_size)].tolist() for row, s in zip(meta.block_table, meta.seq_lens_cpu)]
    b = PagedBatch(
        q,
        written,
        meta.block_table.int(),
        meta.query_start_loc.int(),
        meta.seq_lens.int(),
        meta.query_lens_cpu,
        meta.seq_lens_cpu,
        pages,
    )
    want = reference_attention(b, 0.1, window=5, soft_cap=3.0).view(meta.num_tokens, h * d)
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(num_heads=6, num_kv_heads=4), "num_kv_heads"),
        (dict(sliding_window=0), "sliding_window"),
        (dict(soft_cap=-1.0), "soft_cap"),
    ],
)
def test_backend_rejects_bad_options(kwargs, field):
    from aiolm.attention.triton_backend import TritonAttention

    args = dict(num_heads=6, num_kv_heads=2, head_dim=64, scale=0.125) | kwargs
    with pytest.raises(ValueError, match=field):
        TritonAttention(**args)
