"""The fused float32 CPU ops against the torch code they replace."""

from __future__ import annotations

import pytest
import torch

from aiolm.kernels import cpu as cpu_kernels
from aiolm.kernels.cpu_ops import CpuKernelOps
from aiolm.kernels.ops import TorchOps
from aiolm.model.layers.norm import RMSNorm
from aiolm.model.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ compiler for the CPU kernels")


def _ref_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("rows,size", [(1, 576), (7, 64), (300, 96), (3, 13)])
def test_rms_norm_and_the_fused_residual_add(rows, size):
    torch.manual_seed(rows)
    x, res, w = torch.randn(rows, size) * 3, torch.randn(rows, size), torch.rand(size) + 0.5
    torch.testing.assert_close(torch.ops.aiolm.rms_norm(x, w, 1e-5), _ref_norm(x, w, 1e-5))
    x2, res2 = x.clone(), res.clone()
    torch.ops.aiolm.add_rms_norm_(x2, res2, w, 1e-5)
    torch.testing.assert_close(res2, x + res)
    torch.testing.assert_close(x2, _ref_norm(x + res, w, 1e-5))


def test_rms_norm_module_gives_the_same_answer_on_both_paths():
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-6, CpuKernelOps())
    norm.weight.data.uniform_(0.5, 1.5)
    x, res = torch.randn(5, 64), torch.randn(5, 64)
    fused_h, fused_r = norm(x.clone(), res.clone())
    want_r = x + res
    torch.testing.assert_close(fused_r, want_r)
    torch.testing.assert_close(fused_h, TorchOps().rms_norm(want_r, norm.weight, norm.eps))
    torch.testing.assert_close(norm(x.double()).float(), norm(x))  # float64 takes the torch path


def test_rotary_in_place_on_strided_views_of_a_fused_qkv():
    torch.manual_seed(1)
    heads, kv_heads, d, t = 9, 3, 64, 11
    rope = RotaryEmbedding(d, 4096, 10000.0, None, CpuKernelOps())
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d)
    q = qkv[:, : heads * d].reshape(t, heads, d)  # strided views, as the model has them
    k = qkv[:, heads * d : (heads + kv_heads) * d].reshape(t, kv_heads, d)
    pos = torch.tensor([0, 1, 2, 5, 100, 4095, 7, 7, 3, 2000, 9])
    want_q, want_k = TorchOps().rotary(pos, q.clone(), k.clone(), rope.cos, rope.sin)  # the reference
    v_before = qkv[:, (heads + kv_heads) * d :].clone()
    got_q, got_k = rope(pos, q, k)
    assert got_q.data_ptr() == q.data_ptr()  # in place
    torch.testing.assert_close(got_q, want_q)
    torch.testing.assert_close(got_k, want_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], v_before)  # v untouched
    with pytest.raises(RuntimeError, match="position 4096 outside"):
        rope(torch.full((t,), 4096), q, k)


def test_silu_and_mul():
    torch.manual_seed(2)
    x = torch.randn(6, 2 * 100) * 4
    x[0, 0] = -100.0  # exp overflow side
    want = torch.nn.functional.silu(x[:, :100]) * x[:, 100:]
    torch.testing.assert_close(torch.ops.aiolm.silu_and_mul(x), want)


def test_silu_and_mul_in_bfloat16_rounds_the_float32_result_once():
    """bfloat16 in and out (gate/up straight from a bfloat16 matmul): the float32 arithmetic
    of the float32 kernel, rounded to nearest even like torch's own cast."""
    torch.manual_seed(3)
    x = (torch.randn(70, 2 * 1536) * 4).bfloat16()
    x[0, 0], x[1, 5] = float("nan"), float("-inf")
    got = torch.ops.aiolm.silu_and_mul(x)
    assert got.dtype == torch.bfloat16 and got.shape == (70, 1536)
    want = torch.ops.aiolm.silu_and_mul(x.float()).bfloat16()
    assert torch.equal(got.float().nan_to_num(7.0), want.float().nan_to_num(7.0))
    assert torch.isnan(got[0, 0])


@pytest.mark.parametrize("rows,size", [(1, 384), (7, 64), (300, 96), (3, 13)])
def test_add_layer_norm_reads_float32_or_bfloat16_and_normalises_the_sum(rows, size):
    """LayerNorm(x + residual) in one pass (a post-norm encoder's residual stream), x as a
    float32 or bfloat16 matmul hands it over: torch's add-then-LayerNorm in float32."""
    torch.manual_seed(rows)
    res, w, b = torch.randn(rows, size) * 2 + 5, torch.rand(size) + 0.5, torch.randn(size)
    for x in (torch.randn(rows, size) * 3, (torch.randn(rows, size) * 3).bfloat16()):
        want = torch.nn.functional.layer_norm(x.float() + res, (size,), w, b, 1e-12)
        got = torch.ops.aiolm.add_layer_norm(x, res, w, b, 1e-12)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
        torch.testing.assert_close(CpuKernelOps().add_layer_norm(x, res, w, b, 1e-12), got, rtol=0, atol=0)
        torch.testing.assert_close(TorchOps().add_layer_norm(x, res, w, b, 1e-12), want)
    with pytest.raises(RuntimeError, match="differ in shape"):
        torch.ops.aiolm.add_layer_norm(torch.zeros(2, size), torch.zeros(3, size), w, b, 1e-12)
