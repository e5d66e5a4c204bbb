"""What a model is built with, handed to its constructor and passed down to its layers.

The builder (aiolm/model/registry.py) fills one ``BuildContext`` from the platform it
builds for; a layer keeps what it needs of it (the ops object, its attention backend
class, its linear method, the tensor-parallel group) and asks nothing else about the
hardware. Two models built from two contexts live side by side in one process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from aiolm.distributed.stages import PipelineStage
from aiolm.kernels.ops import TorchOps
from aiolm.lora.layers import LoRAContext
from aiolm.quant.base import QuantConfig


@dataclass(frozen=True)
class BuildContext:
    ops: TorchOps  # norms, RoPE, activations (aiolm/kernels/ops.py)
    attention_backend: type  # an AttentionBackend subclass (aiolm/attention/registry.py)
    quant: QuantConfig  # each linear layer's method (aiolm/quant/)
    tp_group: Any  # this rank's TPGroup (aiolm/distributed/parallel_state.py)
    dtype: torch.dtype = torch.float32  # the weights and activations once loaded
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    platform: Any = None  # the platform that chose the above, for the record
    # layers of experts place whole experts on ranks (aiolm/model/layers/fused_moe.py)
    expert_parallel: bool = False
    # built to pool hidden states (embeddings, scores), never to sample: a decoder has no
    # LM head, and its checkpoint need not hold one
    pooling: bool = False
    # built to serve LoRA adapters (aiolm/lora/layers.py): the projections an adapter may
    # target get slots, all reading this one context's per-step rows
    lora: LoRAContext | None = None
    # the pipeline stage this model is built for (aiolm/distributed/stages.py): a
    # decoder builds only that stage's layers, the embeddings on the first, the head on the last
    stage: PipelineStage = field(default_factory=PipelineStage)


def process_weights_after_loading(module: nn.Module) -> None:
    """Every layer's step after loading, children before their parents: a linear layer's
    quant method lays out its weights, then a module with a step of its own (a decoder
    layer offered a fused step) sees its parts ready."""
    for child in module.children():
        process_weights_after_loading(child)
    method = module.__dict__.get("quant_method")
    if method is not None:
        method.process_weights_after_loading(module)
    own = getattr(type(module), "process_weights_after_loading", None)
    if own is not None:
        own(module)
