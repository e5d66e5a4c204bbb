"""The C++ paged attention kernel against the torch reference it replaces."""

from __future__ import annotations

import random

import pytest
import torch

from aiolm.kernels import cpu as cpu_kernels
from aiolm.attention.metadata import AttentionMetadata
from aiolm.attention.torch_backend import TorchAttention, kv_cache_shape, write_kv

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ compiler for the CPU kernels")


def _batch(rng: random.Random, shapes: list[tuple[int, int]], block_size: int, num_blocks: int):
    """Block ids drawn without replacement and shuffled, so pages are scattered."""
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    blocks = []
    for _, seq in shapes:
        n = (seq + block_size - 1) // block_size
        blocks.append([free.pop() for _ in range(n)])
    return AttentionMetadata.build([q for q, _ in shapes], [s for _, s in shapes], blocks, block_size)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),   # SmolLM2's shape (prefill tiles take the transposed-K kernel)
    (8, 2, 128, 16),  # head_dim 128 in tiles
    (10, 2, 64, 32),  # AVX-512 decode rows: 5 query heads per kv head (3 + 2), two 16-key halves a page
    (4, 4, 64, 8),    # AVX-512 decode rows: one query head per kv head, half-empty score vectors
    (4, 4, 32, 8),    # no GQA
    (8, 1, 16, 4),    # MQA, tiny pages
    (6, 2, 12, 16),   # head_dim not a multiple of 8 takes the scalar path
])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_matches_torch_reference_on_mixed_batches(heads, kv_heads, head_dim, block_size, cache_dtype):
    """float16: the cache of CPU bfloat16 matmuls; both read the same rounded values."""
    rng = random.Random(heads * 100 + head_dim)
    torch.manual_seed(heads)
    # decode rows, a whole prompt, a chunk after cached context, a 1-token prompt, a long decode
    shapes = [(1, 37), (23, 23), (20, 61), (1, 1), (1, 130), (40, 40), (3, 17)]
    num_blocks = 200
    meta = _batch(rng, shapes, block_size, num_blocks)
    t = meta.num_tokens
    ref = TorchAttention(heads, kv_heads, head_dim, head_dim ** -0.5)
    cache = torch.randn(kv_cache_shape(num_blocks, block_size, kv_heads, head_dim)).to(cache_dtype)
    cache2 = cache.clone()
    q = torch.randn(t, heads, head_dim)
    k = torch.randn(t, kv_heads, head_dim)
    v = torch.randn(t, kv_heads, head_dim)
    want = ref.forward(q, k, v, cache, meta)
    # the kernel reads the cache after the new tokens are written, as the backend does
    write_kv(cache2, k, v, meta.slot_mapping)
    assert torch.equal(cache, cache2)
    out = torch.empty_like(q)
    torch.ops.aiolm.paged_attention(out, q, cache2[0], cache2[1], meta.block_table,
                                    meta.query_start_loc, meta.seq_lens, head_dim ** -0.5)
    torch.testing.assert_close(out.view(t, -1), want, rtol=1e-5, atol=2e-5)


def test_large_scores_stay_finite():
    """Online softmax must rescale, not overflow, when later pages hold larger scores."""
    heads, kv_heads, d, bs = 2, 1, 8, 4
    meta = AttentionMetadata.build([1], [12], [[3, 1, 2]], bs)
    cache = torch.zeros(kv_cache_shape(4, bs, kv_heads, d))
    q = torch.full((1, heads, d), 10.0)
    k = torch.arange(12, dtype=torch.float32).view(12, 1, 1).expand(12, kv_heads, d).contiguous()
    v = torch.randn(12, kv_heads, d)
    write_kv(cache, k, v, AttentionMetadata.build([12], [12], [[3, 1, 2]], bs).slot_mapping)
    out = torch.empty_like(q)
    torch.ops.aiolm.paged_attention(out, q, cache[0], cache[1], meta.block_table,
                                    meta.query_start_loc, meta.seq_lens, 1.0)
    assert torch.isfinite(out).all()
    # scores 80*j: the last key dominates completely
    torch.testing.assert_close(out[0, 0], v[11, 0])


def test_rejects_bad_inputs_with_a_clear_error():
    cache = torch.zeros(kv_cache_shape(4, 4, 1, 8))
    meta = AttentionMetadata.build([2], [8], [[1, 2]], 4)
    meta.seq_lens = torch.tensor([9])  # 9 tokens need 3 blocks; the table has 2
    q = torch.zeros(2, 2, 8)
    with pytest.raises(RuntimeError, match="block table too narrow"):
        torch.ops.aiolm.paged_attention(torch.empty_like(q), q, cache[0], cache[1], meta.block_table,
                                        meta.query_start_loc, meta.seq_lens, 1.0)
    with pytest.raises(RuntimeError, match="float32"):
        qh = q.half()
        torch.ops.aiolm.paged_attention(torch.empty_like(qh), qh, cache[0], cache[1], meta.block_table,
                                        meta.query_start_loc, meta.seq_lens, 1.0)


def test_build_is_cached_and_atomic():
    """A second load finds the library by its key instead of compiling again."""
    path = cpu_kernels.library_path()
    assert path.exists() and path.stat().st_size > 0
    assert path.name.startswith("aiolm_cpu_") and path.suffix == ".so"
    assert not list(path.parent.glob("tmp*.so"))
