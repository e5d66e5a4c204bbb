"""Greedy float32 output matches transformers token for token."""

from __future__ import annotations

import json

import pytest
import torch

from paged import PagedHarness, hf_greedy, parity_prompt_ids


@pytest.fixture(scope="module")
def reference(tokenizer, hf_reference):
    prompts = parity_prompt_ids(tokenizer)
    return prompts, [hf_greedy(hf_reference, p, 48) for p in prompts]


@pytest.mark.slow
def test_real_model_matches_transformers_in_one_flat_batch(real_model, reference, tokenizer):
    prompts, expected = reference
    ours = PagedHarness(real_model).greedy(prompts, 48)
    for p, e, o in zip(prompts, expected, ours):
        assert o == e, f"diverged for {tokenizer.decode(p)!r}: {tokenizer.decode(o)!r} vs {tokenizer.decode(e)!r}"
    assert "Paris" in tokenizer.decode(ours[-1])


@pytest.mark.slow
def test_bfloat16_matmuls_still_answer_the_chat_question(real_source, reference, tokenizer):
    """--dtype bfloat16 on a CPU rounds what goes into each decoder matmul to 8 bits and keeps
    the KV cache in float16 (as the model runner does): the answers may drift from float32's
    after a while, but not on a plain question."""
    from aiolm.model.registry import build_model

    prompts, expected = reference
    model = build_model(real_source, torch.bfloat16)
    ours = PagedHarness(model, dtype=torch.float16).greedy(prompts[-1:], 12)[0]
    assert "Paris" in tokenizer.decode(ours)
    assert ours[:8] == expected[-1][:8]


@pytest.mark.slow
def test_real_model_prefill_split_across_two_passes(real_model, reference):
    prompts, expected = reference
    shortest = min(len(p) for p in prompts)
    ours = PagedHarness(real_model, block_size=16).greedy(prompts, 24, split=shortest // 2 + 1)
    assert ours == [e[:24] for e in expected]


@pytest.mark.slow
def test_sequences_of_different_lengths_arrive_at_different_steps(real_model, reference):
    """A decode step of one sequence and the prefill of another share one flat batch."""
    prompts, expected = reference
    h = PagedHarness(real_model, block_size=8)
    first = h.step({0: prompts[0]})[0]
    out0 = [int(first.argmax())]
    logits = h.step({0: [out0[-1]], 1: prompts[1]})
    out0.append(int(logits[0].argmax()))
    out1 = [int(logits[1].argmax())]
    for _ in range(10):
        logits = h.step({0: [out0[-1]], 1: [out1[-1]]})
        out0.append(int(logits[0].argmax()))
        out1.append(int(logits[1].argmax()))
    assert out0 == expected[0][:12]
    assert out1 == expected[1][:11]


def _tiny_hf_model(kind: str, tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    common = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=32, **common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
        with torch.no_grad():  # random init zeroes biases; make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    if kind == "qwen3":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    model = model.float().eval()
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_tiny_random_qwen_matches_transformers(kind, tmp_path, tokenizer):
    from aiolm.checkpoint.source import resolve_model
    from aiolm.model.registry import build_model

    hf = _tiny_hf_model(kind, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"][0].lower().startswith(kind)
    src = resolve_model(tmp_path)
    assert src.config.qk_norm == (kind == "qwen3")
    assert src.config.attention_bias == (kind == "qwen2")
    ours = build_model(src, torch.float32)
    prompts = [
        tokenizer(t, add_special_tokens=False)["input_ids"]
        for t in ("Hello there, general", "a b c d e f g h i j k l m n o p q r s", "Ünïcödé 🍎")
    ]
    expected = [hf_greedy(hf, p, 12) for p in prompts]
    assert PagedHarness(ours, block_size=4).greedy(prompts, 12) == expected
    assert PagedHarness(ours, block_size=4).greedy(prompts, 12, split=3) == expected


@pytest.mark.slow
def test_torch_reference_attention_backend_gives_the_same_tokens(real_source, real_model, reference, tokenizer):
    """--attention-backend torch (the reference every backend is tested against) against the
    default CPU kernels: the same greedy tokens on the real model."""
    from aiolm.attention.cpu_backend import CpuPagedAttention
    from aiolm.attention.torch_backend import TorchAttention
    from aiolm.model.registry import build_model

    prompts, expected = reference
    model = build_model(real_source, torch.float32, attention="torch")
    assert type(model.layers[0].self_attn.attn) is TorchAttention
    assert type(real_model.layers[0].self_attn.attn) is CpuPagedAttention  # 'auto' on a CPU
    ours = PagedHarness(model).greedy(prompts[-2:], 24)
    assert ours == [e[:24] for e in expected[-2:]]


def test_attention_backend_choice_is_checked(monkeypatch):
    from aiolm.platforms import get_platform

    cpu = get_platform("cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the Triton tests' conftest sets it
    with pytest.raises(ValueError, match="'triton' does not run on cpu"):
        cpu.attention_backend("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # triton's CPU interpreter: offered for tests and checks
    assert cpu.attention_backend("triton").__name__ == "TritonAttention"
    with pytest.raises(ValueError, match="'flash' is not known"):
        cpu.attention_backend("flash")
    assert cpu.attention_backend("torch").__name__ == "TorchAttention"
