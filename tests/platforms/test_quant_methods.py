"""A quant method is one class and one registry line: a method registered from this test
reaches every linear layer of a model whose platform names it, lays out its weights after
loading, and the model still gives the reference platform's greedy tokens. The registry
refuses names it does not know."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from aiolm.checkpoint.source import resolve_model
from aiolm.model.registry import build_model
from aiolm.platforms import Platform, get_platform
from aiolm.quant import (
    QUANT_CONFIGS,
    LinearMethod,
    LinearSpec,
    QuantConfig,
    quant_config,
)
from paged import PagedHarness

PROMPTS = [[5, 17, 300, 42, 8, 99, 123], list(range(60, 100))]


class TransposedMethod(LinearMethod):
    """The weight kept as W^T after loading, the original dropped (a layout change of the
    kind a kernel's method makes); ``keep``: the weight is also another layer's."""

    def __init__(self, keep: bool) -> None:
        self.keep = keep

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.weight_t = layer.weight.data.t().contiguous()
        if not self.keep:
            layer.weight = nn.Parameter(torch.empty(0), requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = x.to(layer.weight_t.dtype) @ layer.weight_t
        return y if bias is None else y + bias


class TransposedConfig(QuantConfig):
    name = "transposed"

    def linear_method(self, spec: LinearSpec) -> LinearMethod:
        return TransposedMethod(keep=spec.shared_weight)  # a tied LM head's weight is the embedding's


class TransposedPlatform(Platform):
    """The reference platform, but naming the test's quant method."""

    def quant_config(self, dtype, model_config=None, checkpoint=None, tp_size=1) -> QuantConfig:
        return quant_config("transposed")


def test_a_registered_quant_method_reaches_every_linear_layer(tiny_llama, monkeypatch):
    monkeypatch.setitem(QUANT_CONFIGS, "transposed", f"{__name__}:TransposedConfig")
    src = resolve_model(tiny_llama[0])
    model = build_model(src, torch.float32, platform=TransposedPlatform("cpu"))
    linears = [m for m in model.modules() if "quant_method" in m.__dict__]
    assert len(linears) == 4 * len(model.layers) + 1  # qkv, o, gate_up, down per layer; the LM head
    assert all(type(m.quant_method) is TransposedMethod and m.weight_t.dim() == 2 for m in linears)
    assert model.layers[0].mlp.down_proj.weight.numel() == 0  # its own layout only
    assert model.lm_head.weight is model.embed_tokens.weight  # tied: kept for the embedding
    reference = build_model(src, torch.float32, platform=get_platform("torch"))
    want = PagedHarness(reference, block_size=4).greedy(PROMPTS, 8)
    assert PagedHarness(model, block_size=4).greedy(PROMPTS, 8) == want


def test_an_unknown_quant_method_is_refused_by_name():
    with pytest.raises(ValueError, match="'fp4' is not known; known: dense, cpu_packed, gguf_blocks"):
        quant_config("fp4")
