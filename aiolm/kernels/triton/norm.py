"""RMSNorm, alone or fused with the residual add that precedes it in every decoder layer.

Rounding follows the Hugging Face reference (aiolm/model/layers/norm.py): the sum
x + residual is rounded to the residual's dtype (it is the stream the next layer adds
to), the norm is computed in float32, rounded to x's dtype, then scaled by the weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sx, sr, so, eps, N: tl.constexpr, N_PAD: tl.constexpr, HAS_RESIDUAL: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, N_PAD)
    ok = cols < N
    x = tl.load(x_ptr + row * sx + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * sr + cols, mask=ok, other=0.0).to(tl.float32)
        x = (x + r).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * sr + cols, x, mask=ok)
        x = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps)
    y = (x * inv).to(x_ptr.dtype.element_ty).to(tl.float32)  # rounded as the reference rounds it
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)  # arithmetic in float32 only
    tl.store(out_ptr + row * so + cols, (w * y).to(out_ptr.dtype.element_ty), mask=ok)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor, eps: float
) -> None:
    rows, n = x.shape
    if rows == 0:
        return
    if x.stride(1) != 1 or out.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("rms_norm needs rows with a contiguous last dim")
    res = residual if residual is not None else x
    _rms_norm_kernel[(rows,)](
        x,
        res,
        weight,
        out,
        x.stride(0),
        res.stride(0),
        out.stride(0),
        float(eps),
        N=n,
        N_PAD=triton.next_power_of_2(n),
        HAS_RESIDUAL=residual is not None,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, N]. Returns a new [T, N] tensor in x's dtype."""
    out = torch.empty_like(x)
    _launch(x, None, weight, out, eps)
    return out


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual <- x + residual, x <- rms_norm(residual) * weight."""
    _launch(x, residual, weight, x, eps)
