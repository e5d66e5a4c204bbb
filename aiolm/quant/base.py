"""What a linear layer's quant method is, and what chooses one for each layer of a model.

A linear layer (aiolm/model/layers/linear.py) asks its model's ``QuantConfig`` for a
``LinearMethod`` when it is constructed, as vLLM's layers do, and from then on the method
owns the layer's weights: ``create_weights`` gives the layer the parameters the loader
fills, ``process_weights_after_loading`` lays them out for the kernel once they are in
place (on the model's device and dtype), and ``apply`` is the multiply. The layer only
passes x and its bias through; the output's dtype is the method's business.

A mixture-of-experts layer (aiolm/model/layers/fused_moe.py) gets an ``ExpertsMethod`` the
same way: its experts' weights, their layout, and one call that runs every routed expert
over its tokens and combines them with the routing weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from aiolm.kernels.moe_reference import experts_reference


@dataclass(frozen=True)
class LinearSpec:
    """What a quant config may need to know of one linear layer to choose its method."""

    # The checkpoint's (Hugging Face) tensors fused into this layer, without ".weight":
    # ("model.layers.0.self_attn.q_proj", "...k_proj", "...v_proj"); for a tied LM head
    # the embedding's
    names: tuple[str, ...]
    lm_head: bool = False
    # The op after this layer reads a low-precision matmul output as it comes (the
    # activation, the fused residual norm); QKV's output goes to RoPE and attention instead
    output_to_kernel: bool = False
    # The weight is also another layer's (a tied LM head's is the embedding's): a method
    # that lays out a copy of it must keep the original
    shared_weight: bool = False


class LinearMethod:
    """Plain weights [out, in] multiplied by ``F.linear``: any device, any dtype."""

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once, after loading, with the layer's weights on its device and in its dtype."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return nn.functional.linear(x.to(layer.weight.dtype), layer.weight, bias)

    def fuses(self, layer: nn.Module, activation: str) -> bool:
        """Whether ``apply(layer, x, bias, activation=activation)`` computes the activation
        (a ``hidden_act`` name) of y itself, sparing the layer a pass of its own over y."""
        return False


@dataclass(frozen=True)
class ExpertsSpec:
    """What a quant config may need to know of one layer of experts to choose its method."""

    prefix: str  # the checkpoint's name of the layer's experts: "model.layers.3.mlp.experts"
    num_experts: int  # in the checkpoint, all ranks together
    expert_start: int  # the first of this rank's experts (expert parallelism), else 0


class ExpertsMethod:
    """Plain expert weights (w13 [E, 2I, H]: each expert's gate rows above its up rows;
    w2 [E, H, I]) run one expert at a time by ``experts_reference``: any device, any dtype."""

    def create_weights(self, layer: nn.Module, num_experts: int, hidden: int, intermediate: int) -> None:
        layer.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden), requires_grad=False)
        layer.w2 = nn.Parameter(torch.empty(num_experts, hidden, intermediate), requires_grad=False)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once, after loading, with the layer's weights on its device and in its dtype."""

    def apply(
        self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """The layer's output for x [T, H] routed to topk_ids (this rank's numbering, -1: not
        here) with topk_weights (float32 [T, k]); float32 [T, H], before any all-reduce."""
        return experts_reference(x, layer.w13, layer.w2, topk_weights, topk_ids)


class QuantConfig:
    """Chooses the linear method of each layer of one model; the base gives every layer plain
    weights. One object per model build: it may hold what the choice reads (a checkpoint's
    blocks) until ``release``."""

    name = "dense"

    def linear_method(self, spec: LinearSpec) -> LinearMethod:
        return LinearMethod()

    def experts_method(self, spec: ExpertsSpec) -> ExpertsMethod:
        return ExpertsMethod()

    def fused_decoder_layer(self, layer: Any) -> Callable[..., Any] | None:
        """A whole decoder layer's step for the steps it can take, offered to a plain
        Llama-shaped layer once its linears are ready; None here."""
        return None

    def fused_decoder_stack(self, steps: list[Any]) -> Callable[..., Any] | None:
        """A stage's layers' fused steps (each from ``fused_decoder_layer``, in order) as one
        call taking the stage's KV caches; None here."""
        return None

    def fused_sample_step(self, stack: Any, norm: Any, lm_head: Any) -> Callable[..., Any] | None:
        """``stack`` (from ``fused_decoder_stack``) with the model's final ``norm``, its
        ``lm_head`` and the sampling in the same call, returning a decode step's tokens;
        None here."""
        return None

    def release(self) -> None:
        """The model is ready: drop what only its preparation needed."""
