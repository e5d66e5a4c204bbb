"""The ops of ``aiolm.kernels.ops`` on the fused Triton kernels, for the CUDA platform.

Same call contract as ``TorchOps`` (results in the dtype the reference gives, q/k and
x/residual possibly updated in place, as the layers allow); a call the kernels do not
cover (a dtype pair the reference would promote, a layout they cannot index, a tensor
on a device they cannot reach) goes to the reference. Kernels run on CUDA tensors, and
on CPU tensors only under triton's interpreter (TRITON_INTERPRET=1, the tests).
"""

from __future__ import annotations

import torch

from aiolm.kernels.ops import TorchOps
from aiolm.kernels.triton import activation, interpreting, norm, rope

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with a contiguous last dim (a copy only when it must)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


class TritonOps(TorchOps):
    def __init__(self) -> None:
        self._cpu_too = interpreting()

    def _reach(self, *ts: torch.Tensor) -> bool:
        """All of ``ts`` are floating tensors the kernels can read where they are."""
        return all(t.dtype in _FLOATS and (t.is_cuda or (self._cpu_too and t.device.type == "cpu")) for t in ts)

    def _norm_ok(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        # a weight of another dtype makes the reference promote its result; the kernel keeps x's
        return (
            self._reach(x, weight)
            and weight.dtype == x.dtype
            and weight.dim() == 1
            and weight.stride(0) == 1
            and x.dim() >= 1
            and x.shape[-1] == weight.shape[0]
        )

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not self._norm_ok(x, weight):
            return super().rms_norm(x, weight, eps)
        return norm.rms_norm(_rows(x), weight, eps).reshape(x.shape)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # in place on both: their rows must be addressable as (row stride, contiguous cols) and distinct
        if (
            self._norm_ok(x, weight)
            and self._reach(residual)
            and x.dim() == 2
            and x.shape == residual.shape
            and residual.dtype == x.dtype
            and x.stride(1) == 1
            and residual.stride(1) == 1
            and x.data_ptr() != residual.data_ptr()
        ):
            norm.add_rms_norm_(x, residual, weight, eps)
            return x, residual
        return super().add_rms_norm(x, residual, weight, eps)

    def rotary(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # cos/sin are the duplicated [max_pos, head_dim] tables of aiolm/model/layers/rotary.py
        # (the kernel reads their first half); the whole head dim is rotated, neox layout
        d = q.shape[-1]
        if (
            self._reach(q, k, cos, sin)
            and q.dim() == 3
            and k.dim() == 3
            and d % 2 == 0
            and k.shape[-1] == d
            and cos.shape[-1] == d
            and sin.shape[-1] == d
            and positions.dim() == 1
            and q.shape[0] == k.shape[0] == positions.shape[0]
            and positions.device == q.device
            and not positions.is_floating_point()
            and positions.stride(0) == 1
            and q.stride(2) == 1
            and k.stride(2) == 1
            and cos.stride(1) == 1
            and sin.stride(1) == 1
        ):
            rope.rotary_(q, k, positions, cos, sin, is_neox=True)
            return q, k
        return super().rotary(positions, q, k, cos, sin)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if not (self._reach(x) and x.dim() >= 1 and x.shape[-1] % 2 == 0):
            return super().silu_and_mul(x)
        return activation.silu_and_mul(_rows(x)).reshape(*x.shape[:-1], x.shape[-1] // 2)

    def gelu_and_mul(self, x: torch.Tensor, approximate: str) -> torch.Tensor:
        if not (approximate == "tanh" and self._reach(x) and x.dim() >= 1 and x.shape[-1] % 2 == 0):
            return super().gelu_and_mul(x, approximate)
        return activation.gelu_tanh_and_mul(_rows(x)).reshape(*x.shape[:-1], x.shape[-1] // 2)
