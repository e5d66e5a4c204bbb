"""--kv-cache-dtype fp8 through the whole engine on the embedded model: a byte a value, so
the same --kv-cache-memory holds 4x float32's blocks (2x float16's), and greedy answers stay
those of the full-precision cache at first, the chat question's included. e4m3 keeps 3 bits
of mantissa, so later tokens may part from the float cache's (the note in docs/benchmarks.md
gives how far each parity prompt agrees); and the checkpoint's per-layer scales are read."""

from __future__ import annotations

import pytest
import torch

from aiolm import LLM, SamplingParams
from aiolm.checkpoint.source import resolve_model
from aiolm.model.registry import build_model
from lora_models import tiny_base
from paged import parity_prompt_ids

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
ENGINE = dict(dtype="float32", max_model_len=512, kv_cache_memory=48 << 20, max_num_seqs=8, executor="local")


@pytest.fixture(scope="module")
def runs(tokenizer):
    prompts = [{"prompt_token_ids": p} for p in parity_prompt_ids(tokenizer)]
    out = {}
    for kv in ("auto", "fp8"):
        with LLM(kv_cache_dtype=kv, **ENGINE) as llm:
            tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
            out[kv] = (llm.engine.scheduler.config.num_blocks, tokens)
    return out


def test_fp8_cache_holds_four_times_the_float32_blocks(runs):
    float_blocks, fp8_blocks = runs["auto"][0], runs["fp8"][0]
    assert fp8_blocks // 4 == float_blocks or (fp8_blocks + 3) // 4 == float_blocks


def test_fp8_cache_answers_like_the_float_cache_at_first(runs, tokenizer):
    (_, full), (_, fp8) = runs["auto"], runs["fp8"]
    agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(full, fp8)]
    print("tokens agreeing with the float32 cache, per parity prompt:", agree)
    assert min(agree) >= 4, agree
    assert "Paris" in tokenizer.decode(fp8[-1][:8])
    assert sum(a == 32 for a in agree) >= 1, agree


def test_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype: 'int4' is not supported; supported: auto, fp8, fp8_e4m3"):
        LLM(kv_cache_dtype="int4", **ENGINE)


def test_checkpoint_kv_scales_reach_each_layers_attention(tmp_path, real_source):
    """self_attn.k_scale / v_scale (or one kv_scale) per layer, as vLLM's tools write them."""
    from safetensors.torch import load_file, save_file

    base = tiny_base("llama", tmp_path / "m", real_source.path)
    tensors = load_file(base / "model.safetensors")
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.25)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor([2.0])
    tensors["model.layers.1.self_attn.kv_scale"] = torch.tensor(0.5)
    save_file(tensors, base / "model.safetensors")
    model = build_model(resolve_model(base), torch.float32)
    attn = [layer.self_attn.attn for layer in model.layers]
    assert [(a.k_scale, a.v_scale) for a in attn] == [(0.25, 2.0), (0.5, 0.5)]
