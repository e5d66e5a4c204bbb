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


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_fused_attention_half_gives_the_modules_bits(kind, tmp_path, monkeypatch):
    """Each layer's decode steps run its attention half as one C++ call (QK-norm included,
    ext/cpu/decode_layer.cpp) and then its experts (or, in Qwen3-MoE's dense layer, the
    whole layer): the logits are those of the modules run one by one, bit for bit."""
    from aiolm.quant.gguf_blocks import FusedDecodeLayer

    path = tmp_path / "m.gguf"
    write_moe_gguf(tiny_moe_model(kind), path, "Q8_0")
    with monkeypatch.context() as mp:
        mp.setenv("AIOLM_CACHE_DIR", str(tmp_path / "cache"))
        source = resolve_model(path)
    model = build_model(source, torch.float32)
    plans = [layer.fused for layer in model.layers]
    assert all(isinstance(p, FusedDecodeLayer) for p in plans)
    assert [p.mlp is None for p in plans] == [not s for s in source.config.sparse_layers]

    def run() -> list[dict[int, torch.Tensor]]:
        h = PagedHarness(model, block_size=4)
        outs = [h.step({0: list(range(3, 20)), 1: list(range(40, 49))})]
        outs += [h.step({0: [5 + i], 1: [60 + i]}) for i in range(4)]
        return outs

    taken = [0]

    def counted(plan):
        def call(*args):
            out = plan(*args)
            taken[0] += out is not None
            return out

        return call

    for layer, plan in zip(model.layers, plans):
        layer.fused = counted(plan)
    fused = run()
    assert taken[0] == 4 * len(plans)  # every decode step of every layer, not the prompt's
    for layer in model.layers:
        layer.fused = None
    modules = run()
    for a, b in zip(fused, modules):
        for seq in a:
            assert torch.equal(a[seq], b[seq])
