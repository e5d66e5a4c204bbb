"""Building a ready model from a ModelSource.

Which family runs which Hugging Face architecture, and how its config reads, is the
torch-free table in aiolm/checkpoint/families.py; a family's model is one module under
aiolm/model/ holding its layers and its weight names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol

import torch

from aiolm.attention.selector import use_attention_backend
from aiolm.checkpoint.config import ModelConfig
from aiolm.checkpoint.families import family_of
from aiolm.model.loader import iter_weights
from aiolm.platforms import get_platform

if TYPE_CHECKING:
    from aiolm.checkpoint.source import ModelSource


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


def model_class(cfg: ModelConfig) -> type:
    family = family_of(cfg.architecture)
    return getattr(importlib.import_module(f"aiolm.model.{family.module}"), family.model_class)


def build_model(source: ModelSource, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu", max_positions: int | None = None,
                attention: str = "auto") -> CausalLM:
    """The model of ``source`` loaded and laid out for ``device``'s platform, with the
    attention backend ``attention`` (auto|cpu|torch|triton)."""
    platform = get_platform(device)
    with use_attention_backend(platform.attention_backend(attention)):
        model = model_class(source.config)(source.config, max_positions)
    model.load_weights(iter_weights(source, lazy=True))  # a rank reads only its slices
    return platform.prepare_model(model, source, dtype)


def build_from_config(cfg: ModelConfig) -> CausalLM:
    return model_class(cfg)(cfg)
