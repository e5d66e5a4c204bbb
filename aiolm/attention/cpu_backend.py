"""Paged attention on the CPU through aiolm's C++ kernel, with torch as the fallback.

The kernel reads K/V pages in place for decode rows and prefill chunks in one
call; the torch reference gathers pages into contiguous tensors first, which on
a many-request decode step costs more than the attention itself.

An encoder's step (``forward_encoder``) has no pages: every request's queries meet its
keys in one C++ call over the flat batch (``aiolm::encoder_attention``, float32 or
bfloat16 in, float32 arithmetic); without the kernels, two batched matmuls a request with
a softmax between, which on short sequences costs a fraction of SDPA's per-call overhead.
"""

from __future__ import annotations

import torch

from aiolm.attention.metadata import AttentionMetadata
from aiolm.attention.torch_backend import FP8, TorchAttention, write_kv
from aiolm.kernels import cpu as cpu_kernels


class CpuPagedAttention(TorchAttention):
    """Uses ``torch.ops.aiolm.paged_attention`` for float32 CPU tensors over a float32,
    float16 or fp8 cache, else the torch path.

    The kernels are built on the first float32 CPU call, never for a model on another device."""

    _pages_of: torch.Tensor | None = None
    _pages: tuple[torch.Tensor, torch.Tensor] = ()  # type: ignore[assignment]

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        if not (cpu_kernels.ready(q) and kv_cache.dtype in (torch.float32, torch.float16, FP8)):
            return super().forward(q, k, v, kv_cache, meta)
        fp8 = kv_cache.dtype == FP8
        if fp8:  # rounded by torch; the kernel reads the bytes (k / k_scale) and scales the scores
            write_kv(kv_cache, k, v, meta.slot_mapping, self.k_scale, self.v_scale)
        else:
            torch.ops.aiolm.write_kv_(kv_cache, k, v, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype)  # dense, whatever q's strides (a view of qkv)
        torch.ops.aiolm.paged_attention(
            out,
            q,
            *self.pages(kv_cache),
            meta.block_table,
            meta.query_start_loc,
            meta.seq_lens,
            self.scale * self.k_scale if fp8 else self.scale,
            self.sliding_window or 0,
            self.soft_cap or 0.0,
        )
        if fp8 and self.v_scale != 1.0:
            out.mul_(self.v_scale)
        return out.view(q.shape[0], self.num_heads * self.head_dim)

    def forward_encoder(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hk, D], requests back to back. Returns [T, H * D]."""
        self.check_encoder()
        if cpu_kernels.ready(q, bf16_too=True) and q.dtype == k.dtype == v.dtype:
            out = torch.empty(q.shape, dtype=q.dtype)
            torch.ops.aiolm.encoder_attention(out, q, k, v, meta.query_start_loc, self.scale)
            return out.view(q.shape[0], self.num_heads * self.head_dim)
        t, hk, g, d = q.shape[0], self.num_kv_heads, self.group, self.head_dim
        out = torch.empty(t, hk, g, d, dtype=q.dtype, device=q.device)
        s0 = 0
        for n in meta.query_lens_cpu:
            if n:
                # the group's query heads as rows of one matrix per kv head: [Hk, G * n, D]
                qs = q[s0 : s0 + n].view(n, hk, g, d).permute(1, 2, 0, 3).reshape(hk, g * n, d)
                scores = torch.bmm(qs, k[s0 : s0 + n].permute(1, 2, 0)).mul_(self.scale)  # [Hk, G * n, n]
                o = torch.bmm(torch.softmax(scores, dim=-1), v[s0 : s0 + n].transpose(0, 1))
                out[s0 : s0 + n] = o.view(hk, g, n, d).permute(2, 0, 1, 3)
            s0 += n
        return out.view(t, self.num_heads * d)

    def pages(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache's K and V halves, taken once per cache (two views less per step)."""
        if kv_cache is not self._pages_of:
            self._pages_of, self._pages = kv_cache, (kv_cache[0], kv_cache[1])
        return self._pages
