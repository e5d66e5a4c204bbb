"""The contract between the model runner and attention backends.

The batch is flat: the tokens of all requests back to back, no padding. Request i
owns tokens query_start_loc[i]:query_start_loc[i+1]; they are the *last* query_len
tokens of its sequence of seq_lens[i] tokens, whose KV lives in the pages listed by
block_table[i]. slot_mapping says where each new token's K/V is written
(block_id * block_size + offset). Host-side lists ride along so the CPU backend
never has to synchronise on device tensors.

GPU kernels take the same batch as int32 (``cu_seqlens_q``, ``seq_lens_i32``,
``block_table_i32``) plus ``max_seqlen_q`` / ``max_seqlen_k`` for their grids;
those are made on first use, so backends that do not read them pay nothing.

What is per layer rather than per step (the softmax scale, a sliding window,
logit soft-capping) is given to the backend when the layer is built:

    backend(num_heads, num_kv_heads, head_dim, scale, sliding_window=None, soft_cap=None)

and ``backend.forward(q, k, v, kv_cache, meta)`` writes k/v into the cache by
``slot_mapping`` and returns attention over the pages, ``[num_tokens, heads * head_dim]``.
A query at position p sees the keys at positions j <= p, and with a sliding window
W only those with j > p - W.

An encoder (BERT) calls ``backend.forward_encoder(q, k, v, meta)`` instead: each request's
whole sequence is in the step (query_len == seq_len), every token attends to every token
of its own request in both directions, and no cache is read or written (block_table and
slot_mapping are not used).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


class AttentionBackend:
    """One layer's attention over the paged cache; every backend derives from this.

    The constructor takes what is fixed per layer (module docstring) and checks it once;
    ``forward`` is the per-step work."""

    cuda_graph_safe = False  # True where a CUDA graph can capture forward (no host syncs)
    # An fp8 cache holds k / k_scale and v / v_scale (the checkpoint's per-layer scales, set
    # after loading; 1.0 without them); other caches hold k and v as they are.
    k_scale = 1.0
    v_scale = 1.0

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
    ) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1 key, got {sliding_window}")
        if soft_cap is not None and soft_cap <= 0:
            raise ValueError(f"soft_cap must be positive, got {soft_cap}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.soft_cap = soft_cap
        self.group = num_heads // num_kv_heads

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hk, D] for the new tokens (written by ``slot_mapping``).
        Returns [T, H * D]."""
        raise NotImplementedError

    def forward_encoder(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Bidirectional attention within each request's tokens (``meta.query_start_loc``):
        q: [T, H, D]; k, v: [T, Hk, D]. Returns [T, H * D]; no KV cache involved."""
        raise NotImplementedError

    def check_encoder(self) -> None:
        """Encoder layers have neither a window nor a soft-cap; a backend refuses them here
        rather than attend in a way no encoder family asked for."""
        if self.sliding_window is not None or self.soft_cap is not None:
            raise ValueError("encoder attention takes no sliding_window or soft_cap")


@dataclass
class AttentionMetadata:
    num_tokens: int
    query_start_loc: torch.Tensor  # [num_reqs + 1], int64
    seq_lens: torch.Tensor  # [num_reqs], int64
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req], int64
    slot_mapping: torch.Tensor  # [num_tokens], int64
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    # Flat row ranges [start, end) with their request's index whose queries also see the
    # range's later keys (a Gemma 3 image's tokens attend to each other both ways). Backends
    # attend causally; a layer that wants these redoes their rows (attention/image_spans.py).
    image_spans: list[tuple[int, int, int]] | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    # -- what GPU kernels read: int32 copies, made once per step on first use -----------

    @functools.cached_property
    def cu_seqlens_q(self) -> torch.Tensor:
        return self.query_start_loc.to(torch.int32)

    @functools.cached_property
    def seq_lens_i32(self) -> torch.Tensor:
        return self.seq_lens.to(torch.int32)

    @functools.cached_property
    def block_table_i32(self) -> torch.Tensor:
        return self.block_table.to(torch.int32)

    @property
    def max_seqlen_q(self) -> int:
        return self.max_query_len

    @property
    def max_seqlen_k(self) -> int:
        return self.max_seq_len

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_ids: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build metadata from plain lists (tests and simple callers)."""
        slots: list[int] = []
        for q, s, blocks in zip(query_lens, seq_lens, block_ids):
            for pos in range(s - q, s):
                slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        width = max((len(b) for b in block_ids), default=1) or 1
        table = torch.zeros(len(block_ids), width, dtype=torch.long)
        for i, b in enumerate(block_ids):
            table[i, : len(b)] = torch.tensor(b, dtype=torch.long)
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        return cls(
            num_tokens=qsl[-1],
            query_start_loc=torch.tensor(qsl, dtype=torch.long, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=device),
            block_table=table.to(device),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
            block_size=block_size,
        )
