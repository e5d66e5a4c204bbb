"""The ops model layers call: norms, rotary embedding, SiLU- and GeLU-and-mul.

Layers call the functions at the bottom of this module and never ask what runs
them. Behind them is one implementation object, installed by the worker's
platform (``aiolm/platforms/``): ``TorchOps``, the reference that runs on any
device and dtype, or a subclass that sends the tensors it can take to native
kernels and everything else to the reference. Until a platform installs one,
the CPU platform's ops are used (they fall back to the reference for tensors
that are not float32 on the CPU), so a model built directly in a test or a
script computes the same numbers as in a worker.
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

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual): the normalised sum and the new residual stream."""
        residual = x + residual
        return self.rms_norm(residual, weight, eps), residual

    def rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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


_impl: TorchOps | None = None


def install(impl: TorchOps) -> None:
    """Make ``impl`` run every op of this process (the platform calls this once)."""
    global _impl
    _impl = impl


def current() -> TorchOps:
    if _impl is None:
        from aiolm.platforms import get_platform

        install(get_platform("cpu").ops())
    assert _impl is not None
    return _impl


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return current().rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return current().add_rms_norm(x, residual, weight, eps)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return current().rotary(positions, q, k, cos, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return current().silu_and_mul(x)


def gelu_and_mul(x: torch.Tensor, approximate: str) -> torch.Tensor:
    return current().gelu_and_mul(x, approximate)
