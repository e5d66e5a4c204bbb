"""Gated MLP activations: act(gate) * up, with gate and up the two halves of one row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aiolm.kernels.triton.jit_math import tanh


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, sx, so, N: tl.constexpr, BLOCK: tl.constexpr, GELU: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    gate = tl.load(x_ptr + row * sx + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * sx + N + cols, mask=ok, other=0.0).to(tl.float32)
    if GELU:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2 / pi)
        act = 0.5 * gate * (1.0 + tanh(inner))
    else:
        act = gate * tl.sigmoid(gate)
    tl.store(out_ptr + row * so + cols, (act * up).to(out_ptr.dtype.element_ty), mask=ok)


def _act_and_mul(x: torch.Tensor, gelu: bool) -> torch.Tensor:
    rows, two_n = x.shape
    if two_n % 2 or x.stride(1) != 1:
        raise ValueError("x must be [T, 2 * N] with a contiguous last dim")
    n = two_n // 2
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows:
        block = min(1024, triton.next_power_of_2(n))
        _act_and_mul_kernel[(rows, triton.cdiv(n, block))](
            x, out, x.stride(0), out.stride(0), N=n, BLOCK=block, GELU=gelu
        )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2N] -> [T, N]: silu(x[:, :N]) * x[:, N:], computed in float32."""
    return _act_and_mul(x, gelu=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2N] -> [T, N]: gelu(x[:, :N], approximate='tanh') * x[:, N:], computed in float32."""
    return _act_and_mul(x, gelu=True)
