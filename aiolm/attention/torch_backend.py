"""Reference attention over a paged KV cache, in plain torch (the CPU path).

KV cache layout per layer: [2, num_blocks, block_size, num_kv_heads, head_dim].
Decode rows (one query token) are computed together as one batched, masked
attention; rows with several query tokens (prefill chunks) one request at a time
with a causal mask offset by the context already in the cache.

An encoder's step (``forward_encoder``) attends within each request's tokens in both
directions, one request at a time, and touches no cache.

Per layer, a backend may have a sliding window (a query at position p sees keys j
with p - window < j <= p, Hugging Face's convention) and a tanh soft-cap of the
scaled scores; both are off (None) by default.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from aiolm.attention.metadata import AttentionBackend, AttentionMetadata


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value: larger ones saturate (a plain cast would make NaN)


def to_cache(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """New K or V in the cache's element type: fp8 holds x / scale, rounded to nearest."""
    if dtype != FP8:
        return x.to(dtype)
    x = x.float() if scale == 1.0 else x.float() / scale
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def write_kv(
    kv_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    _, nb, bs, hk, d = kv_cache.shape
    k, v = to_cache(k, kv_cache.dtype, k_scale), to_cache(v, kv_cache.dtype, v_scale)
    if kv_cache.dtype == FP8:  # torch copies float8 by index only as bytes
        kv_cache, k, v = kv_cache.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
    kv_cache[0].view(nb * bs, hk, d).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(nb * bs, hk, d).index_copy_(0, slot_mapping, v)


def from_cache(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Cached K or V as ``dtype`` values: an fp8 cache's times its scale."""
    y = x.to(dtype)
    return y * scale if x.dtype == FP8 and scale != 1.0 else y


class TorchAttention(AttentionBackend):
    """Paged attention with GQA; the reference every other backend is tested against."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hk, D] for the new tokens. Returns [T, H * D]."""
        write_kv(kv_cache, k, v, meta.slot_mapping, self.k_scale, self.v_scale)
        out = torch.empty_like(q)
        qlens, slens = meta.query_lens_cpu, meta.seq_lens_cpu
        decode_rows = [i for i, n in enumerate(qlens) if n == 1]
        if decode_rows:
            self._decode(q, kv_cache, meta, decode_rows, out)
        if len(decode_rows) != len(qlens):
            starts = meta.query_start_loc.tolist()
            for i, n in enumerate(qlens):
                if n > 1:
                    s0 = starts[i]
                    out[s0 : s0 + n] = self._prefill(
                        q[s0 : s0 + n], kv_cache, meta.block_table[i], slens[i], meta.block_size
                    )
        return out.view(q.shape[0], self.num_heads * self.head_dim)

    def forward_encoder(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hk, D], requests back to back. Returns [T, H * D]."""
        self.check_encoder()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        s0 = 0
        for n in meta.query_lens_cpu:  # the host's copy: no device sync
            if n:
                out[s0 : s0 + n] = self._bidirectional(q[s0 : s0 + n], k[s0 : s0 + n], v[s0 : s0 + n])
            s0 += n
        return out.view(q.shape[0], self.num_heads * self.head_dim)

    def _bidirectional(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One request: [n, H, D] queries over its [n, Hk, D] keys, no mask."""
        qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        if self.group > 1:
            kh = kh.repeat_interleave(self.group, dim=0)
            vh = vh.repeat_interleave(self.group, dim=0)
        return F.scaled_dot_product_attention(qh, kh, vh, scale=self.scale).transpose(0, 1)

    def _gather(
        self, kv_cache: torch.Tensor, blocks: torch.Tensor, seq_len: int, block_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        nblk = (seq_len + block_size - 1) // block_size
        ids = blocks[:nblk]
        k = kv_cache[0].index_select(0, ids).reshape(-1, self.num_kv_heads, self.head_dim)[:seq_len]
        v = kv_cache[1].index_select(0, ids).reshape(-1, self.num_kv_heads, self.head_dim)[:seq_len]
        return k, v  # in the cache's dtype: _prefill computes in q's

    def _prefill(
        self, q: torch.Tensor, kv_cache: torch.Tensor, blocks: torch.Tensor, seq_len: int, block_size: int
    ) -> torch.Tensor:
        n = q.shape[0]
        k, v = self._gather(kv_cache, blocks, seq_len, block_size)
        k, v = from_cache(k, q.dtype, self.k_scale), from_cache(v, q.dtype, self.v_scale)
        qh = q.transpose(0, 1)  # [H, n, D]
        kh = k.transpose(0, 1)
        vh = v.transpose(0, 1)
        if self.group > 1:
            kh = kh.repeat_interleave(self.group, dim=0)
            vh = vh.repeat_interleave(self.group, dim=0)
        if n == seq_len and self.sliding_window is None and self.soft_cap is None:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale)
        else:
            rows = torch.arange(n, device=q.device).unsqueeze(1) + (seq_len - n)  # query positions
            cols = torch.arange(seq_len, device=q.device).unsqueeze(0)
            o = self._attend(qh, kh, vh, self._visible(rows, cols))
        return o.transpose(0, 1)

    def _visible(self, pos: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Which keys a query at ``pos`` sees: causal, and within the window if there is one."""
        mask = keys <= pos
        if self.sliding_window is not None:
            mask &= keys > pos - self.sliding_window
        return mask

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, **sdpa: bool
    ) -> torch.Tensor:
        """softmax(cap(q k^T * scale) masked) v; SDPA when there is no soft-cap to apply."""
        if self.soft_cap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, **sdpa)
        if self.group > 1 and k.shape[-3] != q.shape[-3]:
            k = k.repeat_interleave(self.group, dim=-3)
            v = v.repeat_interleave(self.group, dim=-3)
        s = (q @ k.transpose(-1, -2)) * self.scale
        s = torch.tanh(s / self.soft_cap) * self.soft_cap
        s = s.masked_fill(~mask, float("-inf"))
        return torch.softmax(s, dim=-1) @ v

    def _decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, rows: list[int], out: torch.Tensor
    ) -> None:
        bs = meta.block_size
        if len(rows) == meta.num_reqs:
            tok = meta.query_start_loc[:-1]
            rows_t = None
        else:
            rows_t = torch.tensor(rows, dtype=torch.long, device=q.device)
            tok = meta.query_start_loc.index_select(0, rows_t)
        slens = [meta.seq_lens_cpu[i] for i in rows]
        max_len = max(slens)
        nblk = (max_len + bs - 1) // bs
        table = meta.block_table[:, :nblk] if rows_t is None else meta.block_table.index_select(0, rows_t)[:, :nblk]
        b = len(rows)
        hk, d = self.num_kv_heads, self.head_dim
        flat = table.reshape(-1)  # index_select copies pages far faster than advanced indexing
        k = from_cache(kv_cache[0].index_select(0, flat), q.dtype, self.k_scale)
        v = from_cache(kv_cache[1].index_select(0, flat), q.dtype, self.v_scale)
        k = k.view(b, nblk * bs, hk, d).transpose(1, 2)  # [B, Hk, L, D]
        v = v.view(b, nblk * bs, hk, d).transpose(1, 2)
        pos = torch.tensor(slens, device=q.device).view(b, 1) - 1  # each row's query position
        mask = self._visible(pos, torch.arange(nblk * bs, device=q.device).view(1, -1)).view(b, 1, 1, -1)
        qb = q.index_select(0, tok).view(b, self.num_heads, 1, d)
        o = self._attend(qb, k, v, mask, enable_gqa=self.group > 1).view(b, self.num_heads, d)
        out.index_copy_(0, tok, o)
