"""The sum a layer of experts computes, one expert at a time in plain torch: the reference
every fused MoE kernel is tested against, and the path of a platform without one."""

from __future__ import annotations

import torch
from torch import nn


def experts_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * w2[e] @ (silu(w13[e, :I] @ x[t]) * w13[e, I:] @ x[t]), e = topk_ids[t, j],
    one expert at a time in ascending order as transformers sums them; ids outside [0, E)
    (experts of another rank) add nothing. float32 out."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    if x.shape[0] == 0:
        return out
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    num = w13.shape[0]
    counts = torch.bincount(flat.clamp(-1, num) + 1, minlength=num + 2).tolist()  # [not here, 0 .. E-1, past E]
    k = topk_ids.shape[1]
    start = counts[0]  # the sort puts the -1s first
    for e, n in enumerate(counts[1 : num + 1]):
        if n:
            pairs = order[start : start + n]
            tokens = pairs // k
            gate, up = nn.functional.linear(x[tokens].to(w13.dtype), w13[e]).chunk(2, dim=-1)
            y = nn.functional.linear(nn.functional.silu(gate) * up, w2[e]).float()
            out.index_add_(0, tokens, y * topk_weights.reshape(-1)[pairs, None].float())
        start += n
    return out
