"""The C++ paged attention kernel against the torch reference it replaces."""

from __future__ import annotations

import random

import isa_builds
import pytest
import torch

from aiolm.attention.metadata import AttentionMetadata
from aiolm.attention.torch_backend import TorchAttention, kv_cache_shape, write_kv
from aiolm.kernels import cpu as cpu_kernels

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


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [
        (9, 3, 64, 16),  # SmolLM2's shape (prefill tiles take the transposed-K kernel)
        (8, 2, 128, 16),  # head_dim 128 in tiles
        (10, 2, 64, 32),  # AVX-512 decode rows: 5 query heads per kv head (3 + 2), two 16-key halves a page
        (4, 4, 64, 8),  # AVX-512 decode rows: one query head per kv head, half-empty score vectors
        (4, 4, 32, 8),  # no GQA
        (8, 1, 16, 4),  # MQA, tiny pages
        (6, 2, 12, 16),  # head_dim not a multiple of 8 takes the scalar path
    ],
)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.float8_e4m3fn])
def test_matches_torch_reference_on_mixed_batches(heads, kv_heads, head_dim, block_size, cache_dtype):
    """float16: the cache of CPU bfloat16 matmuls; float8 e4m3: --kv-cache-dtype fp8; both
    read the same rounded values."""
    rng = random.Random(heads * 100 + head_dim)
    torch.manual_seed(heads)
    # decode rows, a whole prompt, a chunk after cached context, a 1-token prompt, a long decode
    shapes = [(1, 37), (23, 23), (20, 61), (1, 1), (1, 130), (40, 40), (3, 17)]
    num_blocks = 200
    meta = _batch(rng, shapes, block_size, num_blocks)
    t = meta.num_tokens
    ref = TorchAttention(heads, kv_heads, head_dim, head_dim**-0.5)
    cache = torch.randn(kv_cache_shape(num_blocks, block_size, kv_heads, head_dim)).to(cache_dtype)
    cache2 = cache.clone()
    q = torch.randn(t, heads, head_dim)
    k = torch.randn(t, kv_heads, head_dim)
    v = torch.randn(t, kv_heads, head_dim)
    want = ref.forward(q, k, v, cache, meta)
    # the kernel reads the cache after the new tokens are written, as the backend does
    write_kv(cache2, k, v, meta.slot_mapping)
    assert torch.equal(cache.view(torch.uint8), cache2.view(torch.uint8))
    out = torch.empty_like(q)
    torch.ops.aiolm.paged_attention(
        out, q, cache2[0], cache2[1], meta.block_table, meta.query_start_loc, meta.seq_lens, head_dim**-0.5
    )
    torch.testing.assert_close(out.view(t, -1), want, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 8, 128), (6, 2, 12)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_a_lone_decode_row_split_over_threads_gives_the_same_bits(heads, kv_heads, head_dim, cache_dtype):
    """With fewer rows than threads, a row's kv heads are split over the threads (a
    one-sequence decode step would otherwise run on one): each head's arithmetic is the same,
    so the bits equal a one-thread run's and the result the reference's."""
    rng = random.Random(kv_heads)
    torch.manual_seed(head_dim)
    num_blocks, bs = 80, 16
    meta = _batch(rng, [(1, 300)], bs, num_blocks)
    cache = torch.randn(kv_cache_shape(num_blocks, bs, kv_heads, head_dim)).to(cache_dtype)
    q = torch.randn(1, heads, head_dim)
    k, v = torch.randn(1, kv_heads, head_dim), torch.randn(1, kv_heads, head_dim)
    want = TorchAttention(heads, kv_heads, head_dim, head_dim**-0.5).forward(q, k, v, cache.clone(), meta)
    write_kv(cache, k, v, meta.slot_mapping)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out = torch.empty_like(q)
            torch.ops.aiolm.paged_attention(
                out, q, cache[0], cache[1], meta.block_table, meta.query_start_loc, meta.seq_lens, head_dim**-0.5
            )
            outs.append(out)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    torch.testing.assert_close(outs[0].view(1, -1), want, rtol=1e-5, atol=2e-5)


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
    torch.ops.aiolm.paged_attention(
        out, q, cache[0], cache[1], meta.block_table, meta.query_start_loc, meta.seq_lens, 1.0
    )
    assert torch.isfinite(out).all()
    # scores 80*j: the last key dominates completely
    torch.testing.assert_close(out[0, 0], v[11, 0])


