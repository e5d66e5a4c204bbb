"""Attention for query rows that also see later keys of their own span: a Gemma 3 image's
placeholder tokens attend to every token of the image, both ways, as transformers' mask
for ``token_type_ids`` lets them.

Backends attend causally. A layer whose model marks such spans runs its backend first
(which writes the step's K/V into the cache and fills every row causally) and then redoes
each span's rows here in plain torch, reading the request's keys from the paged cache up to
the span's end: the span is whole in the step (the scheduler keeps an image's placeholders
in one chunk), so every key it needs is cached by then. The cost is one small dense
attention per image per layer, in prefill steps only.
"""

from __future__ import annotations

import torch

from aiolm.attention.metadata import AttentionBackend, AttentionMetadata
from aiolm.attention.torch_backend import from_cache


def attend_within_spans(
    out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, backend: AttentionBackend
) -> None:
    """Rewrite ``out`` [T, H * D] in place for ``meta.image_spans``' rows: query q (at position
    p) sees every cached key j of its request with j < the span's end position, within the
    backend's sliding window (j > p - window) where it has one. ``q``: [T, H, D]."""
    assert meta.image_spans is not None
    bs = meta.block_size
    hk, group, d = backend.num_kv_heads, backend.group, backend.head_dim
    ends = meta.query_start_loc.tolist()
    for start, end, seq in meta.image_spans:
        last = meta.seq_lens_cpu[seq] - (ends[seq + 1] - end)  # keys [0, last) are visible
        blocks = meta.block_table[seq, : -(-last // bs)]
        k = from_cache(kv_cache[0][blocks].reshape(-1, hk, d)[:last], q.dtype, getattr(backend, "k_scale", 1.0))
        v = from_cache(kv_cache[1][blocks].reshape(-1, hk, d)[:last], q.dtype, getattr(backend, "v_scale", 1.0))
        n = end - start
        qs = q[start:end].reshape(n, hk, group, d).permute(1, 2, 0, 3).reshape(hk, group * n, d)
        scores = torch.bmm(qs.float(), k.permute(1, 2, 0).float()) * backend.scale  # [Hk, G * n, last]
        if backend.soft_cap is not None:
            scores = backend.soft_cap * torch.tanh(scores / backend.soft_cap)
        window = backend.sliding_window
        if window is not None:
            pos = torch.arange(n, device=q.device) + (last - n)
            keys = torch.arange(last, device=q.device)
            hidden = keys[None, :] <= pos[:, None] - window  # [n, last]
            scores = scores.view(hk, group, n, last).masked_fill(hidden, float("-inf")).view(hk, group * n, last)
        probs = torch.softmax(scores, dim=-1)
        o = torch.bmm(probs, v.transpose(0, 1).float())  # [Hk, G * n, D]
        out[start:end] = o.view(hk, group, n, d).permute(2, 0, 1, 3).reshape(n, -1).to(out.dtype)
