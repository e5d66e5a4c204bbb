"""Architecture name -> model class, and building a ready model from a ModelSource."""

from __future__ import annotations

import torch

from aiolm.attention.selector import use_attention_backend
from aiolm.model.config import ModelConfig, ModelLoadError
from aiolm.model.llama import LlamaForCausalLM
from aiolm.model.loader import ModelSource
from aiolm.platforms import get_platform

MODELS: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
}


def build_model(source: ModelSource, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu", max_positions: int | None = None,
                attention: str = "auto") -> LlamaForCausalLM:
    """The model of ``source`` loaded and laid out for ``device``'s platform, with the
    attention backend ``attention`` (auto|cpu|torch|triton)."""
    cls = MODELS.get(source.config.architecture)
    if cls is None:
        raise ModelLoadError(f"{source.path}: no implementation for {source.config.architecture}")
    platform = get_platform(device)
    with use_attention_backend(platform.attention_backend(attention)):
        model = cls(source.config, max_positions)
    model.load_weights(source.iter_weights())
    return platform.prepare_model(model, source, dtype)


def build_from_config(cfg: ModelConfig) -> LlamaForCausalLM:
    return MODELS[cfg.architecture](cfg)
