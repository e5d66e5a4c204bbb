"""Mixture-of-experts configs (Qwen3-MoE, Qwen2-MoE, Mixtral) -> MoEConfig (the model is model/moe.py).

Each family routes the same way, as transformers does: router logits in float32, a softmax
over all experts, the top k, and (where the family renormalises) the k weights divided by
their sum. What differs is read here: which layers are sparse, whether the k weights are
renormalised, and Qwen2-MoE's shared expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiolm.checkpoint.config import ModelConfig, check_silu_mlp
from aiolm.errors import ModelLoadError


@dataclass(frozen=True)
class MoEConfig(ModelConfig):
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0  # one expert's
    norm_topk_prob: bool = False  # the top k weights divided by their sum
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an expert every token takes, behind a sigmoid gate
    sparse_layers: tuple[bool, ...] = ()  # per layer: experts (True) or a dense MLP of intermediate_size

    def is_sparse(self, layer: int) -> bool:
        return self.sparse_layers[layer]


def config_from_hf(cfg: dict[str, Any], architecture: str, source: str = "config.json") -> MoEConfig:
    """Qwen3-MoE, Qwen2-MoE and Mixtral configs, with the defaults transformers gives them."""

    def need(key: str) -> Any:
        if key not in cfg:
            raise ModelLoadError(f"{source}: missing field {key!r}")
        return cfg[key]

    check_silu_mlp(cfg, source)
    n = int(need("num_hidden_layers"))
    if architecture == "mixtral":
        experts = int(need("num_local_experts"))
        sparse = (True,) * n
        family: dict[str, Any] = dict(
            moe_intermediate_size=int(need("intermediate_size")),
            norm_topk_prob=True,
            attention_bias=False,
            sliding_windows=(cfg["sliding_window"],) * n if cfg.get("sliding_window") else (),
        )
    else:
        # the Hub's configs say num_experts; transformers 5 writes num_local_experts
        experts = int(cfg["num_experts"] if "num_experts" in cfg else need("num_local_experts"))
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense = set(cfg.get("mlp_only_layers") or ())
        sparse = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(n))
        family = dict(
            moe_intermediate_size=int(need("moe_intermediate_size")),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            qk_norm=architecture == "qwen3_moe",
            attention_bias=bool(
                cfg.get("qkv_bias", True) if architecture == "qwen2_moe" else cfg.get("attention_bias", False)
            ),
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
            if architecture == "qwen2_moe"
            else 0,
            sliding_windows=_qwen_windows(cfg, architecture, n),
        )
    top_k = int(need("num_experts_per_tok"))
    if experts < 1 or not 1 <= top_k <= experts:
        raise ModelLoadError(f"{source}: {top_k} experts per token of {experts} experts")
    return MoEConfig.from_hf(
        cfg,
        source,
        architecture=architecture,
        num_experts=experts,
        top_k=top_k,
        sparse_layers=sparse,
        **family,
    )


def _qwen_windows(cfg: dict[str, Any], architecture: str, n: int) -> tuple[int | None, ...]:
    """With use_sliding_window: Qwen3-MoE windows every layer; Qwen2-MoE the layers its
    layer_types mark (by default the odd-numbered ones from 1 below max_window_layers)."""
    window = cfg.get("sliding_window")
    if not cfg.get("use_sliding_window") or not window:
        return ()
    if architecture == "qwen3_moe":
        return (window,) * n
    limit = int(cfg.get("max_window_layers", n))
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 and i < limit else "full_attention" for i in range(n)
    ]
    return tuple(window if t == "sliding_attention" else None for t in types)
