"""A tiny random Llama shared by the platform tests."""

from __future__ import annotations

import pytest
import torch

VOCAB = 512


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama (tied embeddings, GQA) saved as a Hugging Face folder, and the
    transformers model itself."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # bigger than the init's 0.02 so that logits are far apart
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp("tiny_llama")
    hf.save_pretrained(str(folder))
    return folder, hf
