"""Batched LoRA for the GPU path: every row of a batch through its own adapter, in one launch pair.

A batch mixes requests on different adapters (and on none). Grouping rows by adapter on the
host would need the slot ids there (a device-to-host read, so no CUDA graph) and one GEMM pair
per adapter. Instead, as in Punica's BGMV, each program reads its row's slot itself:

1. ``_shrink_kernel``, grid ``(T, L, cdiv(R, BLOCK_R))``: row t, slice i, a block of the rank.
   ``shrunk[t, i*R + r] = x[t] . lora_a[s, i*R + r]`` over K in blocks, in float32.
2. ``_expand_kernel``, grid ``(T, L, cdiv(widest slice, BLOCK_N))``: row t, slice i, a block
   of that slice's output columns. ``y[t, cols] += shrunk[t, i*R:(i+1)*R] @ lora_b[s, cols].T``,
   the delta rounded to y's dtype before the add (as :func:`lora_reference` does).

A row whose slot is -1 costs its programs one load of the slot and nothing else; its y row is
never written, and its ``shrunk`` row is never written nor read. The grid depends on T, L, R
and the layer's slice widths only, the slice offsets are compile-time constants of the layer,
and the scratch buffer comes from the caching allocator: nothing reads the device from the
host, so a call can be captured in a CUDA graph and replayed with other slot ids.

Single rows make each step a matrix-vector product, so the kernels multiply and reduce in
registers rather than with ``tl.dot`` (whose operands need 16 rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# elements in one program's weight tile: enough to stream well, few enough to stay in registers
_TILE = 4096


@triton.jit
def _shrink_kernel(
    out_ptr,
    x_ptr,
    a_ptr,
    slot_ptr,
    sx0,
    sx1,
    sa0,
    sa1,
    sa2,
    so0,
    K: tl.constexpr,
    R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot < 0:
        return
    piece = tl.program_id(1)
    r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < R
    offs_k = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row * sx0
    a_rows = a_ptr + slot * sa0 + (piece * R + r).to(tl.int64)[:, None] * sa1
    acc = tl.zeros([BLOCK_R, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        xv = tl.load(x_row + k * sx1, mask=k_ok, other=0.0).to(tl.float32)
        av = tl.load(a_rows + k[None, :] * sa2, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        acc += av.to(tl.float32) * xv[None, :]
    tl.store(out_ptr + row * so0 + piece * R + r, tl.sum(acc, axis=1), mask=r_ok)


@triton.jit
def _expand_kernel(
    y_ptr,
    h_ptr,
    b_ptr,
    slot_ptr,
    sy0,
    sy1,
    sh0,
    sb0,
    sb1,
    sb2,
    STARTS: tl.constexpr,
    L: tl.constexpr,
    R: tl.constexpr,
    R_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot < 0:
        return
    piece = tl.program_id(1)
    # this slice's columns [c0, c1): picked out of the layer's constant offsets without a table
    c0 = 0
    c1 = 0
    for j in tl.static_range(L):
        c0 = tl.where(piece == j, STARTS[j], c0)
        c1 = tl.where(piece == j, STARTS[j + 1], c1)
    first = c0 + tl.program_id(2) * BLOCK_N
    if first >= c1:  # the grid covers the widest slice: narrower ones leave programs idle
        return
    cols = first + tl.arange(0, BLOCK_N)
    c_ok = cols < c1
    r = tl.arange(0, R_PAD)
    r_ok = r < R
    h = tl.load(h_ptr + row * sh0 + piece * R + r, mask=r_ok, other=0.0)
    b = tl.load(
        b_ptr + slot * sb0 + cols.to(tl.int64)[:, None] * sb1 + r[None, :] * sb2,
        mask=c_ok[:, None] & r_ok[None, :],
        other=0.0,
    )
    delta = tl.sum(b.to(tl.float32) * h[None, :], axis=1)
    y_ptrs = y_ptr + row * sy0 + cols * sy1
    yv = tl.load(y_ptrs, mask=c_ok, other=0.0)
    # the delta is rounded to y's dtype first, then added: the reference's `y += delta.to(y.dtype)`
    out = yv.to(tl.float32) + delta.to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=c_ok)


def _check(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slot_ids: torch.Tensor,
    starts: tuple[int, ...],
) -> None:
    """Shapes, dtypes and devices: Python ints and attributes only (no device read)."""
    if x.dim() != 2 or y.dim() != 2 or lora_a.dim() != 3 or lora_b.dim() != 3 or slot_ids.dim() != 1:
        raise ValueError("x [T, K], y [T, N], lora_a [S, L*R, K], lora_b [S, N, R], slot_ids [>= T]")
    t, k = x.shape
    n = y.shape[1]
    s, lr, r = lora_b.shape[0], lora_a.shape[1], lora_b.shape[2]
    nslices = len(starts) - 1
    if nslices < 1 or starts[0] != 0 or starts[-1] != n or any(a >= b for a, b in zip(starts, starts[1:])):
        raise ValueError(f"slice_starts {list(starts)}: need 0 = c_0 < ... < c_L = N = {n}")
    if y.shape[0] != t or lora_a.shape[0] != s or lora_a.shape[2] != k or lora_b.shape[1] != n or lr != nslices * r:
        raise ValueError(
            f"shapes do not fit: x {tuple(x.shape)}, y {tuple(y.shape)}, lora_a {tuple(lora_a.shape)}, "
            f"lora_b {tuple(lora_b.shape)}, {nslices} slices"
        )
    if r < 1:
        raise ValueError("rank R must be at least 1")
    if slot_ids.numel() < t:
        raise ValueError(f"slot_ids has {slot_ids.numel()} entries for {t} rows")
    if slot_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_ids must be int32 or int64, not {slot_ids.dtype}")
    if x.dtype not in _DTYPES or not (y.dtype == lora_a.dtype == lora_b.dtype == x.dtype):
        raise ValueError(
            f"x, y, lora_a, lora_b must share one dtype of {_DTYPES}: "
            f"{x.dtype}, {y.dtype}, {lora_a.dtype}, {lora_b.dtype}"
        )
    if len({a.device for a in (y, x, lora_a, lora_b, slot_ids)}) != 1:
        raise ValueError("y, x, lora_a, lora_b and slot_ids must be on one device")


def lora_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slot_ids: torch.Tensor,
    slice_starts: Sequence[int],
) -> None:
    """In place: what :func:`aiolm.kernels.lora_reference.lora_reference` computes, in one shrink
    and one expand launch, without a host synchronisation.

    x [T, K]; y [T, N]; lora_a [S, L*R, K]; lora_b [S, N, R] (one dtype of float32, float16,
    bfloat16, any strides); slot_ids int32/int64 [>= T], -1 for a row without an adapter, else
    a slot < S (entries past T are not read); slice_starts: L + 1 Python ints, 0 .. N.
    """
    starts = tuple(int(c) for c in slice_starts)
    _check(y, x, lora_a, lora_b, slot_ids, starts)
    t, k = x.shape
    if t == 0:
        return
    rank = lora_b.shape[2]
    nslices = len(starts) - 1
    r_pad = triton.next_power_of_2(rank)
    widest = max(b - a for a, b in zip(starts, starts[1:]))

    # rows the expand step reads are all written by the shrink step first (same slot test)
    shrunk = torch.empty(t, nslices * rank, dtype=torch.float32, device=x.device)
    block_r = min(r_pad, 16)
    block_k = min(triton.next_power_of_2(k), max(16, _TILE // block_r))
    _shrink_kernel[(t, nslices, triton.cdiv(rank, block_r))](
        shrunk,
        x,
        lora_a,
        slot_ids,
        x.stride(0),
        x.stride(1),
        lora_a.stride(0),
        lora_a.stride(1),
        lora_a.stride(2),
        shrunk.stride(0),
        K=k,
        R=rank,
        BLOCK_R=block_r,
        BLOCK_K=block_k,
    )
    block_n = min(triton.next_power_of_2(widest), max(16, _TILE // r_pad), 256)
    _expand_kernel[(t, nslices, triton.cdiv(widest, block_n))](
        y,
        shrunk,
        lora_b,
        slot_ids,
        y.stride(0),
        y.stride(1),
        shrunk.stride(0),
        lora_b.stride(0),
        lora_b.stride(1),
        lora_b.stride(2),
        STARTS=starts,
        L=nslices,
        R=rank,
        R_PAD=r_pad,
        BLOCK_N=block_n,
    )
