"""Rotary position embedding applied in place to q and k, for a flat batch of tokens.

Two layouts of the rotated pairs: neox (rotate-half, Llama / Qwen / Mistral in Hugging
Face form) pairs dim i with dim i + rot/2; gpt-j pairs dims 2i and 2i+1. ``cos`` and
``sin`` are indexed by position, one row per position, and only their first rot/2
columns are read, so both the half-width cache and the duplicated full-width one of
aiolm/model/layers/rotary.py serve. Dims past ``rotary_dim`` are left alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(x_ptr, tok, s0, s1, c, s, h, i, h_ok, NEOX: tl.constexpr, HALF: tl.constexpr):
    if NEOX:
        o1 = i
        o2 = i + HALF
    else:
        o1 = 2 * i
        o2 = 2 * i + 1
    base = x_ptr + tok * s0 + h * s1
    mask = h_ok & (i < HALF)
    x1 = tl.load(base + o1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + o2, mask=mask, other=0.0).to(tl.float32)
    tl.store(base + o1, (x1 * c - x2 * s).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + o2, (x2 * c + x1 * s).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    sq0,
    sq1,
    sk0,
    sk1,
    sc,
    ss,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    H_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    NEOX: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    i = tl.arange(0, HALF_PAD)[None, :]
    h = tl.arange(0, H_PAD)[:, None]
    c = tl.load(cos_ptr + pos * sc + i, mask=i < HALF, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * ss + i, mask=i < HALF, other=0.0).to(tl.float32)
    _rotate(q_ptr, tok, sq0, sq1, c, s, h, i, h < NUM_HEADS, NEOX, HALF)
    _rotate(k_ptr, tok, sk0, sk1, c, s, h, i, h < NUM_KV_HEADS, NEOX, HALF)


def rotary_(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    is_neox: bool = True,
    rotary_dim: int | None = None,
) -> None:
    """q: [T, H, D], k: [T, Hk, D] (last dim contiguous), positions [T]; cos, sin [max_pos, >= rot/2]."""
    t, h, d = q.shape
    rot = rotary_dim or d
    if rot % 2 or rot > d:
        raise ValueError(f"rotary_dim {rot} must be even and at most head_dim {d}")
    if q.stride(2) != 1 or k.stride(2) != 1 or cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError("rotary_ needs a contiguous last dim in q, k, cos and sin")
    if t == 0:
        return
    half = rot // 2
    _rope_kernel[(t,)](
        q,
        k,
        positions,
        cos,
        sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        sin.stride(0),
        NUM_HEADS=h,
        NUM_KV_HEADS=k.shape[1],
        H_PAD=triton.next_power_of_2(max(h, k.shape[1])),
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        NEOX=is_neox,
    )
