"""Architecture name -> model class, and building a ready model from a ModelSource."""

from __future__ import annotations

import torch

from aiolm.kernels import cpu as cpu_kernels
from aiolm.model import gguf_blocks
from aiolm.model.config import ModelConfig, ModelLoadError
from aiolm.model.llama import LlamaForCausalLM
from aiolm.model.loader import ModelSource

MODELS: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
}

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
                device: torch.device | str = "cpu", max_positions: int | None = None) -> LlamaForCausalLM:
    cls = MODELS.get(source.config.architecture)
    if cls is None:
        raise ModelLoadError(f"{source.path}: no implementation for {source.config.architecture}")
    model = cls(source.config, max_positions)
    model.load_weights(source.iter_weights(lazy=True))  # a rank reads only its slices
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


def build_from_config(cfg: ModelConfig) -> LlamaForCausalLM:
    return MODELS[cfg.architecture](cfg)
