"""Write the new tokens' K and V into the paged cache by ``slot_mapping``.

Cache layout per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``; a slot
is ``block_id * block_size + offset``. A slot of -1 marks a padding row (a CUDA-graph
batch padded up to its captured size) and writes nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aiolm.attention.torch_backend import FP8, to_cache


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    sk0,
    sk1,
    sk2,
    sv0,
    sv1,
    sv2,
    sc0,
    sc1,
    sc2,
    sc3,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HK_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, HK_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    dst = blk * sc0 + off * sc1 + h * sc2 + d * sc3
    k = tl.load(k_ptr + t * sk0 + h * sk1 + d * sk2, mask=mask)
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + t * sv0 + h * sv1 + d * sv2, mask=mask)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def write_kv(
    kv_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """k, v: [T, Hk, D] (any strides, e.g. views of a fused qkv); slot_mapping: [T] int32/int64.
    An fp8 cache gets k / k_scale and v / v_scale rounded by torch (saturating, as
    attention/torch_backend.py's to_cache does), copied as bytes."""
    _, _, block_size, hk, d = kv_cache.shape
    t = k.shape[0]
    if t == 0:
        return
    if kv_cache.dtype == FP8:
        kv_cache = kv_cache.view(torch.uint8)
        k, v = to_cache(k, FP8, k_scale).view(torch.uint8), to_cache(v, FP8, v_scale).view(torch.uint8)
    kc, vc = kv_cache[0], kv_cache[1]  # same strides: views of one tensor
    _write_kv_kernel[(t,)](
        k,
        v,
        kc,
        vc,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        kc.stride(0),
        kc.stride(1),
        kc.stride(2),
        kc.stride(3),
        NUM_KV_HEADS=hk,
        HEAD_DIM=d,
        BLOCK_SIZE=block_size,
        HK_PAD=triton.next_power_of_2(hk),
        D_PAD=triton.next_power_of_2(d),
    )
