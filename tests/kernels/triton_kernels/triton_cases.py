"""Shared by the Triton kernel tests: random paged batches, a plain-loop attention reference,
and the comparison that allows for the interpreter's bfloat16 rounding."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from aiolm.attention.metadata import AttentionMetadata


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, H, D]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, Hk, D]
    block_table: torch.Tensor  # [num_seqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_lens: list[int]
    seq_lens_list: list[int]
    pages: list[list[int]]

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)


def make_batch(
    specs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> PagedBatch:
    """specs: (cached prefix length, new query tokens) per request. Pages are drawn at random
    from a cache twice the needed size, block 0 kept as the null block, and every page
    (used or not) holds random values, so a wrong page read shows up in the output."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil((c + n) / block_size) for c, n in specs]
    num_blocks = 2 * sum(need) + 1
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    pages, at = [], 0
    for n in need:
        pages.append(perm[at : at + n])
        at += n
    width = max(need)
    table = torch.zeros(len(specs), width, dtype=torch.int32)
    for i, p in enumerate(pages):
        table[i, : len(p)] = torch.tensor(p, dtype=torch.int32)
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    qlens = [n for _, n in specs]
    slens = [c + n for c, n in specs]
    q = torch.randn(sum(qlens), num_heads, head_dim, generator=g).to(dtype)
    cu = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0)), dtype=torch.int32)
    return PagedBatch(
        q.to(device),
        kv.to(device),
        table.to(device),
        cu.to(device),
        torch.tensor(slens, dtype=torch.int32, device=device),
        qlens,
        slens,
        pages,
    )


def reference_attention(
    b: PagedBatch, scale: float, window: int | None = None, soft_cap: float | None = None
) -> torch.Tensor:
    """Float32, one query token at a time, straight from the definition."""
    kv = b.kv_cache.float().cpu()
    q = b.q.float().cpu()
    _, _, bs, hk, d = kv.shape
    group = q.shape[1] // hk
    out = torch.zeros_like(q)
    start = 0
    for qlen, slen, pages in zip(b.query_lens, b.seq_lens_list, b.pages):
        pos = torch.arange(slen)
        phys = torch.tensor(pages)[pos // bs]
        k = kv[0, phys, pos % bs].repeat_interleave(group, dim=1)  # [slen, H, D]
        v = kv[1, phys, pos % bs].repeat_interleave(group, dim=1)
        for j in range(qlen):
            qpos = slen - qlen + j
            s = torch.einsum("hd,khd->hk", q[start + j], k) * scale
            if soft_cap:
                s = torch.tanh(s / soft_cap) * soft_cap
            visible = pos <= qpos
            if window:
                visible &= pos > qpos - window
            s = s.masked_fill(~visible, float("-inf"))
            out[start + j] = torch.einsum("hk,khd->hd", s.softmax(-1), v)
        start += qlen
    return out


TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}


def assert_same_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal, except that triton's interpreter rounds float32 -> bfloat16 toward zero where
    a GPU rounds to nearest: there, one bfloat16 step apart is allowed."""
    if got.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        torch.testing.assert_close(got, want, atol=0, rtol=2**-7)
    else:
        assert torch.equal(got, want)


def model_with_ops(source, ops, attention: str):
    """The model of ``source`` as the CPU platform builds it in float32, but calling ``ops``
    (a test's choice: the Triton ops under triton's interpreter) and ``attention``."""
    import dataclasses

    from aiolm.model.loader import iter_weights
    from aiolm.model.registry import build_context, build_from_config, finish
    from aiolm.platforms import get_platform

    ctx = build_context(get_platform("cpu"), torch.float32, attention, source.config, source.origin)
    ctx = dataclasses.replace(ctx, ops=ops)
    model = build_from_config(source.config, ctx)
    model.load_weights(iter_weights(source, lazy=True))
    return finish(model, ctx)


def on_device(meta: AttentionMetadata, device: str) -> AttentionMetadata:
    """The same metadata with its tensors on ``device`` (the kernels read them there)."""
    return AttentionMetadata(
        meta.num_tokens,
        meta.query_start_loc.to(device),
        meta.seq_lens.to(device),
        meta.block_table.to(device),
        meta.slot_mapping.to(device),
        meta.query_lens_cpu,
        meta.seq_lens_cpu,
        meta.block_size,
    )
