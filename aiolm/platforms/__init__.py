"""Platforms: the only place that asks what hardware this is.

A worker picks its platform once, from its device, and from then on asks it for the
default and KV-cache dtypes, its memory, the tensor-parallel group, and which ops,
attention backend and quant method a model built there gets (the builder hands those to
the model). Model code reads the same on every device. A platform imports no model code.
"""

from __future__ import annotations

import torch

from aiolm.platforms.base import Platform

_platforms: dict[tuple[str, bool], Platform] = {}


def get_platform(device: torch.device | str, reference: bool = False) -> Platform:
    """The platform of ``device`` ('cpu', 'cuda', 'cuda:1'; one object per device type), or
    with ``reference`` the torch reference platform on it (plain torch ops and attention,
    dense weights: what every native path is tested against). 'torch' names the reference
    platform on the CPU."""
    if str(device) == "torch":
        device, reference = "cpu", True
    kind = torch.device(device).type
    key = (kind, reference)
    if key not in _platforms:
        if reference:
            _platforms[key] = Platform(kind)
        elif kind == "cpu":
            from aiolm.platforms.cpu import CpuPlatform

            _platforms[key] = CpuPlatform()
        elif kind == "cuda":
            from aiolm.platforms.cuda import CudaPlatform

            _platforms[key] = CudaPlatform()
        else:
            raise ValueError(f"device {str(device)!r} is not supported; supported: cpu, cuda")
    return _platforms[key]


def current_platform() -> Platform:
    """The platform of this machine's best device: CUDA where torch sees a GPU, else the CPU."""
    return get_platform("cuda" if torch.cuda.is_available() else "cpu")


__all__ = ["Platform", "current_platform", "get_platform"]
