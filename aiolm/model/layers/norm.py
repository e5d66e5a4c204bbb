"""RMSNorm computed in float32 like the Hugging Face reference, whatever the dtype.

With a ``residual``, the layer first adds it (x + residual) and returns both the
normalised sum and the sum, the new residual stream; on float32 CPU tensors that
is one fused kernel that works in place (x may be bfloat16 there: the output of
a bfloat16 matmul, turned into the input of the next one).
"""

from __future__ import annotations

import torch
from torch import nn

from aiolm.kernels import cpu as cpu_kernels


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.dim() == 2 and cpu_kernels.ready(residual if residual is not None else x) \
                and self.weight.dtype == torch.float32:
            if residual is None:
                return torch.ops.aiolm.rms_norm(x, self.weight, self.eps)
            # x may be a bfloat16 matmul's output: the normalised sum then comes back in
            # bfloat16, rounded as the next bfloat16 matmul would round its input
            torch.ops.aiolm.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
