"""One paged-attention kernel for a whole flat batch: prefill chunks, prefix hits, decode rows.

Request i owns query tokens ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``; they are the last
``query_len`` of its ``seq_lens[i]`` tokens, so token j of the chunk sits at position
``seq_len - query_len + j`` and attends to every key at a position <= its own: the cached
prefix in full, its own chunk causally. Keys live in the pages ``block_table[i]``.

A program owns BLOCK_Q query tokens of one request and one kv head, with all the query
heads that share that kv head stacked as rows of one tile (GQA without repeating K/V),
and walks the pages once with an online softmax. Options:

- ``window``: a query at position p sees keys in ``(p - window, p]`` (HF / Mistral).
- ``soft_cap``: scores become ``tanh(s / cap) * cap`` before the softmax (Gemma 2).
- ``num_splits`` > 1 (flash-decoding): each program takes an equal share of the pages and
  writes an unnormalised partial result with its running max and sum; ``_reduce_kernel``
  merges the shares. It pays off when requests x kv heads are too few to fill the GPU
  and the contexts are long.

Metadata is int32, as GPU kernels want it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aiolm.attention.torch_backend import FP8
from aiolm.kernels.triton import interpreting
from aiolm.kernels.triton.jit_math import fp8_e4m3_float, fp8_e4m3_scaled_half, tanh


@triton.jit
def _attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    cu_q_ptr,
    seq_lens_ptr,
    acc_part_ptr,
    ml_part_ptr,
    scale,
    soft_cap,
    window,
    so0,
    so1,
    sq0,
    sq1,
    sk0,
    sk1,
    sk2,
    sbt0,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    FP32_DOT: tl.constexpr,
    FP8: tl.constexpr,
):
    seq = tl.program_id(0)
    qb = tl.program_id(1)
    kvh = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS

    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if qb * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    rows = tl.arange(0, BLOCK_M)
    t = qb * BLOCK_Q + rows // GROUP_PAD  # query token within the chunk
    hg = rows % GROUP_PAD  # query head within the kv head's group
    row_ok = (t < q_len) & (hg < GROUP)
    head = kvh * GROUP + hg
    qpos = ctx + t
    tok = (q_start + t).to(tl.int64)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM

    q = tl.load(
        q_ptr + tok[:, None] * sq0 + head[:, None] * sq1 + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0
    )
    if FP32_DOT:
        q = q.to(tl.float32)
    elif FP8:  # pages as float16 values / 256: the scores and the output scaled back below
        q = q.to(tl.float16)
        scale = scale * 256.0
    else:
        q = q.to(k_cache_ptr.dtype.element_ty)

    # keys this tile can see: up to its last query's position, from its first query's window
    hi = tl.minimum(seq_len, ctx + tl.minimum(q_len, (qb + 1) * BLOCK_Q))
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(0, ctx + qb * BLOCK_Q - window + 1)
    first = lo // BLOCK_SIZE
    last = tl.cdiv(hi, BLOCK_SIZE)
    if NUM_SPLITS > 1:
        per = tl.cdiv(last - first, NUM_SPLITS)
        first = first + split * per
        last = tl.minimum(first + per, last)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    offs = tl.arange(0, BLOCK_SIZE)
    for page in range(first, last):
        phys = tl.load(block_table_ptr + seq * sbt0 + page).to(tl.int64)
        base = phys * sk0 + kvh * sk2
        k = tl.load(k_cache_ptr + base + offs[None, :] * sk1 + d[:, None], mask=d_ok[:, None], other=0)
        if FP8:
            if FP32_DOT:
                k = fp8_e4m3_float(k)
            else:
                k = fp8_e4m3_scaled_half(k)
        if FP32_DOT:
            s = tl.dot(q, k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * scale
        if USE_SOFTCAP:
            s = soft_cap * tanh(s / soft_cap)
        kpos = page * BLOCK_SIZE + offs
        visible = row_ok[:, None] & (kpos[None, :] <= qpos[:, None])
        if USE_WINDOW:
            visible = visible & (kpos[None, :] > qpos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
        p = tl.exp(s - m_use[:, None])
        alpha = tl.exp(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + base + offs[:, None] * sk1 + d[None, :], mask=d_ok[None, :], other=0)
        if FP8:
            if FP32_DOT:
                v = fp8_e4m3_float(v)
            else:
                v = fp8_e4m3_scaled_half(v)
        if FP32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        elif FP8:
            pv = tl.dot(p.to(tl.float16), v) * 256.0
        else:
            pv = tl.dot(p.to(v_cache_ptr.dtype.element_ty), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if NUM_SPLITS == 1:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + tok[:, None] * so0 + head[:, None] * so1 + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        # partials: acc_part [T, H, NUM_SPLITS, D_PAD], ml_part [T, H, NUM_SPLITS, 2]
        num_heads = tl.num_programs(2) // NUM_SPLITS * GROUP
        cell = (tok * num_heads + head) * NUM_SPLITS + split
        tl.store(acc_part_ptr + cell[:, None] * D_PAD + d[None, :], acc, mask=row_ok[:, None])
        tl.store(ml_part_ptr + cell * 2, m_i, mask=row_ok)
        tl.store(ml_part_ptr + cell * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _reduce_kernel(
    out_ptr,
    acc_part_ptr,
    ml_part_ptr,
    so0,
    so1,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cell = (tok * tl.num_programs(1) + head) * NUM_SPLITS
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < NUM_SPLITS
    m = tl.load(ml_part_ptr + (cell + s) * 2, mask=s_ok, other=float("-inf"))
    lse = tl.load(ml_part_ptr + (cell + s) * 2 + 1, mask=s_ok, other=0.0)
    big = tl.max(m, 0)
    big = tl.where(big == float("-inf"), 0.0, big)
    w = tl.exp(m - big)  # an empty share has m = -inf and weighs nothing
    total = tl.sum(lse * w, 0)
    d = tl.arange(0, D_PAD)
    acc = tl.load(acc_part_ptr + (cell + s)[:, None] * D_PAD + d[None, :], mask=s_ok[:, None], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + tok * so0 + head * so1 + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int, block_size: int, target_programs: int = 128
) -> int:
    """Split the pages only for decode steps whose requests x kv heads leave the GPU idle
    and whose contexts are long enough that each share still walks several pages."""
    if max_query_len != 1:
        return 1
    programs = num_seqs * num_kv_heads
    if programs >= target_programs:
        return 1
    pages = triton.cdiv(max_seq_len, block_size)
    by_work = pages // 8  # at least 8 pages per share
    by_idle = triton.cdiv(target_programs, max(programs, 1))
    return max(1, min(16, by_work, by_idle))


def paged_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    *,
    window: int | None = None,
    soft_cap: float | None = None,
    num_splits: int = 1,
    block_m: int | None = None,
) -> torch.Tensor:
    """out, q: [T, H, D] (last dim contiguous); k_cache, v_cache: [num_blocks, block_size, Hk, D]
    (float32, float16, bfloat16 or float8 e4m3: its values as they are, the caller scales);
    block_table [num_seqs, max_blocks], cu_seqlens_q [num_seqs + 1], seq_lens [num_seqs]: int32.

    ``max_query_len`` comes from the host (the grid is sized by it); ``block_m`` overrides
    the rows per tile (query tokens x group heads, at least 16), for tests."""
    num_seqs = seq_lens.shape[0]
    t, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(
            f"block_size {block_size}: the kernel needs a power of two of at least 16 (a page is one tl.dot operand)"
        )
    if q.stride(2) != 1 or out.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError("q, out and the cache need a contiguous head_dim")
    if t == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_m = block_m or (16 if max_query_len == 1 else 64)
    block_q = max(1, max(block_m, 16, group_pad) // group_pad)
    d_pad = triton.next_power_of_2(head_dim)
    fp32_dot = torch.float32 in (q.dtype, k_cache.dtype) or (
        interpreting() and torch.bfloat16 in (q.dtype, k_cache.dtype)
    )  # the interpreter's bf16 dot is wrong
    fp8 = k_cache.dtype == FP8
    if fp8:  # read as bytes, converted in the kernel (jit_math.fp8_e4m3_float / _scaled_half)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    splits = max(1, int(num_splits))
    if splits > 1:
        acc_part = torch.empty(t, num_heads, splits, d_pad, dtype=torch.float32, device=q.device)
        ml_part = torch.empty(t, num_heads, splits, 2, dtype=torch.float32, device=q.device)
    else:
        acc_part = ml_part = out  # unused
    grid = (num_seqs, triton.cdiv(max_query_len, block_q), num_kv_heads * splits)
    _attention_kernel[grid](
        out,
        q,
        k_cache,
        v_cache,
        block_table,
        cu_seqlens_q,
        seq_lens,
        acc_part,
        ml_part,
        float(scale),
        float(soft_cap or 0.0),
        int(window or 0),
        out.stride(0),
        out.stride(1),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_table.stride(0),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        NUM_SPLITS=splits,
        USE_SOFTCAP=bool(soft_cap),
        USE_WINDOW=bool(window),
        FP32_DOT=fp32_dot,
        FP8=fp8,
    )
    if splits > 1:
        _reduce_kernel[(t, num_heads)](
            out,
            acc_part,
            ml_part,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
            NUM_SPLITS=splits,
            SPLITS_PAD=triton.next_power_of_2(splits),
        )
    return out
