"""Mixture-of-experts GGUF files (Qwen3-MoE, Qwen2-MoE, Mixtral as llama.cpp writes them)
run in aiolm with transformers' greedy tokens: an F32 file against the model it was
written from, a Q8_0 file against transformers reading aiolm's dequantized folder (the
values the file holds). On the CPU the attention's linears also keep the file's blocks
for small steps and the experts run as one fused call."""

from __future__ import annotations

import pytest
import torch

from aiolm.checkpoint.source import resolve_model
from aiolm.model.registry import build_model
from gguf_moe_writer import VOCAB, tiny_moe_model, write_moe_gguf
from paged import PagedHarness, hf_greedy

NEW = 10


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_gguf_file_gives_transformers_greedy_tokens(kind, qtype, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    hf = tiny_moe_model(kind)
    path = tmp_path / f"{kind}-{qtype}.gguf"
    write_moe_gguf(hf, path, qtype)
    with monkeypatch.context() as mp:  # the conversion goes to a private cache; the kernels stay the suite's
        mp.setenv("AIOLM_CACHE_DIR", str(tmp_path / "cache"))
        source = resolve_model(path)
    assert source.config.architecture == kind
    if qtype != "F32":
        hf = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32).eval()
    model = build_model(source, torch.float32)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (6, 13)]
    expected = [hf_greedy(hf, p, NEW) for p in prompts]
    assert len({t for e in expected for t in e}) > 5
    assert PagedHarness(model, block_size=4).greedy(prompts, NEW, split=3) == expected
