"""Norms. RMSNorm computed in float32 like the Hugging Face reference, whatever the dtype.

With a ``residual``, the layer first adds it (x + residual) and returns both the
normalised sum and the sum, the new residual stream (the platform's op may do it
in place, and may take x in bfloat16: the output of a bfloat16 matmul).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from aiolm.kernels.ops import TorchOps


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: TorchOps) -> None:
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class LayerNorm(nn.Module):
    """LayerNorm with a bias (encoders and vision towers), in the weight's dtype; replicated.

    With a ``residual`` it normalises x + residual (a post-norm encoder's sublayer output
    and its input) through ``ops``, which may do both in one pass."""

    def __init__(self, size: int, eps: float, ops: TorchOps | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.ops = ops or TorchOps()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if residual is not None:
            return self.ops.add_layer_norm(x, residual, self.weight, self.bias, self.eps)
        return F.layer_norm(x.to(self.weight.dtype), self.weight.shape, self.weight, self.bias, self.eps)
