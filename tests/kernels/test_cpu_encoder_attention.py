"""aiolm::encoder_attention (an encoder step's bidirectional attention over a flat batch)
against float64 SDPA per request, and the CPU backend's forward_encoder that calls it."""

from __future__ import annotations

import itertools

import isa_builds
import pytest
import torch
import torch.nn.functional as F

from aiolm.attention.cpu_backend import CpuPagedAttention
from aiolm.attention.metadata import AttentionMetadata
from aiolm.attention.torch_backend import TorchAttention
from aiolm.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ compiler for the CPU kernels")


def _qkv(lens: list[int], heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    """q, k, v as views of one fused projection's rows, as the QKV layer hands them over."""
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    qkv = (torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g) * 2).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return (
        q.reshape(t, heads, head_dim),
        k.reshape(t, kv_heads, head_dim),
        v.reshape(t, kv_heads, head_dim),
    )


def _reference(q, k, v, lens: list[int], scale: float) -> torch.Tensor:
    """Each request alone through SDPA in float64, no mask."""
    group = q.shape[1] // k.shape[1]
    out, s0 = [], 0
    for n in lens:
        qh, kh, vh = (t[s0 : s0 + n].double().transpose(0, 1) for t in (q, k, v))
        kh, vh = kh.repeat_interleave(group, 0), vh.repeat_interleave(group, 0)
        out.append(F.scaled_dot_product_attention(qh, kh, vh, scale=scale).transpose(0, 1))
        s0 += n
    return torch.cat(out)


# lengths: one token, a part vector of keys (17), whole vectors, the long-sequence tiles
# (300 > 256) and an empty request; heads: plain, grouped; head_dim: whole vectors (32, 64),
# a part vector (40, 72), more than one block of values (128)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(12, 12, 32), (8, 2, 40), (4, 4, 64), (6, 3, 72), (2, 1, 128)])
def test_matches_float64_sdpa_per_request(dtype, heads, kv_heads, head_dim):
    lens = [1, 17, 48, 0, 300, 5]
    q, k, v = _qkv(lens, heads, kv_heads, head_dim, dtype, seed=head_dim + heads)
    out = torch.empty(q.shape, dtype=dtype)
    qsl = torch.tensor([0, *itertools.accumulate(lens)])
    torch.ops.aiolm.encoder_attention(out, q, k, v, qsl, head_dim**-0.5)
    want = _reference(q, k, v, lens, head_dim**-0.5)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), want, rtol=3e-5, atol=3e-5)
    else:  # float32 arithmetic, rounded once to bfloat16 at the end
        torch.testing.assert_close(out, want.to(dtype), rtol=8e-3, atol=8e-3)


def test_the_backend_runs_it_and_agrees_with_the_torch_path():
    """forward_encoder on the CPU backend (the kernel) and on the torch backend (SDPA a
    request) give the same attention, in float32 and from bfloat16 inputs."""
    lens = [7, 64, 3]
    meta = AttentionMetadata.build(lens, lens, [[0] * -(-n // 16) for n in lens], 16, "cpu")
    ours, ref = CpuPagedAttention(8, 4, 32, 32**-0.5), TorchAttention(8, 4, 32, 32**-0.5)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = _qkv(lens, 8, 4, 32, dtype, seed=3)
        got = ours.forward_encoder(q, k, v, meta)
        assert got.shape == (sum(lens), 8 * 32) and got.dtype == dtype
        want = ref.forward_encoder(q.float(), k.float(), v.float(), meta)
        tol = 1e-5 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_rejects_what_it_cannot_read():
    q, k, v = _qkv([4], 4, 2, 16, torch.float32, seed=1)
    qsl = torch.tensor([0, 4])
    out = torch.empty(q.shape)
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.aiolm.encoder_attention(out, q, k.bfloat16(), v, qsl, 0.25)
    with pytest.raises(RuntimeError, match="run from 0 to 4"):
        torch.ops.aiolm.encoder_attention(out, q, k, v, torch.tensor([0, 3]), 0.25)
    with pytest.raises(RuntimeError, match="must not decrease"):
        torch.ops.aiolm.encoder_attention(out, q, k, v, torch.tensor([0, 5, 4]), 0.25)
    with pytest.raises(RuntimeError, match="3 query heads over 2 kv heads"):
        torch.ops.aiolm.encoder_attention(torch.empty(4, 3, 16), q[:, :3], k, v, qsl, 0.25)


@pytest.mark.slow
@pytest.mark.parametrize("isa", list(isa_builds.ISA_BUILDS))
def test_other_isa_builds_match_the_references(isa, isa_runs):
    """The AVX2 and scalar builds of the kernel (its exp and vector arithmetic)."""
    isa_builds.check_build_flags(isa)
    isa_runs.check("encoder_attention", isa)  # isa_builds.SUITES["encoder_attention"]
