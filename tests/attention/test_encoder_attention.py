"""``forward_encoder`` of the torch and cpu backends against a per-request float32 softmax:
bidirectional within each request, nothing across requests, no cache.

Lengths include one-token requests, and GQA groups of 1, 3 and 8; q, k and v are views of
one fused projection, as an encoder layer hands them over.
"""

from __future__ import annotations

import pytest
import torch

from aiolm.attention.cpu_backend import CpuPagedAttention
from aiolm.attention.metadata import AttentionMetadata
from aiolm.attention.torch_backend import TorchAttention

LENGTHS = [1, 7, 33, 1, 12]
BACKENDS = [TorchAttention, CpuPagedAttention]


def _qkv(lengths, heads, kv_heads, head_dim, dtype, seed=0):
    t = sum(lengths)
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return q.view(t, heads, head_dim), k.view(t, kv_heads, head_dim), v.view(t, kv_heads, head_dim)


def _reference(q, k, v, lengths, scale):
    group = q.shape[1] // k.shape[1]
    q, k, v = q.float(), k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    out, s0 = [], 0
    for n in lengths:
        qs, ks, vs = (x[s0 : s0 + n].transpose(0, 1) for x in (q, k, v))
        p = torch.softmax(qs @ ks.transpose(1, 2) * scale, dim=-1)
        out.append((p @ vs).transpose(0, 1).reshape(n, -1))
        s0 += n
    return torch.cat(out)


def _meta(lengths):
    return AttentionMetadata.build(lengths, lengths, [[0] * -(-n // 16) for n in lengths], 16)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_matches_the_reference(backend, heads, kv_heads):
    d = 16
    q, k, v = _qkv(LENGTHS, heads, kv_heads, d, torch.float32, seed=heads)
    layer = backend(heads, kv_heads, d, d**-0.5)
    got = layer.forward_encoder(q, k, v, _meta(LENGTHS))
    assert got.shape == (sum(LENGTHS), heads * d)
    torch.testing.assert_close(got, _reference(q, k, v, LENGTHS, d**-0.5), atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda c: c.__name__)
def test_bfloat16(backend):
    q, k, v = _qkv(LENGTHS, 6, 2, 32, torch.bfloat16)
    got = backend(6, 2, 32, 32**-0.5).forward_encoder(q, k, v, _meta(LENGTHS))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), _reference(q, k, v, LENGTHS, 32**-0.5), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda c: c.__name__)
def test_requests_do_not_see_each_other(backend):
    """Changing one request's keys and values leaves every other request's output as it was."""
    q, k, v = _qkv(LENGTHS, 4, 2, 16, torch.float32)
    layer, meta = backend(4, 2, 16, 0.25), _meta(LENGTHS)
    before = layer.forward_encoder(q, k, v, meta)
    k2, v2 = k.clone(), v.clone()
    k2[8:41] += 3.0  # the third request (33 tokens from 8)
    v2[8:41] -= 1.0
    after = layer.forward_encoder(q, k2, v2, meta)
    assert torch.equal(after[:8], before[:8]) and torch.equal(after[41:], before[41:])
    assert not torch.allclose(after[8:41], before[8:41])


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda c: c.__name__)
def test_a_window_or_soft_cap_is_refused(backend):
    q, k, v = _qkv([3], 2, 2, 16, torch.float32)
    for kw in ({"sliding_window": 4}, {"soft_cap": 30.0}):
        with pytest.raises(ValueError, match="encoder attention takes no"):
            backend(2, 2, 16, 0.25, **kw).forward_encoder(q, k, v, _meta([3]))
