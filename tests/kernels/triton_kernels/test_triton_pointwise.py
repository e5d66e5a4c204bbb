"""RMSNorm (plain and fused with the residual add), RoPE and gated activations against torch."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from triton_cases import assert_same_rounding

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _rand(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _ref_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """aiolm/model/layers/norm.py's rounding: float32 norm, back to x's dtype, then the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h.to(x.dtype)).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 576, 100])
def test_rms_norm(dtype, n, device):
    from aiolm.kernels.triton.norm import rms_norm

    x, w = _rand(5, n, dtype=dtype), _rand(n, dtype=dtype, seed=1)
    got = rms_norm(x.to(device), w.to(device), 1e-5).cpu()
    torch.testing.assert_close(got, _ref_norm(x, w, 1e-5), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 100])
def test_add_rms_norm_in_place(dtype, n, device):
    from aiolm.kernels.triton.norm import add_rms_norm_

    x, r = _rand(7, n, dtype=dtype), _rand(7, n, dtype=dtype, seed=2)
    w = _rand(n, dtype=torch.float32, seed=3)
    want_res = x + r
    want = _ref_norm(want_res, w, 1e-6)
    xd, rd = x.to(device), r.to(device)
    add_rms_norm_(xd, rd, w.to(device), 1e-6)
    assert_same_rounding(rd.cpu(), want_res)  # the residual stream: one rounded add
    torch.testing.assert_close(xd.cpu(), want, atol=TOL[dtype], rtol=TOL[dtype])


def _cos_sin(max_pos: int, rot: int, half_width: bool):
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    f = torch.outer(torch.arange(max_pos).float(), inv)
    if not half_width:  # the duplicated layout of aiolm/model/layers/rotary.py
        f = torch.cat((f, f), dim=-1)
    return f.cos(), f.sin()


def _ref_rope(
    x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int, neox: bool
) -> torch.Tensor:
    half = rot // 2
    c = cos[pos, :half].unsqueeze(1)
    s = sin[pos, :half].unsqueeze(1)
    xf = x.float()
    r = xf[..., :rot]
    if neox:
        x1, x2 = r[..., :half], r[..., half:]
        rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    else:
        x1, x2 = r[..., 0::2], r[..., 1::2]
        rotated = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    return torch.cat((rotated, xf[..., rot:]), dim=-1).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox", [True, False])
def test_rope_layouts(dtype, neox, device):
    _check_rope(dtype, neox, heads=6, kv_heads=2, head_dim=64, rot=64, half_width=False, device=device)


@pytest.mark.parametrize("neox", [True, False])
def test_rope_partial_rotary_dim_and_half_width_cache(neox, device):
    """GPT-J / NeoX style partial rotation: dims past rotary_dim are left alone."""
    _check_rope(torch.float32, neox, heads=4, kv_heads=4, head_dim=128, rot=32, half_width=True, device=device)


def test_rope_matches_the_model_layer(device):
    """The embedded model's RotaryEmbedding (neox layout, duplicated cos/sin) gives the same q, k."""
    from aiolm.kernels.ops import TorchOps
    from aiolm.kernels.triton.rope import rotary_
    from aiolm.model.layers.rotary import RotaryEmbedding

    emb = RotaryEmbedding(64, 512, 100000.0, None, TorchOps())
    pos = torch.tensor([0, 1, 17, 511, 300])
    q, k = _rand(5, 9, 64, dtype=torch.float32), _rand(5, 3, 64, dtype=torch.float32, seed=4)
    want_q, want_k = TorchOps().rotary(pos, q.clone(), k.clone(), emb.cos, emb.sin)  # the model's reference
    qd, kd = q.to(device), k.to(device)
    rotary_(qd, kd, pos.to(device), emb.cos.to(device), emb.sin.to(device))
    torch.testing.assert_close(qd.cpu(), want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kd.cpu(), want_k, atol=1e-5, rtol=1e-5)


def _check_rope(dtype, neox, heads, kv_heads, head_dim, rot, half_width, device):
    from aiolm.kernels.triton.rope import rotary_

    cos, sin = _cos_sin(64, rot, half_width)
    pos = torch.tensor([0, 5, 63, 31, 32, 1])
    t = pos.numel()
    # q as a strided view of a fused qkv row
    qkv = _rand(t, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, : heads * head_dim].view(t, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
    want_q = _ref_rope(q, pos, cos, sin, rot, neox)
    want_k = _ref_rope(k, pos, cos, sin, rot, neox)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    qkv_d = qkv.to(device)
    qd = qkv_d[:, : heads * head_dim].view(t, heads, head_dim)
    kd = qkv_d[:, heads * head_dim : (heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
    rotary_(qd, kd, pos.to(device), cos.to(device), sin.to(device), is_neox=neox, rotary_dim=rot)
    torch.testing.assert_close(qd.cpu(), want_q, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(kd.cpu(), want_k, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(qkv_d[:, (heads + kv_heads) * head_dim :].cpu(), v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 1536 + 7])  # the second spans two column blocks, the last one partial
@pytest.mark.parametrize("kind", ["silu", "gelu_tanh"])
def test_act_and_mul(dtype, n, kind, device):
    from aiolm.kernels.triton import activation

    x = _rand(3, 2 * n, dtype=dtype) * 3
    gate, up = x.float().chunk(2, dim=-1)
    act = F.silu(gate) if kind == "silu" else F.gelu(gate, approximate="tanh")
    want = (act * up).to(dtype)
    fn = activation.silu_and_mul if kind == "silu" else activation.gelu_tanh_and_mul
    got = fn(x.to(device)).cpu()
    tol = TOL[dtype] * 3 if dtype != torch.float32 else 1e-5
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert math.isfinite(got.float().abs().max().item())
