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
from aiolm.params import SamplingParams
from gguf_moe_writer import VOCAB, tiny_moe_model, write_moe_gguf
from paged import PagedHarness, check_sample_call, hf_greedy

NEW = 10


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q5_0"])
@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_gguf_file_gives_transformers_greedy_tokens(kind, qtype, tmp_path, monkeypatch):
    """(Q5_0: its blocks kept at 5.5 bits, as int8 on VNNI keeps them, and run in float.)"""
    from transformers import AutoModelForCausalLM

    from aiolm.quant import gguf_blocks

    monkeypatch.setattr(gguf_blocks, "KEEP_Q5_0", True)
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
    if qtype == "Q5_0" and gguf_blocks.cpu_kernels.load():
        mods = list(model.modules())
        linears = {m.gguf.blocks.qtype for m in mods if isinstance(getattr(m, "gguf", None), gguf_blocks.GGUFLinear)}
        experts = {t for m in mods if getattr(m, "gguf_experts", None) is not None for t in m.gguf_experts.types}
        assert linears == experts == {gguf_blocks.TYPE_IDS["Q5_0"]}
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (6, 13)]
    expected = [hf_greedy(hf, p, NEW) for p in prompts]
    assert len({t for e in expected for t in e}) > 5
    assert PagedHarness(model, block_size=4).greedy(prompts, NEW, split=3) == expected


@pytest.fixture(scope="module")
def q8_models(tmp_path_factory):
    """Each family's tiny model as a Q8_0 file, built by aiolm once for the module."""
    built = {}

    def get(kind):
        if kind not in built:
            tmp = tmp_path_factory.mktemp(kind)
            path = tmp / "m.gguf"
            family, _, dense = kind.partition("-")
            # "qwen3_moe-dense": every layer dense (QK-norm attention, no experts)
            write_moe_gguf(tiny_moe_model(family, **({"mlp_only_layers": [0, 1, 2]} if dense else {})), path, "Q8_0")
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("AIOLM_CACHE_DIR", str(tmp / "cache"))
                source = resolve_model(path)
            built[kind] = (source, build_model(source, torch.float32))
        return built[kind]

    return get


@pytest.mark.parametrize("int8", [False, True], ids=["float-x", "int8-x"])
@pytest.mark.parametrize("how", ["per-layer", "one-call"])
@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "qwen2_moe", "qwen3_moe-dense"])
def test_fused_layers_give_the_modules_bits(kind, how, int8, q8_models, monkeypatch):
    """A decode step of a layer of experts runs as one C++ call (ext/cpu/decode_layer.cpp):
    attention with QK-norm, the router's float32 logits, top-k and renormalisation, and the
    experts' blocks (Qwen3-MoE's dense layer as a dense one); the model's layers as one call
    per step. Qwen2-MoE's shared expert keeps its layers' experts in the modules, after the
    call's attention half, and the model without the one call. Either way the logits and
    the per-expert token counts are those of the modules run one by one, bit for bit. With
    every layer dense, the one call runs the step's layers as one team of threads."""
    from aiolm.quant import gguf_blocks

    monkeypatch.setattr(gguf_blocks, "INT8", int8)
    source, model = q8_models(kind)
    plans = [layer.fused for layer in model.layers]
    assert all(isinstance(p, gguf_blocks.FusedDecodeLayer) for p in plans)
    shared = kind == "qwen2_moe"
    assert [p.mlp is not None for p in plans] == [s and shared for s in source.config.sparse_layers]
    stack = model.fused_stack
    assert (stack is None) == shared
    if how == "one-call" and shared:
        pytest.skip("a shared expert's model has no one call")

    prompts = {0: list(range(3, 20)), 1: list(range(40, 49))}

    def run() -> tuple[list[dict[int, torch.Tensor]], torch.Tensor]:
        model.take_expert_counts()
        h = PagedHarness(model, block_size=4)
        outs = [h.step(prompts)]
        outs += [h.step({0: [5 + i], 1: [60 + i]}) for i in range(4)]
        return outs, model.take_expert_counts()

    taken = [0]

    def counted(call, layers):
        def counting(*args):
            out = call(*args)
            taken[0] += layers * (out is not None)
            return out

        return counting

    try:
        model.fused_stack = counted(stack, len(plans)) if how == "one-call" else None
        for layer, plan in zip(model.layers, plans):
            layer.fused = counted(plan, 1) if how == "per-layer" else None
        fused, fused_counts = run()
        # Every decode step of every layer; the prompt step too where a layer's int8 kernels
        # take its rows (with VNNI, any number: gguf_blocks.INT8_LIMIT).
        prompt_rows = sum(map(len, prompts.values()))
        takes_prompt = [int8 and prompt_rows <= p.int8_rows for p in plans]
        if how == "one-call":
            takes_prompt = [all(takes_prompt)] * len(plans)
        assert taken[0] == sum(4 + t for t in takes_prompt)
        model.fused_stack = None
        for layer in model.layers:
            layer.fused = None
        modules, module_counts = run()
    finally:
        for layer, plan in zip(model.layers, plans):
            layer.fused = plan
        model.fused_stack = stack
    dense = kind.endswith("-dense")
    assert fused_counts.sum() == module_counts.sum() and (fused_counts.sum() > 0) != dense
    assert torch.equal(fused_counts, module_counts)
    for step, (a, b) in enumerate(zip(fused, modules)):
        for seq in a:
            assert torch.equal(a[seq], b[seq]), f"step {step}, sequence {seq}: the fused layers' logits differ"


@pytest.mark.parametrize("int8", [False, True], ids=["float-x", "int8-x"])
@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "qwen3_moe-dense"])
def test_a_decode_step_ends_in_the_one_call(kind, int8, q8_models, monkeypatch):
    """model.sampled_tokens, the layers, the final norm, the LM head and the sampling in one
    C++ call: with layers of experts (run one by one in the call) and with every layer dense
    (as one team of threads), each step's tokens are the sampler's on the modules' logits,
    greedy rows and drawn ones."""
    from aiolm.quant import gguf_blocks

    monkeypatch.setattr(gguf_blocks, "INT8", int8)
    _, model = q8_models(kind)
    assert isinstance(model.sample_step, gguf_blocks.FusedSampleStep)
    prompts = {0: list(range(3, 20)), 1: list(range(40, 49)), 2: list(range(70, 75))}
    check_sample_call(model, prompts, 4, block_size=4)
    drawn = [SamplingParams(temperature=0), SamplingParams(temperature=1.5, seed=3), SamplingParams(top_k=8)]
    check_sample_call(model, prompts, 4, drawn, block_size=4)