def test_rejects_bad_inputs_with_a_clear_error():
    cache = torch.zeros(kv_cache_shape(4, 4, 1, 8))
    meta = AttentionMetadata.build([2], [8], [[1, 2]], 4)
    meta.seq_lens = torch.tensor([9])  # 9 tokens need 3 blocks; the table has 2
    q = torch.zeros(2, 2, 8)
    with pytest.raises(RuntimeError, match="block table too narrow"):
        torch.ops.aiolm.paged_attention(
            torch.empty_like(q), q, cache[0], cache[1], meta.block_table, meta.query_start_loc, meta.seq_lens, 1.0
        )
    with pytest.raises(RuntimeError, match="float32"):
        qh = q.half()
        torch.ops.aiolm.paged_attention(
            torch.empty_like(qh), qh, cache[0], cache[1], meta.block_table, meta.query_start_loc, meta.seq_lens, 1.0
        )


def test_build_is_cached_and_atomic():
    """A second load finds the library by its key instead of compiling again."""
    path = cpu_kernels.library_path()
    assert path.exists() and path.stat().st_size > 0
    assert path.name.startswith("aiolm_cpu_") and path.suffix == ".so"
    assert not list(path.parent.glob("tmp*.so"))


# ----------------------------------------------------------------------------- sliding windows, soft-caps


