"""Test helper: tiny random mixture-of-experts models of each family, saved as transformers
saves them (one tensor per expert projection), with weights large enough that greedy
decoding wanders over the vocabulary instead of repeating one token."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

KINDS = ("qwen3_moe", "qwen2_moe", "mixtral")


def moe_config(kind: str, vocab_size: int = 256, **over):
    """A small config of ``kind``: Qwen3-MoE with a dense layer among its sparse ones (layer 1)
    and QK-norm; Qwen2-MoE with its shared expert and QKV bias; Mixtral with top-2 of 4."""
    import transformers

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    if kind == "qwen3_moe":
        kw = dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            mlp_only_layers=[1],
            norm_topk_prob=True,
            head_dim=16,
        )
        cls = transformers.Qwen3MoeConfig
    elif kind == "qwen2_moe":
        kw = dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, shared_expert_intermediate_size=48)
        cls = transformers.Qwen2MoeConfig
    else:
        kw = dict(num_local_experts=4, num_experts_per_tok=2)
        cls = transformers.MixtralConfig
    return cls(**{**common, **kw, **over})


def moe_model(kind: str, path: Path | None = None, seed: int = 0, tokenizer_from: Path | None = None, **over):
    """A float32 transformers model of ``kind`` in eval mode, saved to ``path`` when given
    (with the tokenizer files of the folder ``tokenizer_from``)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(moe_config(kind, **over)).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
            elif kind == "qwen2_moe":  # biases start at zero: make them matter
                p.add_(torch.randn_like(p) * 0.1)
    if path is not None:
        model.save_pretrained(path)
        if tokenizer_from is not None:
            for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
                if (tokenizer_from / name).exists():
                    shutil.copy(tokenizer_from / name, path / name)
    return model
