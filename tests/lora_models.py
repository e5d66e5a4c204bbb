"""Test helper: tiny random base models (Llama, Qwen3) and random LoRA adapters for them
written by PEFT itself, and transformers + PEFT's greedy tokens as the reference."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_base(kind: str, path: Path, tokenizer_from: Path, seed: int = 0, **over) -> Path:
    """A float32 random ``kind`` (llama or qwen3) model saved to ``path`` with the tokenizer
    files of ``tokenizer_from``; weights large enough that greedy tokens wander."""
    import transformers

    common = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    if kind == "qwen3":
        cfg = transformers.Qwen3Config(**{**common, "head_dim": 16, **over})
    elif kind == "llama":
        cfg = transformers.LlamaConfig(**{**common, **over})
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, path / name)
    return path


def peft_adapter(
    base: Path,
    path: Path,
    rank: int = 8,
    targets: Sequence[str] = ALL_TARGETS,
    seed: int = 1,
    alpha: float = 16,
    rslora: bool = False,
    scale: float = 0.3,
    **extra,
) -> Path:
    """A LoRA adapter of ``base`` written by PEFT to ``path``, with random A and B (PEFT starts
    B at zero, which would make every adapter the base model)."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora, **extra)
    lora = peft.get_peft_model(model, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    lora.save_pretrained(path)
    return path


def hf_lora_greedy(base: Path, adapter: Path | None, prompts: Sequence[Sequence[int]], max_new: int) -> list[list[int]]:
    """transformers (+ PEFT when ``adapter``) greedy tokens for each prompt, one at a time."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)])
            got = model.generate(ids, max_new_tokens=max_new, do_sample=False, min_new_tokens=max_new, pad_token_id=0)
            out.append(got[0, len(prompt) :].tolist())
    return out