def _dense_reference(q, cache, meta, scale, window, softcap):
    """Query by query from the gathered keys, written independently of both backends:
    a query at position p sees keys j with p - window < j <= p (Hugging Face's mask)."""
    heads, kv_heads = q.shape[1], cache.shape[3]
    bs = meta.block_size
    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    for r, (n, seq) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        slots = [int(meta.block_table[r, j // bs]) * bs + j % bs for j in range(seq)]
        k = cache[0].reshape(-1, kv_heads, q.shape[2])[slots].float()
        v = cache[1].reshape(-1, kv_heads, q.shape[2])[slots].float()
        for i in range(n):
            p = seq - n + i
            lo = 0 if window is None else max(0, p - window + 1)
            for h in range(heads):
                kh = h // (heads // kv_heads)
                s = (k[lo : p + 1, kh] @ q[starts[r] + i, h]) * scale
                if softcap is not None:
                    s = softcap * torch.tanh(s / softcap)
                out[starts[r] + i, h] = torch.softmax(s, 0) @ v[lo : p + 1, kh]
    return out


# (query_len, seq_len): decode rows deep past the window, a whole prompt longer than the
# window, prefill chunks after cached context (crossing page boundaries at odd offsets),
# a prompt shorter than the window, and 1-token rows at the very start
WINDOW_SHAPES = [(1, 37), (1, 130), (40, 40), (23, 61), (17, 100), (5, 12), (1, 1), (33, 33), (1, 17)]


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [
        (9, 3, 64, 16),  # prefill tiles (transposed keys), AVX-512 decode rows
        (8, 2, 128, 16),  # head_dim 128 in tiles and decode rows
        (10, 2, 64, 32),  # pages of 32: rows take attend_row_z / attend_row, not tiles
        (4, 4, 32, 8),  # head_dim 32: the generic row path for everything
        (6, 2, 12, 4),  # head_dim not a multiple of 8: the scalar path
    ],
)
@pytest.mark.parametrize("window", [1, 5, 16, 19, 64])
@pytest.mark.parametrize("softcap", [None, 7.5])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_sliding_window_and_softcap_match_references(
    heads, kv_heads, head_dim, block_size, window, softcap, cache_dtype
):
    rng = random.Random(heads * 1000 + window)
    torch.manual_seed(window + head_dim)
    meta = _batch(rng, WINDOW_SHAPES, block_size, 300)
    t = meta.num_tokens
    scale = head_dim**-0.5
    cache = torch.randn(kv_cache_shape(300, block_size, kv_heads, head_dim)).to(cache_dtype)
    q = 2 * torch.randn(t, heads, head_dim)  # scores of several units: the cap bends them
    k = torch.randn(t, kv_heads, head_dim)
    v = torch.randn(t, kv_heads, head_dim)
    ref = TorchAttention(heads, kv_heads, head_dim, scale, sliding_window=window, soft_cap=softcap)
    want = ref.forward(q, k, v, cache, meta)
    dense = _dense_reference(q, cache, meta, scale, window, softcap)
    torch.testing.assert_close(want, dense.view(t, -1), rtol=1e-5, atol=2e-5)
    out = torch.empty_like(q)
    torch.ops.aiolm.paged_attention(
        out, q, cache[0], cache[1], meta.block_table, meta.query_start_loc, meta.seq_lens, scale, window, softcap or 0.0
    )
    torch.testing.assert_close(out.view(t, -1), want, rtol=1e-5, atol=2e-5)
    if window < 40:  # the window changed the answer for the rows past it: the test can see it
        full = TorchAttention(heads, kv_heads, head_dim, scale, soft_cap=softcap).forward(q, k, v, cache, meta)
        assert (full - want).abs().max() > 1e-2


def test_window_wider_than_every_sequence_changes_nothing():
    """window >= seq_len is full causal attention, bit for bit with no window at all."""
    rng = random.Random(3)
    meta = _batch(rng, WINDOW_SHAPES, 16, 300)
    cache = torch.randn(kv_cache_shape(300, 16, 3, 64))
    q = torch.randn(meta.num_tokens, 9, 64)
    outs = []
    for window in (0, 131, 4096):
        out = torch.empty_like(q)
        torch.ops.aiolm.paged_attention(
            out, q, cache[0], cache[1], meta.block_table, meta.query_start_loc, meta.seq_lens, 0.125, window
        )
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_window_rows_never_read_pages_before_their_window():
    """Pages wholly before every row's window are not read: NaNs there change nothing."""
    bs, window = 16, 20
    meta = AttentionMetadata.build([1, 24], [100, 100], [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14]], bs)
    cache = torch.randn(kv_cache_shape(16, bs, 2, 64))
    q = torch.randn(25, 4, 64)
    out = torch.empty_like(q)
    args = (meta.block_table, meta.query_start_loc, meta.seq_lens, 0.125, window)
    torch.ops.aiolm.paged_attention(out, q, cache[0], cache[1], *args)
    poisoned = cache.clone()
    # decode row at 99 sees 80..99 (pages 5-6); prefill rows 76..99 see 57.. (pages 3-6)
    poisoned[:, [1, 2, 3, 4, 8, 9, 10]] = float("nan")
    again = torch.empty_like(q)
    torch.ops.aiolm.paged_attention(again, q, poisoned[0], poisoned[1], *args)
    assert torch.equal(out, again)


def test_rejects_negative_window_and_softcap():
    cache = torch.zeros(kv_cache_shape(4, 4, 1, 8))
    meta = AttentionMetadata.build([2], [8], [[1, 2]], 4)
    q = torch.zeros(2, 2, 8)
    args = (torch.empty_like(q), q, cache[0], cache[1], meta.block_table, meta.query_start_loc, meta.seq_lens, 1.0)
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        torch.ops.aiolm.paged_attention(*args, -1)
    with pytest.raises(RuntimeError, match="softcap must be >= 0"):
        torch.ops.aiolm.paged_attention(*args, 0, -2.0)


@pytest.mark.slow
@pytest.mark.parametrize("isa", list(isa_builds.ISA_BUILDS))
def test_other_isa_builds_match_the_references(isa, isa_runs):
    """isa_builds.SUITES["paged_attention"]: its tests, on the AVX2 and scalar builds."""
    isa_builds.check_build_flags(isa)
    isa_runs.check("paged_attention", isa)
