"""Fused mixture-of-experts MLP: tokens sorted by expert, then two grouped-GEMM launches.

A token t routed to k experts makes k (token, expert) pairs, flat index ``p = t * k + j``.
:func:`moe_align_block_size` sorts the pairs by expert and pads each expert's run up to a
multiple of ``block_m`` with the sentinel ``T * k``, so every ``block_m`` block of the sorted
list belongs to exactly one expert (``expert_ids[block]``). Then:

1. ``_gate_up_kernel``: a program owns one block of sorted pairs and one BLOCK_N slice of the
   intermediate dim; it gathers the pairs' token rows of x, multiplies them by that expert's
   gate rows and up rows (two accumulators over the same x tile) and writes
   ``silu(gate) * up`` to row p of ``inter`` [T * k, I]: the activation is the epilogue.
2. ``_down_kernel``: the same blocks, A = ``inter`` rows, B = ``w2[e]``; the epilogue scales
   by the pair's routing weight and writes row p of ``out`` [T * k, H] in float32.
3. ``out.view(T, k, H).sum(1)``: the k experts of a token added in float32.

Pairs whose expert is not on this rank (id < 0 or >= E) are left out of the sorted list;
their rows of ``out`` stay zero. Buffers are sized from T, k, E and block_m alone (no
device-to-host read), so a call can be captured in a CUDA graph: blocks past ``num_padded``
exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aiolm.kernels.triton import interpreting

BLOCK_N = 64
BLOCK_K = 32


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids int32 [P], expert_ids int32 [P // block_m], num_padded int32 [1]).

    sorted_ids holds the flat pair indices ``t * k + j`` grouped by expert (ascending expert,
    and ascending pair within an expert), each expert's run padded to a multiple of
    ``block_m`` with ``T * k``; experts with no pairs get no block. Pairs with an id outside
    [0, num_experts) are dropped. P is the most the padded runs can take, so entries from
    ``num_padded`` on are all sentinels and their ``expert_ids`` are -1. Plain torch ops
    without a host sync (scatter_add rather than bincount, which reads its max on the host).
    """
    ids = topk_ids.reshape(-1)
    n = ids.numel()
    dev = ids.device
    # each expert with pairs pads by at most block_m - 1, and at most min(E, n) experts have pairs
    bound = n + min(num_experts, n) * (block_m - 1)
    num_blocks = triton.cdiv(bound, block_m)
    cap = num_blocks * block_m

    valid = (ids >= 0) & (ids < num_experts)
    key = torch.where(valid, ids.long(), num_experts)  # bucket E collects the dropped pairs
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    run_start = padded_end - padded  # where expert e's run begins in sorted_ids
    count_start = counts.cumsum(0) - counts  # where expert e's pairs begin in the stable sort

    key_sorted, order = torch.sort(key, stable=True)
    rank = torch.arange(n, device=dev) - count_start.gather(0, key_sorted.clamp(max=num_experts - 1))
    dest = run_start.gather(0, key_sorted.clamp(max=num_experts - 1)) + rank
    dest = torch.where(key_sorted < num_experts, dest, cap)  # dropped pairs land in a spare slot
    sorted_ids = torch.full((cap + 1,), n, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    sorted_ids = sorted_ids[:cap]

    # block b belongs to the first expert whose run ends past b's start
    block_start = torch.arange(num_blocks, device=dev) * block_m
    expert_ids = torch.searchsorted(padded_end, block_start, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    num_padded = padded_end[-1:].to(torch.int32) if num_experts else torch.zeros(1, dtype=torch.int32, device=dev)
    return sorted_ids, expert_ids, num_padded


@triton.jit
def _gate_up_kernel(
    inter_ptr,
    x_ptr,
    w_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    num_pairs,
    sx0,
    sw0,
    sw1,
    sw2,
    si0,
    TOPK: tl.constexpr,
    H: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + block).to(tl.int64)
    pair = tl.load(sorted_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < num_pairs  # padding carries the sentinel num_pairs
    token = (pair // TOPK).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < INTER
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = x_ptr + token[:, None] * sx0 + offs_k[None, :]
    # B tiles are [BLOCK_K, BLOCK_N]: w13[e, n, k] read with k down the rows
    g_ptrs = w_ptr + expert * sw0 + cols[None, :] * sw1 + offs_k[:, None] * sw2
    u_ptrs = g_ptrs + INTER * sw1
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = offs_k + k0 < H
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        u = tl.load(u_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if FP32_DOT:
            a = a.to(tl.float32)
            acc_g += tl.dot(a, g.to(tl.float32), input_precision="ieee")
            acc_u += tl.dot(a, u.to(tl.float32), input_precision="ieee")
        else:
            acc_g += tl.dot(a, g)
            acc_u += tl.dot(a, u)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K * sw2
        u_ptrs += BLOCK_K * sw2

    act = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(
        inter_ptr + pair.to(tl.int64)[:, None] * si0 + cols[None, :],
        act.to(inter_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


@triton.jit
def _down_kernel(
    out_ptr,
    inter_ptr,
    w_ptr,
    topk_weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    num_pairs,
    si0,
    sw0,
    sw1,
    sw2,
    so0,
    H: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + block).to(tl.int64)
    pair = tl.load(sorted_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < num_pairs
    pair = pair.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = inter_ptr + pair[:, None] * si0 + offs_k[None, :]
    b_ptrs = w_ptr + expert * sw0 + cols[None, :] * sw1 + offs_k[:, None] * sw2
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        k_ok = offs_k + k0 < INTER
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if FP32_DOT:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, b)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * sw2

    weight = tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0)
    tl.store(
        out_ptr + pair[:, None] * so0 + cols[None, :],
        acc * weight[:, None],
        mask=row_ok[:, None] & col_ok[None, :],
    )


def default_block_m(num_tokens: int, top_k: int, num_experts: int) -> int:
    """Rows per tile from the mean pairs per expert: small tiles waste less on padding in
    decode, large ones reuse each weight tile over more rows in prefill."""
    per_expert = num_tokens * top_k / max(num_experts, 1)
    if per_expert <= 16:
        return 16
    return 32 if per_expert <= 64 else 64


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    block_m: int | None = None,
) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; topk_weights float32
    [T, k]; topk_ids int32/int64 [T, k], -1 for an expert on another rank. Returns [T, H] in
    x.dtype: sum_j topk_weights[t, j] * w2[e] @ (silu(gate_e x_t) * up_e x_t), e = topk_ids[t, j],
    accumulated in float32. ``block_m`` (16, 32 or 64, a power of two >= 16) defaults by T."""
    return fused_moe_tiled(x, w13, w2, topk_weights, topk_ids, block_m=block_m)


def fused_moe_tiled(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    block_m: int | None = None,
    block_n: int = BLOCK_N,
    block_k: int = BLOCK_K,
) -> torch.Tensor:
    """:func:`fused_moe` with the output and reduction tile sizes chosen by the caller (tests,
    tuning). Every tile dim is a power of two of at least 16, tl.dot's smallest operand."""
    t, h = x.shape
    e, two_i, h_w = w13.shape
    if e < 1:
        raise ValueError("w13 has no experts")
    inter_dim = two_i // 2
    k = topk_ids.shape[1]
    if two_i % 2 or h_w != h or w2.shape != (e, h, inter_dim):
        raise ValueError(f"w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit x {tuple(x.shape)}")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"w13 {w13.dtype} and w2 {w2.dtype} must have x's dtype {x.dtype}")
    if topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != t:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} / topk_ids {tuple(topk_ids.shape)} vs T={t}")
    block_m = block_m or default_block_m(t, k, e)
    for name, size in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} {size}: must be a power of two of at least 16 (a tl.dot operand dim)")
    if t == 0 or k == 0:
        return torch.zeros_like(x)
    # the kernels step along K by adding BLOCK_K to their pointers: the K dim must be contiguous
    x = x if x.stride(1) == 1 else x.contiguous()
    w13 = w13 if w13.stride(2) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(2) == 1 else w2.contiguous()
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()

    sorted_ids, expert_ids, num_padded = moe_align_block_size(topk_ids, e, block_m)
    num_pairs = t * k
    # float32 takes the exact dot (not TF32); bf16 too under the interpreter, whose bf16 dot is wrong
    fp32_dot = x.dtype == torch.float32 or (interpreting() and x.dtype == torch.bfloat16)
    num_blocks = expert_ids.shape[0]

    inter = torch.empty(num_pairs, inter_dim, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter_dim, block_n))](
        inter,
        x,
        w13,
        sorted_ids,
        expert_ids,
        num_padded,
        num_pairs,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        w13.stride(2),
        inter.stride(0),
        TOPK=k,
        H=h,
        INTER=inter_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        FP32_DOT=fp32_dot,
    )
    # zeros: rows of pairs on other ranks are never written and must add nothing
    out = torch.zeros(num_pairs, h, dtype=torch.float32, device=x.device)
    _down_kernel[(num_blocks, triton.cdiv(h, block_n))](
        out,
        inter,
        w2,
        weights,
        sorted_ids,
        expert_ids,
        num_padded,
        num_pairs,
        inter.stride(0),
        w2.stride(0),
        w2.stride(1),
        w2.stride(2),
        out.stride(0),
        H=h,
        INTER=inter_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        FP32_DOT=fp32_dot,
    )
    return out.view(t, k, h).sum(1).to(x.dtype)
