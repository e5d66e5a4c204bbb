"""Rotary position embedding (rotate-half layout), with Llama 3 and linear scaling.

cos/sin are precomputed for every position up to the model length and indexed by
each token's position, so a flat batch of many sequences needs no padding.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from aiolm.kernels.ops import TorchOps


def _inv_freq(dim: int, theta: float, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if not scaling:
        return inv, 1.0
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / float(scaling["factor"]), 1.0
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled), 1.0
    raise ValueError(f"rope_scaling type {kind!r} is not supported; supported: default, linear, llama3")


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None, ops: TorchOps
    ) -> None:
        super().__init__()
        self.ops = ops
        inv, _ = _inv_freq(head_dim, theta, scaling)
        pos = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(pos, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, Hk, D], positions: [T]. May rotate q and k in place."""
        return self.ops.rotary(positions, q, k, self.cos, self.sin)
