"""The ops of ``TorchOps`` on aiolm's C++ kernels (ext/cpu), for the CPU platform.

Each op takes the float32 CPU tensors its kernel takes and sends anything else to
the reference; build it only once ``aiolm.kernels.cpu.load()`` succeeded.
"""

from __future__ import annotations

import torch

from aiolm.kernels.ops import TorchOps


def _f32_cpu(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu"


class CpuKernelOps(TorchOps):
    """The C++ kernels for the float32 CPU tensors they take; anything else goes to the reference."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() == 2 and _f32_cpu(x) and weight.dtype == torch.float32:
            return torch.ops.aiolm.rms_norm(x, weight, eps)
        if x.dim() > 2 and _f32_cpu(x) and weight.dtype == torch.float32:  # per head: Qwen3's q_norm, k_norm
            return torch.ops.aiolm.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # x may be a bfloat16 matmul's output: the normalised sum then comes back in
        # bfloat16, rounded as the next bfloat16 matmul would round its input
        if x.dim() == 2 and _f32_cpu(residual) and weight.dtype == torch.float32:
            torch.ops.aiolm.add_rms_norm_(x, residual, weight, eps)
            return x, residual
        return super().add_rms_norm(x, residual, weight, eps)

    def add_layer_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
    ) -> torch.Tensor:
        # one pass that reads a bfloat16 matmul's output as it comes, where torch would
        # cast it, add and normalise in three
        if (
            x.dim() == 2
            and x.dtype in (torch.float32, torch.bfloat16)
            and _f32_cpu(residual)
            and weight.dtype == bias.dtype == torch.float32
        ):
            return torch.ops.aiolm.add_layer_norm(x, residual, weight, bias, eps)
        return super().add_layer_norm(x, residual, weight, bias, eps)

    def rotary(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if _f32_cpu(q) and cos.dtype == torch.float32:
            torch.ops.aiolm.rotary_(q, k, positions, cos, sin)
            return q, k
        return super().rotary(positions, q, k, cos, sin)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
            return torch.ops.aiolm.silu_and_mul(x)
        return super().silu_and_mul(x)
