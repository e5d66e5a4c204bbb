"""Paged attention on the CPU through aiolm's C++ kernel, with torch as the fallback.

The kernel reads K/V pages in place for decode rows and prefill chunks in one
call; the torch reference gathers pages into contiguous tensors first, which on
a many-request decode step costs more than the attention itself.
"""

from __future__ import annotations

import torch

from aiolm.attention.metadata import AttentionMetadata
from aiolm.attention.torch_backend import TorchAttention
from aiolm.kernels import cpu as cpu_kernels


class CpuPagedAttention(TorchAttention):
    """Uses ``torch.ops.aiolm.paged_attention`` for float32 CPU tensors over a float32 or
    float16 cache, else the torch path.

    The kernels are built on the first float32 CPU call, never for a model on another device."""

    _pages_of: torch.Tensor | None = None
    _pages: tuple[torch.Tensor, torch.Tensor] = ()  # type: ignore[assignment]

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        if not (cpu_kernels.ready(q) and kv_cache.dtype in (torch.float32, torch.float16)):
            return super().forward(q, k, v, kv_cache, meta)
        torch.ops.aiolm.write_kv_(kv_cache, k, v, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype)  # dense, whatever q's strides (a view of qkv)
        torch.ops.aiolm.paged_attention(
            out,
            q,
            *self.pages(kv_cache),
            meta.block_table,
            meta.query_start_loc,
            meta.seq_lens,
            self.scale,
            self.sliding_window or 0,
            self.soft_cap or 0.0,
        )
        return out.view(q.shape[0], self.num_heads * self.head_dim)

    def pages(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache's K and V halves, taken once per cache (two views less per step)."""
        if kv_cache is not self._pages_of:
            self._pages_of, self._pages = kv_cache, (kv_cache[0], kv_cache[1])
        return self._pages
