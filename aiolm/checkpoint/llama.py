"""Llama, Mistral, Qwen2 and Qwen3 configs -> ModelConfig (the model is model/llama.py)."""

from __future__ import annotations

from typing import Any

from aiolm.checkpoint.config import ModelConfig, check_silu_mlp
from aiolm.errors import ModelLoadError


def config_from_hf(cfg: dict[str, Any], architecture: str, source: str = "config.json") -> ModelConfig:
    """Llama, Mistral, Qwen2 and Qwen3 configs, read as transformers reads them: Qwen2's
    QKV bias by default (Mistral has none), Qwen3's QK-norm, and the sliding windows each
    one honours. What their layers here do not have is refused by name."""
    check_silu_mlp(cfg, source)
    if cfg.get("mlp_bias"):
        raise ModelLoadError(f"{source}: mlp_bias is not supported")
    # transformers' Qwen2 always has QKV biases and Mistral never, whatever attention_bias says
    bias = architecture == "qwen2" or (architecture != "mistral" and bool(cfg.get("attention_bias")))
    if bias and architecture in ("llama", "qwen3"):  # these put it on o_proj too
        raise ModelLoadError(f"{source}: attention_bias is not supported for {architecture} (a bias on o_proj)")
    return ModelConfig.from_hf(
        cfg,
        source,
        architecture=architecture,
        attention_bias=bias,
        qk_norm=architecture == "qwen3",
        sliding_windows=_sliding_windows(cfg, architecture),
    )


def _sliding_windows(cfg: dict[str, Any], architecture: str) -> tuple[int | None, ...]:
    """Mistral windows every layer; Qwen2 / Qwen3 only with use_sliding_window, the layers
    their layer_types mark (or those from max_window_layers on); Llama none."""
    window, n = cfg.get("sliding_window"), int(cfg.get("num_hidden_layers", 0))
    if window is None:
        return ()
    if architecture == "mistral":
        return (window,) * n
    if architecture in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
        types = cfg.get("layer_types") or [
            "sliding_attention" if i >= int(cfg.get("max_window_layers", 28)) else "full_attention" for i in range(n)
        ]
        return tuple(window if t == "sliding_attention" else None for t in types)
    return ()
