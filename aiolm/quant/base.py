"""What a linear layer's quant method is, and what chooses one for each layer of a model.

A linear layer (aiolm/model/layers/linear.py) asks its model's ``QuantConfig`` for a
``LinearMethod`` when it is constructed, as vLLM's layers do, and from then on the method
owns the layer's weights: ``create_weights`` gives the layer the parameters the loader
fills, ``process_weights_after_loading`` lays them out for the kernel once they are in
place (on the model's device and dtype), and ``apply`` is the multiply. The layer only
passes x and its bias through; the output's dtype is the method's business.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


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


class QuantConfig:
    """Chooses the linear method of each layer of one model; the base gives every layer plain
    weights. One object per model build: it may hold what the choice reads (a checkpoint's
    blocks) until ``release``."""

    name = "dense"

    def linear_method(self, spec: LinearSpec) -> LinearMethod:
        return LinearMethod()

    def fused_decoder_layer(self, layer: Any) -> Callable[..., Any] | None:
        """A whole decoder layer's step for the steps it can take, offered to a plain
        Llama-shaped layer once its linears are ready; None here."""
        return None

    def release(self) -> None:
        """The model is ready: drop what only its preparation needed."""
