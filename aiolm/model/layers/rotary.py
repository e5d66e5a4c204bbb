"""Rotary position embedding (rotate-half layout), with linear, Llama 3 and YaRN scaling.

cos/sin are precomputed for every position up to the model length and indexed by
each token's position, so a flat batch of many sequences needs no padding.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from aiolm.checkpoint.config import ROPE_TYPES
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
    if kind == "yarn":
        return _yarn(dim, theta, scaling)
    raise ValueError(f"rope_scaling type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(dim: int, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as transformers computes it: the fastest-turning frequencies kept,
    the slowest divided by ``factor``, a linear ramp between, and cos/sin scaled by the
    attention factor (0.1 ln(factor) + 1 unless the config states it)."""
    factor = float(scaling["factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention = _yarn_mscale(factor)
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def turns_at(rotations: float) -> float:  # the dimension that turns ``rotations`` times in old_len
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = turns_at(fast), turns_at(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the frequency as trained), 0: interpolate (divided by factor)
    pos = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)  # transformers' rounding
    return 1.0 / (factor * pos) * (1 - keep) + 1.0 / pos * keep, float(attention)


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None, ops: TorchOps
    ) -> None:
        super().__init__()
        self.ops = ops
        inv, attention = _inv_freq(head_dim, theta, scaling)
        pos = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(pos, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * attention, persistent=False)
        self.register_buffer("sin", emb.sin() * attention, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, Hk, D], positions: [T]. May rotate q and k in place."""
        return self.ops.rotary(positions, q, k, self.cos, self.sin)
