"""Hugging Face architecture -> model family, and building a ready model from a ModelSource.

A family is one module under aiolm/model/ holding its layers, its weight names and
``config_from_hf(cfg, architecture, source)``, the mapping of a Hugging Face config
to the ModelConfig (or the family's subclass of it) that its model reads. Adding one
is that module and a line in MODELS.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from aiolm.attention.selector import use_attention_backend
from aiolm.errors import ModelLoadError
from aiolm.model.config import ModelConfig
from aiolm.platforms import get_platform

if TYPE_CHECKING:
    from aiolm.model.loader import ModelSource


@dataclass(frozen=True)
class ModelFamily:
    name: str  # ModelConfig.architecture
    module: str  # aiolm.model.<module>: its model class and config_from_hf
    model_class: str
    model_type: str  # config.json's model_type, for configs that list no architectures


# Hugging Face architecture -> the family that runs it
MODELS: dict[str, ModelFamily] = {
    "LlamaForCausalLM": ModelFamily("llama", "llama", "LlamaForCausalLM", "llama"),
    "MistralForCausalLM": ModelFamily("mistral", "llama", "LlamaForCausalLM", "mistral"),
    "Qwen2ForCausalLM": ModelFamily("qwen2", "llama", "LlamaForCausalLM", "qwen2"),
    "Qwen3ForCausalLM": ModelFamily("qwen3", "llama", "LlamaForCausalLM", "qwen3"),
    "Gemma3ForCausalLM": ModelFamily("gemma3", "gemma3", "Gemma3ForCausalLM", "gemma3_text"),
}


class CausalLM(Protocol):
    """What the model runner and the loader use of a family's model (an nn.Module)."""

    config: ModelConfig
    embed_tokens: torch.nn.Module
    layers: torch.nn.ModuleList

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 meta: Any) -> torch.Tensor: ...
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...
    def load_weights(self, weights: Any) -> None: ...
    def to(self, *args: Any, **kwargs: Any) -> Any: ...


def _family(architecture: str) -> ModelFamily:
    family = next((f for f in MODELS.values() if f.name == architecture), None)
    if family is None:
        raise ModelLoadError(f"no implementation for architecture {architecture!r}")
    return family


def read_config(cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """The ModelConfig of a Hugging Face config.json, by the family of its architecture."""
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in MODELS), None) or next(
        (a for a, f in MODELS.items() if f.model_type == cfg.get("model_type")), None)
    if arch is None:
        raise ModelLoadError(f"{source}: unknown architecture {archs or cfg.get('model_type')!r}; "
                             f"supported: {', '.join(sorted(MODELS))}")
    family = MODELS[arch]
    module = importlib.import_module(f"aiolm.model.{family.module}")
    return module.config_from_hf(cfg, family.name, source)


def model_class(cfg: ModelConfig) -> type:
    family = _family(cfg.architecture)
    return getattr(importlib.import_module(f"aiolm.model.{family.module}"), family.model_class)


def build_model(source: ModelSource, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu", max_positions: int | None = None,
                attention: str = "auto") -> CausalLM:
    """The model of ``source`` loaded and laid out for ``device``'s platform, with the
    attention backend ``attention`` (auto|cpu|torch|triton)."""
    platform = get_platform(device)
    with use_attention_backend(platform.attention_backend(attention)):
        model = model_class(source.config)(source.config, max_positions)
    model.load_weights(source.iter_weights(lazy=True))  # a rank reads only its slices
    return platform.prepare_model(model, source, dtype)


def build_from_config(cfg: ModelConfig) -> CausalLM:
    return model_class(cfg)(cfg)
