"""CudaGraphRunner over a real attention layer built from the Triton kernels.

On a CPU the runner takes its padded eager path (the same buffers a graph would read);
on a GPU it captures graphs first. Either way a padded decode step must give the rows
an unpadded eager step gives and leave the KV cache exactly as that step leaves it.
"""

from __future__ import annotations

import pytest
import torch
from triton_cases import on_device

from aiolm.attention.metadata import AttentionMetadata

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 64, 2, 1, 64, 16
MAX_LEN = 256  # 16 pages: the captured worst case takes the split-KV path


class TinyAttentionLayer:
    """Embedding, q/k/v projections, RoPE, paged attention and an output projection."""

    def __init__(self, device: str) -> None:
        from aiolm.attention.triton_backend import TritonAttention
        from aiolm.kernels.ops import TorchOps
        from aiolm.model.layers.rotary import RotaryEmbedding

        g = torch.Generator().manual_seed(0)
        w = lambda *s: (torch.randn(*s, generator=g) / s[0] ** 0.5).to(device)  # noqa: E731
        self.emb, self.wq, self.wk, self.wv, self.wo = (
            w(100, HIDDEN),
            w(HIDDEN, HEADS * HEAD_DIM),
            w(HIDDEN, KV_HEADS * HEAD_DIM),
            w(HIDDEN, KV_HEADS * HEAD_DIM),
            w(HEADS * HEAD_DIM, HIDDEN),
        )
        rope = RotaryEmbedding(HEAD_DIM, MAX_LEN, 10000.0, None, TorchOps())  # its cos/sin tables only
        self.cos, self.sin = rope.cos.to(device), rope.sin.to(device)
        self.attn = TritonAttention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
        self.cache = torch.zeros(2, 40, BLOCK, KV_HEADS, HEAD_DIM, device=device)

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        from aiolm.kernels.triton.rope import rotary_

        x = self.emb[ids]
        t = x.shape[0]
        q = (x @ self.wq).view(t, HEADS, HEAD_DIM)
        k = (x @ self.wk).view(t, KV_HEADS, HEAD_DIM)
        v = (x @ self.wv).view(t, KV_HEADS, HEAD_DIM)
        rotary_(q, k, pos, self.cos, self.sin)
        return self.attn.forward(q, k, v, self.cache, meta) @ self.wo


def _prefilled(device: str, lens: list[int]):
    layer = TinyAttentionLayer(device)
    blocks, nxt = [], 1
    for s in lens:
        n = -(-(s + 8) // BLOCK)  # room for the decode steps
        blocks.append(list(range(nxt, nxt + n)))
        nxt += n
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (sum(lens),), generator=g)
    pos = torch.cat([torch.arange(s) for s in lens])
    layer(ids.to(device), pos.to(device), on_device(AttentionMetadata.build(lens, lens, blocks, BLOCK), device))
    return layer, blocks


def _decode_step(lens: list[int], blocks: list[list[int]], device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 100, (len(lens),), generator=g)
    seq = [s + 1 for s in lens]
    meta = AttentionMetadata.build([1] * len(lens), seq, [b[: -(-s // BLOCK)] for b, s in zip(blocks, seq)], BLOCK)
    return ids.to(device), torch.tensor(lens).to(device), on_device(meta, device)


@pytest.mark.parametrize("lens", [[5, 17, 31], [40, 1, 16, 15, 2]])  # 3 rows -> graph 4, 5 rows -> graph 8
def test_padded_step_matches_unpadded(lens, device):
    from aiolm.worker.cuda_graph import CudaGraphRunner, capture_sizes, plan_step

    layer, blocks = _prefilled(device, lens)
    sizes = capture_sizes(max_num_seqs=8)
    runner = CudaGraphRunner(
        layer, sizes, max_blocks_per_seq=MAX_LEN // BLOCK, block_size=BLOCK, max_model_len=MAX_LEN, device=device
    )
    if device == "cuda":
        before = layer.cache.clone()
        runner.capture()
        assert torch.equal(layer.cache, before), "capture wrote into the KV cache"
    for step in range(2):
        ids, pos, meta = _decode_step(lens, blocks, device, seed=10 + step)
        plan = plan_step(meta.num_reqs, meta.num_tokens, sizes)
        assert plan.size == (4 if len(lens) == 3 else 8)
        start = layer.cache.clone()
        want = layer(ids, pos, meta)
        want_cache = layer.cache.clone()
        layer.cache.copy_(start)
        got = runner.run(plan.size, ids, pos, meta)
        assert got.shape == want.shape  # only real rows come back: nothing to sample from padding
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        # a matmul over 4 or 8 rows may round differently from one over 3: the written K/V
        # are close; every other slot must be untouched
        real = torch.zeros(layer.cache[0].shape[:2], dtype=torch.bool, device=device).view(-1)
        real[meta.slot_mapping] = True
        real = real.view(layer.cache.shape[1:3])
        torch.testing.assert_close(layer.cache[:, real], want_cache[:, real], atol=1e-5, rtol=1e-5)
        assert torch.equal(layer.cache[:, ~real], start[:, ~real]), "a padding row wrote into the KV cache"
        lens = [s + 1 for s in lens]


def test_capture_needs_cuda():
    from aiolm.worker.cuda_graph import CudaGraphRunner

    runner = CudaGraphRunner(lambda *a: torch.zeros(1), [1, 2], 4, 16, 64, "cpu")
    with pytest.raises(RuntimeError, match="CUDA"):
        runner.capture()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_capture_every_size_and_replay_each_batch(device):
    from aiolm.worker.cuda_graph import CudaGraphRunner, capture_sizes, plan_step

    if device != "cuda":
        pytest.skip("TRITON_INTERPRET=1 was forced: the kernels run on the CPU")
    lens = [3, 20, 9, 33, 16, 1, 47, 30]
    layer, blocks = _prefilled(device, lens)
    sizes = capture_sizes(max_num_seqs=8)
    runner = CudaGraphRunner(layer, sizes, MAX_LEN // BLOCK, BLOCK, MAX_LEN, device)
    runner.capture()
    assert sorted(runner.graphs) == sizes
    for n in range(1, 9):
        ids, pos, meta = _decode_step(lens[:n], blocks[:n], device, seed=n)
        start = layer.cache.clone()
        want = layer(ids, pos, meta)
        layer.cache.copy_(start)
        got = runner.run(plan_step(n, n, sizes).size, ids, pos, meta)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        layer.cache.copy_(start)  # every n decodes from the same prefix
