"""Paged attention through the Triton kernels (aiolm/kernels/triton/): the GPU backend.

Same call as the other backends (torch_backend.py, cpu_backend.py): write the new
tokens' K/V by ``slot_mapping``, then attend over the paged cache, for a flat batch
that mixes prefill chunks, prefix hits and decode rows in one kernel launch. Adds the
per-layer options some families need: a sliding window and logit soft-capping. An
encoder's step (``forward_encoder``) runs the varlen bidirectional kernel
(kernels/triton/encoder_attention.py) over the step's own K/V, with no cache.

The kernels take int32 metadata; int64 tensors (what ``AttentionMetadata.build`` makes)
are converted on each call, so a runner that builds int32 metadata pays nothing. The
grid and the split-KV choice read the host lists (``query_lens_cpu``, ``seq_lens_cpu``),
never device tensors, so nothing here synchronises with the GPU; under a CUDA graph
those lists must describe the worst case the graph will replay (see worker/cuda_graph.py).

Import this module only where triton is installed (``aiolm.kernels.triton.available()``).
"""

from __future__ import annotations

import torch

from aiolm.attention.metadata import AttentionBackend, AttentionMetadata
from aiolm.attention.torch_backend import FP8
from aiolm.kernels.triton.attention import choose_num_splits, paged_attention
from aiolm.kernels.triton.cache import write_kv
from aiolm.kernels.triton.encoder_attention import encoder_attention


class TritonAttention(AttentionBackend):
    """GQA paged attention; ``sliding_window`` W: a query at position p sees keys in
    (p - W, p]; ``soft_cap`` c: scores become tanh(s / c) * c before the softmax."""

    cuda_graph_safe = True  # no host reads of device tensors, no allocation that depends on the data

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, sliding_window, soft_cap)
        self._target_programs: int | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hk, D] for the new tokens. Returns [T, H * D]."""
        fp8 = kv_cache.dtype == FP8  # the cache holds k / k_scale, v / v_scale
        write_kv(kv_cache, k, v, meta.slot_mapping, self.k_scale, self.v_scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        splits = choose_num_splits(
            meta.num_reqs,
            self.num_kv_heads,
            meta.max_query_len,
            meta.max_seq_len,
            meta.block_size,
            self._programs_to_fill(q.device),
        )
        paged_attention(
            out,
            q,
            kv_cache[0],
            kv_cache[1],
            meta.block_table_i32,
            meta.cu_seqlens_q,
            meta.seq_lens_i32,
            meta.max_seqlen_q,
            self.scale * self.k_scale if fp8 else self.scale,
            window=self.sliding_window,
            soft_cap=self.soft_cap,
            num_splits=splits,
        )
        if fp8 and self.v_scale != 1.0:
            out.mul_(self.v_scale)
        return out.view(q.shape[0], self.num_heads * self.head_dim)

    def forward_encoder(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hk, D], requests back to back. Returns [T, H * D]."""
        self.check_encoder()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        encoder_attention(out, q, k, v, meta.cu_seqlens_q, meta.max_seqlen_q, self.scale)
        return out.view(q.shape[0], self.num_heads * self.head_dim)

    def _programs_to_fill(self, device: torch.device) -> int:
        """Two programs per streaming multiprocessor keep a GPU busy; a fixed guess elsewhere."""
        if self._target_programs is None:
            if device.type == "cuda":
                self._target_programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
            else:
                self._target_programs = 128
        return self._target_programs
