"""Small constructors for the per-row tensors that sampling state is made of."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def long_tensor(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """A 1-D int64 tensor of ``values``."""
    return torch.tensor(list(values), dtype=torch.long, device=device)


def float_column(values: Sequence[float], device: torch.device) -> torch.Tensor:
    """A float32 [len(values), 1] column: one value per row, broadcast over the vocabulary."""
    return torch.tensor(list(values), dtype=torch.float32, device=device).unsqueeze(1)
