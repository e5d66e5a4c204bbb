"""Building a ready model from a ModelSource: the builder, the one place that asks a
platform for its choices and hands them to a model.

Which family runs which Hugging Face architecture, and how its config reads, is the
torch-free table in aiolm/checkpoint/families.py; a family's model is one module under
aiolm/model/ holding its layers and its weight names. A model is constructed with a
BuildContext (model/layers/context.py), loaded, then finished: moved to its device and
dtype and each layer's weights laid out by its quant method.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

from aiolm.checkpoint.config import ModelConfig
from aiolm.checkpoint.families import family_of
from aiolm.distributed.parallel_state import get_pp_stage, get_tp_group
from aiolm.lora.layers import LoRAContext
from aiolm.model.layers.context import BuildContext, process_weights_after_loading
from aiolm.model.loader import iter_weights
from aiolm.platforms import Platform, get_platform

if TYPE_CHECKING:
    from aiolm.checkpoint.source import ModelSource


class CausalLM(Protocol):
    """What the model runner and the loader use of a family's model (an nn.Module)."""

    config: ModelConfig
    embed_tokens: torch.nn.Module
    layers: torch.nn.ModuleList

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: Any
    ) -> torch.Tensor: ...
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...
    def load_weights(self, weights: Any) -> None: ...
    def to(self, *args: Any, **kwargs: Any) -> Any: ...


def model_class(cfg: ModelConfig) -> type:
    family = family_of(cfg.architecture)
    return getattr(importlib.import_module(f"aiolm.model.{family.module}"), family.model_class)


def build_context(
    platform: Platform,
    dtype: torch.dtype = torch.float32,
    attention: str = "auto",
    model_config: ModelConfig | None = None,
    checkpoint: Any = None,
    device: torch.device | str | None = None,
    expert_parallel: bool = False,
    pooling: bool = False,
    lora: tuple[int, int] | None = None,
) -> BuildContext:
    """What a model built on ``platform`` in ``dtype`` gets: the platform's ops, the attention
    backend ``attention`` (auto or a name in aiolm/attention/registry.py), the quant method
    it chooses for ``checkpoint`` (a file or folder), and this rank's tensor-parallel group
    (``expert_parallel``: over which layers of experts place whole experts); ``pooling``:
    for a model whose hidden states are pooled, not sampled (no LM head); ``lora``:
    (slots, largest rank) of the LoRA adapters it serves, with the platform's kernel."""
    tp = get_tp_group()
    lora_ctx = LoRAContext(lora[0], lora[1], platform.lora_kernel()) if lora is not None else None
    return BuildContext(
        ops=platform.ops(),
        attention_backend=platform.attention_backend(attention),
        quant=platform.quant_config(dtype, model_config, checkpoint, tp.world_size),
        tp_group=tp,
        dtype=platform.activation_dtype(dtype),
        device=torch.device(device) if device is not None else platform.device,
        platform=platform,
        expert_parallel=expert_parallel,
        pooling=pooling,
        lora=lora_ctx,
        stage=get_pp_stage(),
    )


def build_model(
    source: ModelSource,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    max_positions: int | None = None,
    attention: str = "auto",
    platform: Platform | None = None,
    expert_parallel: bool = False,
    pooling: bool = False,
    lora: tuple[int, int] | None = None,
) -> CausalLM:
    """The model of ``source`` loaded and laid out for ``platform`` (by default ``device``'s),
    with the attention backend ``attention`` (auto|cpu|torch|triton); ``expert_parallel``:
    whole experts per tensor-parallel rank; ``pooling``: built to pool, not to generate (a
    decoder without its LM head; an encoder-only model is built so either way); ``lora``:
    (slots, largest rank) of the LoRA adapters it is to serve."""
    if platform is None:
        platform, where = get_platform(device), torch.device(device)
    else:
        where = platform.device
    pooling = pooling or source.config.encoder_only
    ctx = build_context(platform, dtype, attention, source.config, source.origin, where, expert_parallel, pooling, lora)
    model = model_class(source.config)(source.config, ctx, max_positions)
    kv_scales: dict[tuple[int, str], float] = {}
    # a rank reads its slices; a pipeline stage only its own layers' tensors
    keep = (lambda name: model.holds(name.removeprefix("model."))) if ctx.stage.size > 1 else None
    model.load_weights(_without_kv_scales(iter_weights(source, lazy=True, keep=keep), kv_scales))
    for (layer, which), value in kv_scales.items():
        attn = getattr(getattr(model.layers[layer], "self_attn", None), "attn", None)
        if attn is not None:
            setattr(attn, f"{which}_scale", value)
    return finish(model, ctx)


# A layer's scale of its fp8 KV cache, as vLLM's quantization tools write it (kv_scale: both)
_KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(k|v|kv)_scale$")


def _without_kv_scales(
    weights: Iterator[tuple[str, Any]], out: dict[tuple[int, str], float]
) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors less the KV-cache scales, which go to ``out`` by (layer, k|v)."""
    for name, w in weights:
        m = _KV_SCALE.match(name)
        if m is None:
            yield name, w
            continue
        value = float(w[...].float().max())
        for which in ("k", "v") if m[2] == "kv" else (m[2],):
            out[(int(m[1]), which)] = value


def finish(model: Any, ctx: BuildContext) -> Any:
    """A loaded model moved to its device and dtype, each layer's weights laid out by its
    method (children first), and whatever the build only needed let go."""
    model = model.to(dtype=ctx.dtype, device=ctx.device).eval()
    if ctx.lora is not None:
        ctx.lora.to(ctx.device)
    process_weights_after_loading(model)
    ctx.quant.release()
    return model


def build_from_config(cfg: ModelConfig, ctx: BuildContext, max_positions: int | None = None) -> CausalLM:
    """A model of ``cfg`` with its weights as constructed (tests fill them themselves, then
    call ``finish``)."""
    return model_class(cfg)(cfg, ctx, max_positions)
