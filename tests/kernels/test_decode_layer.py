"""aiolm::decode_layer, a decoder layer's small steps as one C++ call, and
aiolm::decode_layers, all the layers of a step as one call, against the layers' own
modules on the real model: the same bits, with float or int8 activations, a float32 or
float16 cache, a sliding window and a QKV bias. aiolm::decode_sample, the same call with
the final norm, the LM head and each row's argmax or draw: the tokens the sampler takes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from aiolm.checkpoint.source import resolve_model
from aiolm.kernels import cpu as cpu_kernels
from aiolm.model.registry import build_model
from aiolm.params import SamplingParams
from aiolm.quant import gguf_blocks
from paged import PagedHarness, check_sample_call

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ compiler for the CPU kernels")


@pytest.fixture(scope="module")
def model():
    return build_model(resolve_model(None))


def _run(model, plans, cache_dtype, stack=None) -> tuple[list[dict[int, torch.Tensor]], int]:
    """A prefill, decode steps of two rows and a step of 3 + 1 rows; returns the logits and
    how many layer steps the fused calls took (``stack``: the model's one call for all
    layers, whose steps count once per layer)."""
    taken = [0]

    def counted(plan):
        def call(*args):
            out = plan(*args)
            taken[0] += out is not None
            return out

        return call

    for layer, plan in zip(model.layers, plans):
        layer.fused = counted(plan) if plan is not None else None
    model.fused_stack = None
    if stack is not None:

        def whole(*args):
            out = stack(*args)
            taken[0] += len(model.layers) * (out is not None)
            return out

        model.fused_stack = whole
    h = PagedHarness(model, num_blocks=64, dtype=cache_dtype)
    outs = [h.step({0: list(range(100, 140)), 1: list(range(300, 333))})]
    outs += [h.step({0: [5 + i], 1: [7 + i]}) for i in range(4)]
    outs.append(h.step({0: [1, 2, 3], 1: [9]}))
    return outs, taken[0]


@pytest.mark.parametrize("how", ["per-layer", "one-call"])
@pytest.mark.parametrize("int8", [False, True], ids=["float-x", "int8-x"])
@pytest.mark.parametrize("variant", ["plain", "float16-cache", "window-and-bias"])
def test_fused_layer_gives_the_modules_bits(model, how, int8, variant, monkeypatch):
    monkeypatch.setattr(gguf_blocks, "INT8", int8)
    attns = [layer.self_attn for layer in model.layers]
    saved = [(a.attn.sliding_window, a.qkv_proj.bias) for a in attns]
    try:
        if variant == "window-and-bias":  # a window shorter than the prompts, a bias on q, k and v
            g = torch.Generator().manual_seed(0)
            for a in attns:
                a.attn.sliding_window = 24
                a.qkv_proj.bias = nn.Parameter(
                    0.05 * torch.randn(a.qkv_proj.gguf.blocks.n, generator=g), requires_grad=False
                )
        plans = [gguf_blocks.FusedDecodeLayer.of(layer) for layer in model.layers]
        assert all(p is not None for p in plans), "every layer of the embedded model should be fused"
        dtype = torch.float16 if variant == "float16-cache" else torch.float32
        ref, none_taken = _run(model, [None] * len(plans), dtype)
        if how == "per-layer":
            got, taken = _run(model, plans, dtype)
        else:
            stack = gguf_blocks.FusedDecodeStack.of(plans)
            assert stack is not None
            got, taken = _run(model, [None] * len(plans), dtype, stack)
    finally:
        for a, (window, bias) in zip(attns, saved):
            a.attn.sliding_window, a.qkv_proj.bias = window, bias
        for layer in model.layers:
            layer.fused = gguf_blocks.FusedDecodeLayer.of(layer)
        model.process_weights_after_loading()
    # Every step but the prefill (73 rows), which int8 takes too where its 4-bit kernel has VNNI.
    steps = 6 if int8 and cpu_kernels.has_avx512_vnni() else 5
    assert none_taken == 0 and taken == steps * len(plans)
    for step, (r, o) in enumerate(zip(ref, got)):
        for seq in r:
            assert torch.equal(r[seq], o[seq]), f"step {step}, sequence {seq}: the fused layer's logits differ"


def test_the_model_takes_one_call_for_its_layers_where_each_has_one(model):
    assert isinstance(model.fused_stack, gguf_blocks.FusedDecodeStack)
    assert len(model.fused_stack.layers) == len(model.layers)
    first = model.layers[0].fused
    try:
        model.layers[0].fused = None  # one layer without a fused step: no stack
        model.process_weights_after_loading()
        assert model.fused_stack is None
    finally:
        model.layers[0].fused = first
        model.process_weights_after_loading()
    assert isinstance(model.fused_stack, gguf_blocks.FusedDecodeStack)


def test_layers_of_another_shape_keep_their_modules(model):
    layer = model.layers[0]
    assert gguf_blocks.FusedDecodeLayer.of(layer) is not None
    o_bias = layer.self_attn.o_proj.bias
    try:
        layer.self_attn.o_proj.bias = nn.Parameter(
            torch.zeros(layer.self_attn.o_proj.gguf.blocks.n), requires_grad=False
        )
        assert gguf_blocks.FusedDecodeLayer.of(layer) is None  # the C++ step adds no o bias
    finally:
        layer.self_attn.o_proj.bias = o_bias


def test_an_error_inside_the_step_s_team_is_raised_and_the_team_recovers(model):
    """A decode step's layers run as one team of threads (ext/cpu/decode_layer.cpp,
    decode_team); an op that fails on one of them ends the step with the op's error, not a
    crash or a hang, and later steps run as before."""
    stack = model.fused_stack
    prompt = list(range(100, 120))
    expected = PagedHarness(model, num_blocks=16)
    expected.step({0: prompt})
    expected = expected.step({0: [5]})[0]

    def narrower(positions, x, residual, kv_caches, meta):  # x no longer the norm's width
        return stack(positions, x[:, :-32].contiguous(), residual, kv_caches, meta)

    h = PagedHarness(model, num_blocks=16)
    h.step({0: prompt})
    try:
        model.fused_stack = narrower
        with pytest.raises(RuntimeError, match=r"a norm's weights must be float32, one per feature of the rows \(544"):
            h.step({0: [5]})
    finally:
        model.fused_stack = stack
    h = PagedHarness(model, num_blocks=16)
    h.step({0: prompt})
    assert torch.equal(h.step({0: [5]})[0], expected)


# Per row in turn: greedy, plain temperature, top-k, top-p (seeded), all the filters (seeded).
SAMPLED = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_k=20),
    SamplingParams(temperature=0.7, top_p=0.9, seed=5),
    SamplingParams(temperature=1.2, top_k=50, top_p=0.95, min_p=0.02, seed=9),
]


@pytest.mark.parametrize("int8", [False, True], ids=["float-x", "int8-x"])
@pytest.mark.parametrize("rows", [1, 3, "most"])
@pytest.mark.parametrize("draw", ["greedy", "sampled"])
def test_a_decode_step_s_tokens_come_from_one_call_as_the_model_and_the_sampler_give_them(
    model, int8, rows, draw, monkeypatch
):
    """model.sampled_tokens (the layers, the final norm, the LM head and each row's argmax or
    draw in one C++ call) against forward, compute_logits and the sampler on a twin cache:
    the same tokens step after step, and the same cache after, for every step size it takes.
    Drawn rows take the sampler's uniform numbers from the same generators."""
    monkeypatch.setattr(gguf_blocks, "INT8", int8)
    n = gguf_blocks.MAX_ROWS if rows == "most" else rows
    assert isinstance(model.sample_step, gguf_blocks.FusedSampleStep)
    prompts = {i: list(range(100 + 11 * i, 121 + 13 * i)) for i in range(n)}
    params = None if draw == "greedy" else [SAMPLED[(i + 1) % len(SAMPLED)] for i in range(n)]
    blocks = sum(-(-(len(p) + 8) // 16) for p in prompts.values())  # the prompts and the steps after
    check_sample_call(model, prompts, 5, params, num_blocks=blocks + 1)


def test_the_call_declines_steps_it_does_not_take(model, monkeypatch):
    """Steps the blocks do not take (more rows than the float kernels' limit) go the model's
    own way (None, not a guess) without drawing from the rows' generators (the sampler draws
    next), and a model whose LM head has no blocks has no such call."""
    from aiolm.sample.sampler import SamplingMetadata, make_generator

    monkeypatch.setattr(gguf_blocks, "INT8", False)
    h = PagedHarness(model, num_blocks=64)
    too_many = {i: list(range(100 + i, 110 + i)) for i in range(gguf_blocks.MAX_ROWS + 1)}
    h.step(too_many)
    assert h.sampled_tokens({i: [5] for i in too_many}) is None
    n = len(too_many)
    gens = [make_generator(i) for i in range(n)]
    default = make_generator(99)
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(n)]
    meta = SamplingMetadata.build(params, [[]] * n, [[]] * n, model.config.vocab_size, "cpu", gens, default)
    states = [g.get_state() for g in (*gens, default)]
    assert h.sampled_tokens({i: [6] for i in too_many}, meta) is None
    assert all(torch.equal(g.get_state(), s) for g, s in zip((*gens, default), states))
    head, blocks = model.lm_head, model.lm_head.gguf
    try:
        head.gguf = None  # a head in a block type the kernels do not take
        model.process_weights_after_loading()
        assert model.sample_step is None
    finally:
        head.gguf = blocks
        model.process_weights_after_loading()
    assert isinstance(model.sample_step, gguf_blocks.FusedSampleStep)
