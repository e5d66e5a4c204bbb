"""Copying checkpoint tensors into parameters, shapes checked."""

from __future__ import annotations

import torch


def copy_weight(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    """Copy ``loaded`` into ``param`` of exactly its shape: ``copy_`` alone broadcasts, so a
    checkpoint's [n, 1] tensor would fill an [n, k] parameter without a word."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"{name}: expected shape {tuple(param.shape)}, got {tuple(loaded.shape)}")
    param.copy_(loaded)
