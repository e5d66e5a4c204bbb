"""Bidirectional attention over a flat batch of whole sequences, for encoders (BERT).

Request i owns tokens ``cu_seqlens[i]:cu_seqlens[i+1]`` of q, k and v, and each of its
queries attends to all of its keys, none of another request's; there is no cache, the
keys are the step's own. A program owns BLOCK_Q query tokens of one request and one kv
head, with the query heads that share that kv head stacked as rows of one tile (GQA
without repeating K/V), and walks the request's keys BLOCK_N at a time with an online
softmax, as the paged kernel (attention.py) walks pages.

Metadata is int32, as GPU kernels want it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aiolm.kernels.triton import interpreting


@triton.jit
def _encoder_attention_kernel(
    out_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    cu_ptr,
    scale,
    so0,
    so1,
    sq0,
    sq1,
    sk0,
    sk1,
    sv0,
    sv1,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    seq = tl.program_id(0)
    qb = tl.program_id(1)
    kvh = tl.program_id(2)

    start = tl.load(cu_ptr + seq)
    n = tl.load(cu_ptr + seq + 1) - start
    if qb * BLOCK_Q >= n:
        return

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    rows = tl.arange(0, BLOCK_M)
    t = qb * BLOCK_Q + rows // GROUP_PAD  # query token within the request
    hg = rows % GROUP_PAD  # query head within the kv head's group
    row_ok = (t < n) & (hg < GROUP)
    head = kvh * GROUP + hg
    tok = (start + t).to(tl.int64)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM

    q = tl.load(
        q_ptr + tok[:, None] * sq0 + head[:, None] * sq1 + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0
    )
    if FP32_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    offs = tl.arange(0, BLOCK_N)
    for j in range(0, n, BLOCK_N):
        key = j + offs
        key_ok = key < n
        ktok = (start + key).to(tl.int64)
        k = tl.load(
            k_ptr + ktok[None, :] * sk0 + kvh * sk1 + d[:, None], mask=key_ok[None, :] & d_ok[:, None], other=0.0
        )
        if FP32_DOT:
            s = tl.dot(q, k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = tl.where(key_ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])  # every row sees key j >= 0, so m_new is finite
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptr + ktok[:, None] * sv0 + kvh * sv1 + d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0
        )
        if FP32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v_ptr.dtype.element_ty), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    o = acc / l_i[:, None]
    tl.store(
        out_ptr + tok[:, None] * so0 + head[:, None] * so1 + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def encoder_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """out, q: [T, H, D]; k, v: [T, Hk, D] (each with a contiguous last dim, any token and
    head strides: views of one fused qkv are fine); cu_seqlens [num_seqs + 1] int32.

    ``max_seqlen`` comes from the host (the grid is sized by it); ``block_m`` (rows per tile:
    query tokens x group heads, at least 16) and ``block_n`` (keys per step) are for tests."""
    t, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("q, k, v and out need a contiguous head_dim")
    num_seqs = cu_seqlens.shape[0] - 1
    if t == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_q = max(1, max(block_m or 64, 16, group_pad) // group_pad)
    block_n = max(16, triton.next_power_of_2(block_n or 64))
    d_pad = max(16, triton.next_power_of_2(head_dim))  # a tl.dot operand has at least 16 columns
    fp32_dot = q.dtype == torch.float32 or (
        interpreting() and q.dtype == torch.bfloat16
    )  # interpreter's bf16 dot is wrong
    grid = (num_seqs, triton.cdiv(max_seqlen, block_q), num_kv_heads)
    _encoder_attention_kernel[grid](
        out,
        q,
        k,
        v,
        cu_seqlens,
        float(scale),
        out.stride(0),
        out.stride(1),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        FP32_DOT=fp32_dot,
    )
    return out
