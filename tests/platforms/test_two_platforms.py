"""Two models built on two platforms live in one process: the CPU platform (C++ kernels,
packed weights, the C++ paged attention, the GGUF file's blocks) and the torch reference
platform (plain torch ops and attention, dense weights). Each gives transformers' greedy
tokens, built and run interleaved, so neither can lean on a process-wide choice."""

from __future__ import annotations

import pytest
import torch

from aiolm.attention.cpu_backend import CpuPagedAttention
from aiolm.attention.torch_backend import TorchAttention
from aiolm.checkpoint.source import resolve_model
from aiolm.kernels import cpu as cpu_kernels
from aiolm.kernels.ops import TorchOps
from aiolm.model.registry import build_model
from aiolm.platforms import get_platform
from aiolm.quant.base import LinearMethod
from aiolm.quant.cpu_packed import CpuPackedMethod
from paged import PagedHarness, hf_greedy

NEW_TOKENS = 12
PROMPTS = [[5, 17, 300, 42, 8, 99, 123], [400, 3, 3, 250, 77], list(range(60, 100))]


def _assert_reference(model) -> None:
    layer = model.layers[0]
    assert type(layer.mlp.ops) is TorchOps
    assert type(layer.self_attn.attn) is TorchAttention
    assert type(layer.self_attn.qkv_proj.quant_method) is LinearMethod  # dense F.linear
    assert layer.fused is None


def test_cpu_and_reference_models_in_one_process_each_match_transformers(tiny_llama):
    folder, hf = tiny_llama
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    src = resolve_model(folder)
    native = build_model(src, torch.float32)  # the CPU platform, as a worker builds it
    reference = build_model(src, torch.float32, platform=get_platform("cpu", reference=True))
    assert get_platform("torch") is get_platform("cpu", reference=True)
    assert get_platform("cpu") is not get_platform("torch")
    _assert_reference(reference)
    layer = native.layers[0]
    assert type(layer.self_attn.qkv_proj.quant_method) is CpuPackedMethod
    assert layer.self_attn.qkv_proj.packed is not None  # laid out once, after loading
    assert native.lm_head.weight is native.embed_tokens.weight  # tied: the embedding keeps reading it
    if cpu_kernels.load():
        assert type(layer.mlp.ops).__name__ == "CpuKernelOps"
        assert type(layer.self_attn.attn) is CpuPagedAttention

    # interleaved, step by step: each model runs on what it was built with
    a, b = PagedHarness(native, block_size=4), PagedHarness(reference, block_size=4)
    seqs = dict(enumerate(PROMPTS))
    outs: dict[str, dict[int, list[int]]] = {"native": {i: [] for i in seqs}, "reference": {i: [] for i in seqs}}
    for step in range(NEW_TOKENS):
        for name, h in (("native", a), ("reference", b)):
            feed = seqs if step == 0 else {i: o[-1:] for i, o in outs[name].items()}
            logits = h.step(feed)
            for i in seqs:
                outs[name][i].append(int(logits[i].argmax()))
    assert [outs["native"][i] for i in seqs] == expected
    assert [outs["reference"][i] for i in seqs] == expected


@pytest.mark.slow
def test_real_model_on_both_platforms_matches_transformers(real_source, real_model, hf_reference, tokenizer):
    """The embedded SmolLM2 GGUF: the CPU platform's model decodes from the file's blocks,
    the reference platform's from dense float32 weights; both give transformers' tokens."""
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("The capital of France is", chat)]
    expected = [hf_greedy(hf_reference, p, 16) for p in prompts]
    reference = build_model(real_source, torch.float32, platform=get_platform("torch"))
    _assert_reference(reference)
    assert PagedHarness(reference).greedy(prompts, 16) == expected
    if cpu_kernels.load():
        assert real_model.layers[0].fused is not None  # its decode steps: one C++ call a layer
    assert PagedHarness(real_model).greedy(prompts, 16) == expected
    assert "Paris" in tokenizer.decode(expected[1])


def test_a_layer_is_built_with_its_ops_or_not_at_all():
    """No process-wide default to fall back on: a layer without ops cannot be built."""
    from aiolm.model.layers.norm import RMSNorm

    with pytest.raises(TypeError):
        RMSNorm(8, 1e-6)  # type: ignore[call-arg]
    from aiolm.kernels import ops

    assert not any(hasattr(ops, name) for name in ("install", "current", "_impl", "rms_norm"))
