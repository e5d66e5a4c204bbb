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

from aiolm.kernels import cpu as cpu_kernels
from aiolm.model import gguf_blocks
from aiolm.model.config import ModelConfig, ModelLoadError

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
    def pack_for_cpu(self, matmul_dtype: torch.dtype = torch.float32) -> int: ...
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


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """'auto' -> float32 on CPU, bfloat16 on CUDA (when supported), else float16.

    On a CPU, bfloat16 asks for bfloat16 matmuls in an otherwise float32 model
    (build_model), whose KV cache the model runner keeps in float16.

    On CPUs without AMX, fp32 matmuls are faster than bf16 ones (measured in
    PEERS.md: 244 vs 166 GFLOP/s here), and fp32 keeps exact parity, so CPU auto
    means float32.
    """
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype: {dtype!r} is not supported; supported: auto, {', '.join(DTYPES)}")
    t = DTYPES[dtype]
    if device.type == "cpu" and t is torch.float16:
        try:
            torch.ones(2, 2, dtype=t) @ torch.ones(2, 2, dtype=t)
        except RuntimeError as e:
            raise ModelLoadError(f"dtype: float16 is not supported on this CPU ({e}); use float32") from e
    if device.type == "cuda" and t is torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ModelLoadError("dtype: bfloat16 is not supported on this GPU; use float16 or auto")
    return t


def kv_cache_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The KV cache's dtype for a model built in ``dtype``: its own, except that CPU
    bfloat16 matmuls keep the cache in float16 (half the bytes a decode step reads, and
    8x finer than bfloat16, whose cache changed greedy answers here)."""
    if torch.device(device).type == "cpu" and dtype == torch.bfloat16:
        return torch.float16
    return dtype


def build_model(source: ModelSource, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu", max_positions: int | None = None) -> CausalLM:
    model = model_class(source.config)(source.config, max_positions)
    model.load_weights(source.iter_weights())
    on_cpu = torch.device(device).type == "cpu"
    # bfloat16 on a CPU means bfloat16 matmuls only (layers/cpu_linear.py): the speed of
    # its matrix units where the answers least feel it, with every other tensor float32.
    matmul_dtype = dtype
    if on_cpu and dtype == torch.bfloat16:
        dtype = torch.float32
    model = model.to(dtype=dtype, device=device).eval()
    if on_cpu and dtype == torch.float32:
        model.pack_for_cpu(matmul_dtype)
        if source.origin.suffix == ".gguf" and cpu_kernels.load():
            gguf_blocks.attach(model, source.origin)
    return model


def build_from_config(cfg: ModelConfig) -> CausalLM:
    return model_class(cfg)(cfg)
