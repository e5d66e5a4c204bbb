"""Platforms: the only place that asks what hardware this is.

A worker picks its platform once, from its device, and from then on asks it for
the default and KV-cache dtypes, the attention backend, the ops behind model
layers, the weight preparation that follows loading, the tensor-parallel group
and how much memory the KV cache gets. Model code reads the same on every device.
"""

from __future__ import annotations

import torch

from aiolm.platforms.base import Platform

_platforms: dict[str, Platform] = {}


def get_platform(device: torch.device | str) -> Platform:
    """The platform of ``device`` ('cpu', 'cuda', 'cuda:1'); one object per device type."""
    kind = torch.device(device).type
    if kind not in _platforms:
        if kind == "cpu":
            from aiolm.platforms.cpu import CpuPlatform

            _platforms[kind] = CpuPlatform()
        elif kind == "cuda":
            from aiolm.platforms.cuda import CudaPlatform

            _platforms[kind] = CudaPlatform()
        else:
            raise ValueError(f"device {str(device)!r} is not supported; supported: cpu, cuda")
    return _platforms[kind]


__all__ = ["Platform", "get_platform"]
