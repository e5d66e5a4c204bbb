"""Dense weights in the model's dtype, multiplied by ``F.linear``: the method of every
platform that has no better layout, and of the torch reference platform. Layers of experts
run one expert at a time in torch, or with ``experts="triton"`` as the fused Triton kernel
(aiolm/kernels/triton/moe.py: tokens sorted by expert, one grouped GEMM for gate/up and
one for down)."""

from __future__ import annotations

import torch
from torch import nn

from aiolm.quant.base import ExpertsMethod, ExpertsSpec, LinearMethod, LinearSpec, QuantConfig


class TritonExpertsMethod(ExpertsMethod):
    """The layer's plain expert weights run by the fused Triton kernel."""

    def apply(
        self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        from aiolm.kernels.triton.moe import fused_moe

        return fused_moe(x.to(layer.w13.dtype), layer.w13, layer.w2, topk_weights, topk_ids).float()


class DenseConfig(QuantConfig):
    name = "dense"

    def __init__(self, experts: str = "torch") -> None:
        if experts not in ("torch", "triton"):
            raise ValueError(f"experts method {experts!r} is not known; known: torch, triton")
        self.experts = experts

    def linear_method(self, spec: LinearSpec) -> LinearMethod:
        return LinearMethod()

    def experts_method(self, spec: ExpertsSpec) -> ExpertsMethod:
        return TritonExpertsMethod() if self.experts == "triton" else ExpertsMethod()
