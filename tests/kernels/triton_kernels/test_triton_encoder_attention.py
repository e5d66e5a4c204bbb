"""The varlen bidirectional (encoder) kernel against a per-request float32 softmax reference.

Batches mix requests of one token, of fewer keys than one key block, of exactly one block
and of several blocks with a ragged tail, so a key read across a request's edge (another
request's tokens) or a masked tail counted in the softmax shows up in the output.
"""

from __future__ import annotations

import pytest
import torch
from triton_cases import TOLERANCE

LENGTHS = [1, 5, 16, 37, 1, 20]


def _reference(q, k, v, lengths, scale):
    """Each request's queries over all its keys, in float32, K/V heads repeated for GQA."""
    q, k, v = q.float().cpu(), k.float().cpu(), v.float().cpu()
    group = q.shape[1] // k.shape[1]
    out, s0 = torch.empty_like(q), 0
    for n in lengths:
        qs = q[s0 : s0 + n].transpose(0, 1)
        ks = k[s0 : s0 + n].repeat_interleave(group, 1).transpose(0, 1)
        vs = v[s0 : s0 + n].repeat_interleave(group, 1).transpose(0, 1)
        p = torch.softmax(qs @ ks.transpose(1, 2) * scale, dim=-1)
        out[s0 : s0 + n] = (p @ vs).transpose(0, 1)
        s0 += n
    return out


def _check(lengths, heads, kv_heads, head_dim, dtype, device, fused=False, **kw):
    from aiolm.kernels.triton.encoder_attention import encoder_attention

    g = torch.Generator().manual_seed(heads * 100 + head_dim + len(lengths))
    t = sum(lengths)
    if fused:  # q, k and v as views of one [T, (H + 2 Hk) * D] projection, as a model makes them
        qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype).to(device)
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q = q.view(t, heads, head_dim)
        k, v = k.view(t, kv_heads, head_dim), v.view(t, kv_heads, head_dim)
    else:
        q = torch.randn(t, heads, head_dim, generator=g).to(dtype).to(device)
        k = torch.randn(t, kv_heads, head_dim, generator=g).to(dtype).to(device)
        v = torch.randn(t, kv_heads, head_dim, generator=g).to(dtype).to(device)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=device)
    encoder_attention(out, q, k, v, cu, max(lengths), scale, **kw)
    want = _reference(q, k, v, lengths, scale)
    torch.testing.assert_close(out.float().cpu(), want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])  # GQA 1, 3, 8
def test_mixed_lengths_dtypes_and_gqa(dtype, heads, kv_heads, device):
    _check(LENGTHS, heads, kv_heads, 16, dtype, device, block_n=16)


@pytest.mark.parametrize("head_dim", [8, 24, 64])
def test_head_sizes_padded_and_not(head_dim, device):
    """8 and 24 pad the head to a power of two of at least 16 columns."""
    _check([3, 17], 2, 1, head_dim, torch.float32, device, block_n=16)


def test_views_of_one_fused_projection(device):
    _check(LENGTHS, 4, 2, 16, torch.float32, device, fused=True, block_n=16)


def test_one_request_of_one_token_sees_only_itself(device):
    _check([1], 4, 4, 16, torch.float16, device)


def test_query_tiles_split_a_long_request(device):
    """16 rows a tile with a group of 2: 8 query tokens each, so 37 tokens take 5 tiles."""
    _check([37, 9], 4, 2, 16, torch.float32, device, block_m=16, block_n=32)


def test_backend_forward_encoder_equals_the_torch_backend(device):
    """TritonAttention.forward_encoder over the runner's int64 metadata, as a model calls it."""
    from aiolm.attention.metadata import AttentionMetadata
    from aiolm.attention.torch_backend import TorchAttention
    from aiolm.attention.triton_backend import TritonAttention

    g = torch.Generator().manual_seed(7)
    lengths, heads, kv_heads, d = [4, 1, 19], 6, 2, 16
    q = torch.randn(sum(lengths), heads, d, generator=g)
    k = torch.randn(sum(lengths), kv_heads, d, generator=g)
    v = torch.randn(sum(lengths), kv_heads, d, generator=g)
    meta = AttentionMetadata.build(lengths, lengths, [[0, 0]] * len(lengths), 16)
    want = TorchAttention(heads, kv_heads, d, 0.3).forward_encoder(q, k, v, meta)
    meta_dev = AttentionMetadata.build(lengths, lengths, [[0, 0]] * len(lengths), 16, device=device)
    got = TritonAttention(heads, kv_heads, d, 0.3).forward_encoder(q.to(device), k.to(device), v.to(device), meta_dev)
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)


def test_bert_through_the_triton_backend_matches_the_torch_backend(tmp_path, device):
    """The whole tiny encoder with attention="triton" (the interpreter on a CPU)."""
    from aiolm.attention.metadata import AttentionMetadata
    from aiolm.checkpoint.source import resolve_model
    from aiolm.model.registry import build_model
    from pooling_models import bert_embedder

    source = resolve_model(bert_embedder(tmp_path / "bert"))
    tok = source.load_tokenizer()
    ids = [tok(t)["input_ids"] for t in ("the cat sat on the mat", "paris", "what is the capital of france")]
    lens = [len(x) for x in ids]
    flat = torch.tensor([t for x in ids for t in x])
    pos = torch.tensor([p for n in lens for p in range(n)])
    outs = []
    for attention, where in (("torch", "cpu"), ("triton", device)):
        model = build_model(source, torch.float32, device=where, attention=attention)
        meta = AttentionMetadata.build(lens, lens, [[0]] * len(lens), 16, device=where)
        outs.append(model(flat.to(where), pos.to(where), [], meta).cpu())
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=2e-5)
