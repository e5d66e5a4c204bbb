"""The ops model layers call: norms (RMS, and LayerNorm after a residual add), rotary embedding, SiLU- and GeLU-and-mul.

A layer calls the ops object its model was built with (``BuildContext.ops``,
aiolm/model/layers/context.py) and never asks what runs it. ``TorchOps`` is the
reference that runs on any device and dtype; a platform's ops subclass it and send
the tensors their native kernels take to those kernels, everything else to the
reference (cpu_ops.py, triton/ops.py). There is no process-wide choice: two models
built on different platforms each call their own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class TorchOps:
    """Plain torch: the reference every native op is tested against."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * x / rms(x), computed in float32 and rounded to x's dtype, as transformers does."""
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual): the normalised sum and the new residual stream."""
        residual = x + residual
        return self.rms_norm(residual, weight, eps), residual

    def add_layer_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """layer_norm(x + residual) in residual's dtype: a post-norm encoder's next residual
        stream (x may be a matmul's output in a lower precision)."""
        return F.layer_norm(residual + x.to(residual.dtype), weight.shape, weight, bias, eps)

    def rotary(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate-half RoPE of q [T, H, D] and k [T, Hk, D] at ``positions``; may work in place."""
        c = cos.index_select(0, positions).unsqueeze(1).to(q.dtype)
        s = sin.index_select(0, positions).unsqueeze(1).to(q.dtype)
        return _rotate(q, c, s), _rotate(k, c, s)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for x = [gate | up]."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_and_mul(self, x: torch.Tensor, approximate: str) -> torch.Tensor:
        """gelu(gate) * up for x = [gate | up]; ``approximate`` as F.gelu takes it ('tanh' or 'none')."""
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=approximate) * up


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
