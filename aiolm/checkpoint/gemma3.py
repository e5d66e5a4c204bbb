"""Gemma 3 text configs -> Gemma3Config (the model and what sets it apart: model/gemma3.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from aiolm.checkpoint.config import ModelConfig, check_rope_scaling, filled_rope_scaling
from aiolm.errors import ModelLoadError

log = logging.getLogger(__name__)

# the hidden activations the model implements (model/gemma3.py maps each to F.gelu's approximate)
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")


@dataclass(frozen=True)
class Gemma3Config(ModelConfig):
    query_pre_attn_scalar: float = 256.0
    local_layers: tuple[bool, ...] = ()  # per layer: a sliding_attention layer (its own RoPE base)
    rope_local_theta: float = 10000.0  # RoPE base of the local layers
    final_logit_softcapping: float | None = None
    hidden_activation: str = "gelu_pytorch_tanh"


def config_from_hf(cfg: dict[str, Any], architecture: str, source: str = "config.json") -> Gemma3Config:
    """A Gemma 3 text config, in transformers 5's spelling (``rope_parameters`` per layer
    type) or the original one (``rope_theta``, ``rope_local_base_freq``, ``rope_scaling``,
    ``sliding_window_pattern``); defaults are transformers' Gemma3TextConfig's."""
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{source}: use_bidirectional_attention is not supported (decoders only)")
    n = int(cfg.get("num_hidden_layers", 0))
    types = cfg.get("layer_types")
    if types is None:
        pattern = int(cfg.get("sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if len(types) != n:
        raise ModelLoadError(f"{source}: {len(types)} layer_types for {n} layers")
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ModelLoadError(
            f"{source}: layer_types {sorted(unknown)} are not supported; supported: sliding_attention, full_attention"
        )
    window = cfg.get("sliding_window", 4096)
    rope = cfg.get("rope_parameters") or {}
    if "full_attention" in rope or "sliding_attention" in rope:
        glob, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
        theta, local_theta = glob.get("rope_theta", 1e6), local.get("rope_theta", 1e4)
        scaling = glob if glob.get("rope_type", "default") != "default" else None
        if local.get("rope_type", "default") != "default":
            raise ModelLoadError(f"{source}: RoPE scaling of the sliding-window layers is not supported")
    else:
        theta, local_theta = cfg.get("rope_theta", 1e6), cfg.get("rope_local_base_freq", 1e4)
        scaling = cfg.get("rope_scaling")
    check_rope_scaling(scaling, source)
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in ACTIVATIONS:
        raise ModelLoadError(
            f"{source}: hidden_activation {activation!r} is not supported; supported: {', '.join(ACTIVATIONS)}"
        )
    if cfg.get("attn_logit_softcapping") is not None:
        # transformers' Gemma 3 does not apply it either (Gemma 2 did); the checkpoints set null
        log.warning("%s: attn_logit_softcapping is ignored, as transformers' Gemma 3 ignores it", source)
    cap = cfg.get("final_logit_softcapping")
    return Gemma3Config.from_hf(
        cfg,
        source,
        architecture=architecture,
        head_dim=int(cfg.get("head_dim", 256)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qk_norm=True,
        rope_theta=float(theta),
        rope_scaling=filled_rope_scaling(scaling, int(cfg.get("max_position_embeddings", 131072))),
        sliding_windows=tuple(window if t == "sliding_attention" else None for t in types),
        local_layers=tuple(t == "sliding_attention" for t in types),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        rope_local_theta=float(local_theta),
        final_logit_softcapping=float(cap) if cap is not None else None,
        hidden_activation=activation,
    )
