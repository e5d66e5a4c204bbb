"""GEMMs over quantized weights for the GPU: y = x W^T with W kept as a checkpoint stores it.

- ``w4a16_gemm``: 4-bit codes packed 8 to an int32 along the input features (``qweight``
  [K/8, N], GPTQ's packing), a float32 scale and min per group of inputs and output column
  (``scale``, ``mins`` [G, N]: w = q * s + m, m = -s * z), and for activation order the
  input feature each column of the codes reads (``perm`` [K], gathered as x is loaded).
- ``fp8_gemm``: float8 e4m3 bytes (``weight`` [N, K] uint8) with a float32 scale per block of
  ``scale_k`` inputs and per output column (``scale`` [ceil(K / scale_k), N]): block scales
  (128 x 128 tiles), per-channel (one row) and per-tensor (one row of one value) alike.

A program owns a BLOCK_M x BLOCK_N tile of y and walks K in steps of BLOCK_K (32, which
every group size and scale block divides), turning each step's weights into float32 values
before one tl.dot: x in float32 multiplies them exactly as the dequantized weights (up to
the order of the sums); 16-bit x multiplies them rounded to x's dtype, as the dense
16-bit model would.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aiolm.kernels.triton import interpreting
from aiolm.kernels.triton.jit_math import fp8_e4m3_float

BLOCK_K = 32


@triton.jit
def _w4a16_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    m_ptr,
    perm_ptr,
    out_ptr,
    M,
    N,
    K,
    sxm,
    sxk,
    som,
    son,
    GROUP: tl.constexpr,
    HAS_PERM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        if HAS_PERM:
            src = tl.load(perm_ptr + rk, mask=k_ok, other=0).to(tl.int64)
        else:
            src = rk.to(tl.int64)
        x = tl.load(
            x_ptr + rm[:, None].to(tl.int64) * sxm + src[None, :] * sxk, mask=m_ok[:, None] & k_ok[None, :], other=0.0
        )
        packed = tl.load(
            qw_ptr + (rk // 8)[:, None].to(tl.int64) * N + rn[None, :], mask=k_ok[:, None] & n_ok[None, :], other=0
        )
        codes = (packed >> ((rk % 8) * 4)[:, None]) & 0xF
        g = k0 // GROUP
        s = tl.load(s_ptr + g * N + rn, mask=n_ok, other=0.0)
        mn = tl.load(m_ptr + g * N + rn, mask=n_ok, other=0.0)
        w = codes.to(tl.float32) * s[None, :] + mn[None, :]
        w = tl.where(k_ok[:, None], w, 0.0)
        if FP32_DOT:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x_ptr.dtype.element_ty))
    tl.store(
        out_ptr + rm[:, None].to(tl.int64) * som + rn[None, :] * son,
        acc.to(out_ptr.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


@triton.jit
def _fp8_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    M,
    N,
    K,
    sxm,
    sxk,
    som,
    son,
    SCALE_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(
            x_ptr + rm[:, None].to(tl.int64) * sxm + rk[None, :] * sxk, mask=m_ok[:, None] & k_ok[None, :], other=0.0
        )
        b = tl.load(w_ptr + rn[None, :].to(tl.int64) * K + rk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0)
        s = tl.load(s_ptr + (k0 // SCALE_K) * N + rn, mask=n_ok, other=0.0)
        w = fp8_e4m3_float(b) * s[None, :]
        if FP32_DOT:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x_ptr.dtype.element_ty))
    tl.store(
        out_ptr + rm[:, None].to(tl.int64) * som + rn[None, :] * son,
        acc.to(out_ptr.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


def _tiles(m: int, n: int) -> tuple[int, int]:
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    return block_m, 64 if n >= 64 else 32


def _fp32_dot(x: torch.Tensor) -> bool:
    # the interpreter's bfloat16 dot is wrong (as aiolm/kernels/triton/attention.py notes)
    return x.dtype == torch.float32 or (interpreting() and x.dtype == torch.bfloat16)


def w4a16_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    mins: torch.Tensor,
    group_size: int,
    perm: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] (float32, float16 or bfloat16) times the 4-bit weight (module docstring) ->
    [M, N] in x's dtype. ``group_size``: inputs a row of scale covers (a multiple of 32)."""
    m, k = x.shape
    n = qweight.shape[1]
    if group_size % BLOCK_K or qweight.shape[0] * 8 != k or scale.shape != mins.shape or scale.shape[1] != n:
        raise ValueError(
            f"w4a16_gemm: x {tuple(x.shape)}, qweight {tuple(qweight.shape)}, scale {tuple(scale.shape)}, "
            f"mins {tuple(mins.shape)} and group_size {group_size} do not fit"
        )
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m, block_n = _tiles(m, n)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w4a16_kernel[grid](
        x,
        qweight,
        scale,
        mins,
        perm if perm is not None else qweight,
        out,
        m,
        n,
        k,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=group_size,
        HAS_PERM=perm is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=BLOCK_K,
        FP32_DOT=_fp32_dot(x),
    )
    return out


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_k: int) -> torch.Tensor:
    """x [M, K] times fp8 bytes ``weight`` [N, K] (uint8) scaled by ``scale`` [ceil(K / scale_k), N]
    -> [M, N] in x's dtype. ``scale_k``: inputs a row of scales covers (a multiple of 32)."""
    m, k = x.shape
    n = weight.shape[0]
    if scale_k % BLOCK_K or weight.shape[1] != k or scale.shape != (-(-k // scale_k), n):
        raise ValueError(
            f"fp8_gemm: x {tuple(x.shape)}, weight {tuple(weight.shape)}, scale {tuple(scale.shape)} "
            f"and scale_k {scale_k} do not fit"
        )
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m, block_n = _tiles(m, n)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_kernel[grid](
        x,
        weight,
        scale,
        out,
        m,
        n,
        k,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        SCALE_K=scale_k,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=BLOCK_K,
        FP32_DOT=_fp32_dot(x),
    )
    return out
