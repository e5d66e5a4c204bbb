"""Gemma 3 (text) and sliding-window Mistral match transformers past their window.

Tiny random models are built with transformers' own config classes and saved with the
embedded model's real tokenizer; transformers runs them with eager attention in a plain
greedy loop (explicit all-ones mask). Prompts are longer than the window of 16 keys, so
every answer depends on the window being honoured. Each model runs on the CPU backend
(the C++ paged attention the layers build) and on the torch reference backend
(TorchAttention put in place of each layer's backend, same window and scale), and once
more in a process started with AIOLM_DISABLE_CPU_KERNELS=1, where no C++ kernel runs at
all and the layers' own attention falls back to the torch backend.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aiolm.checkpoint.families import read_config
from aiolm.checkpoint.source import resolve_model
from aiolm.kernels import cpu as cpu_kernels
from aiolm.model.loader import iter_weights
from aiolm.model.registry import build_context, build_from_config, build_model, finish
from aiolm.platforms import get_platform
from paged import PagedHarness, hf_greedy

WINDOW = 16
NEW_TOKENS = 24
TEXTS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps on a warm windowsill "
    "and the rain keeps falling on the quiet little town by the sea, where fishermen mend "
    "their nets and children run along the harbour wall.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "print([fibonacci(i) for i in range(20)])",
    "Short one: hello there!",
]
GEMMA_LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def _randomize(model, norm_std: float) -> None:
    """Weights far from the init's 0.02 so logits are far from zero; norms random too
    (Gemma's are used as 1 + w, so they must not all be 0)."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((norm_std if "norm" in name else 0.15) * torch.randn_like(p))


def _gemma3(vocab: int):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        sliding_window=WINDOW,
        layer_types=GEMMA_LAYER_TYPES,
        query_pre_attn_scalar=48,
        final_logit_softcapping=3.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        },
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(cfg).float().eval()
    _randomize(model, norm_std=0.5)
    return model


def _mistral(vocab: int):
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        sliding_window=WINDOW,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = MistralForCausalLM(cfg).float().eval()
    _randomize(model, norm_std=0.1)
    with torch.no_grad():  # Llama-style norms multiply by w: keep them near 1
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(1.0)
    return model


@pytest.fixture(scope="module")
def prompts(tokenizer):
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    ids = [ids[0][:40], ids[1][:45], ids[2]]
    assert len(ids[0]) == 40 and len(ids[1]) == 45 and len(ids[2]) < WINDOW
    return ids


@pytest.fixture(scope="module", params=["gemma3", "mistral"])
def family(request, tokenizer, prompts, tmp_path_factory):
    """(kind, folder, the transformers model, its greedy tokens for each prompt)."""
    folder = tmp_path_factory.mktemp(request.param)
    hf = (_gemma3 if request.param == "gemma3" else _mistral)(len(tokenizer))
    hf.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return request.param, folder, hf, [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


def test_config_maps_windows_and_family_fields(family):
    kind, folder, _, _ = family
    src = resolve_model(folder)
    cfg = src.config
    if kind == "gemma3":
        assert cfg.architecture == "gemma3"
        assert cfg.sliding_windows == tuple(WINDOW if t == "sliding_attention" else None for t in GEMMA_LAYER_TYPES)
        assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 10000.0)
        assert cfg.rope_scaling["rope_type"] == "linear" and cfg.rope_scaling["factor"] == 2.0
        assert cfg.query_pre_attn_scalar == 48 and cfg.final_logit_softcapping == 3.0
        assert cfg.qk_norm and cfg.tie_word_embeddings and cfg.head_dim == 64
    else:
        assert cfg.architecture == "mistral" and cfg.sliding_windows == (WINDOW, WINDOW)
    model = build_model(src, torch.float32)
    assert [layer.self_attn.attn.sliding_window for layer in model.layers] == [
        cfg.window(i) for i in range(cfg.num_layers)
    ]
    assert src.load_tokenizer()("hello")["input_ids"]  # the folder carries the real tokenizer


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_greedy_matches_transformers_past_the_window(family, prompts, backend):
    kind, folder, _, expected = family
    if backend == "cpu" and not cpu_kernels.load():
        pytest.skip("no C++ compiler for the CPU kernels")
    model = build_model(resolve_model(folder), torch.float32, attention=backend)
    # pages of 16 keys (prefill tiles when head_dim is 64), then pages of 4 with the prompt
    # prefilled in two passes: windows start mid-page and cross page boundaries
    assert PagedHarness(model, block_size=16).greedy(prompts, NEW_TOKENS) == expected
    assert PagedHarness(model, block_size=4).greedy(prompts, NEW_TOKENS, split=3) == expected


_PLAIN_TORCH_CHILD = """
import json, sys
import torch
from aiolm.kernels import cpu
from aiolm.checkpoint.source import resolve_model
from aiolm.model.registry import build_model
from paged import PagedHarness
assert not cpu.load()
model = build_model(resolve_model(sys.argv[1]), torch.float32)
prompts = json.loads(sys.argv[2])
print(json.dumps([PagedHarness(model, block_size=bs).greedy(prompts, int(sys.argv[3]), split=split)
                  for bs, split in ((16, None), (4, 3))]))
"""


def test_greedy_matches_transformers_with_no_cpu_kernels_at_all(family, prompts):
    kind, folder, _, expected = family
    tests = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-c", _PLAIN_TORCH_CHILD, str(folder), json.dumps(prompts), str(NEW_TOKENS)],
        cwd=tests.parent,
        capture_output=True,
        text=True,
        timeout=600,
        env={
            **os.environ,
            "AIOLM_DISABLE_CPU_KERNELS": "1",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": f"{tests.parent}{os.pathsep}{tests}",
        },
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [expected, expected]


def test_logits_match_and_the_window_matters(family, prompts):
    """Last-position logits close to transformers' (Gemma's soft-capped ones included);
    the same weights without windows are visibly off, so the comparison sees the window."""
    kind, folder, hf, _ = family
    src = resolve_model(folder)
    ours = PagedHarness(build_model(src, torch.float32)).step({i: p for i, p in enumerate(prompts)})
    with torch.no_grad():
        theirs = [
            hf(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long)).logits[0, -1] for p in prompts
        ]
    for i in range(len(prompts)):
        torch.testing.assert_close(ours[i], theirs[i], rtol=1e-4, atol=1e-4)
    if kind == "gemma3":
        assert max(float(t.abs().max()) for t in theirs) <= 3.0  # the soft-cap bounds them
    plain_cfg = dataclasses.replace(src.config, sliding_windows=())
    ctx = build_context(get_platform("cpu"), torch.float32)
    plain = build_from_config(plain_cfg, ctx)
    plain.load_weights(iter_weights(src))
    off = PagedHarness(finish(plain, ctx)).step({i: p for i, p in enumerate(prompts)})
    assert (off[0] - theirs[0]).abs().max() > 1e-3  # 40 tokens: past the window
    torch.testing.assert_close(off[2], theirs[2], rtol=1e-4, atol=1e-4)  # shorter than it: same


def test_gemma3_original_config_spelling_reads_the_same():
    """Checkpoints written before transformers 5 spell RoPE and the layer pattern differently."""
    from transformers import Gemma3TextConfig

    new = Gemma3TextConfig(
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=12,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        sliding_window=512,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        },
    )
    new_dict = {**json.loads(new.to_json_string()), "architectures": ["Gemma3ForCausalLM"]}
    old = {k: v for k, v in new_dict.items() if k not in ("rope_parameters", "layer_types")}
    old.update(
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        sliding_window_pattern=6,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )
    a, b = read_config(new_dict), read_config(old)
    assert dataclasses.replace(a, rope_scaling=None) == dataclasses.replace(b, rope_scaling=None)
    assert {k: a.rope_scaling[k] for k in ("rope_type", "factor")} == b.rope_scaling
    assert a.sliding_windows == tuple(None if (i + 1) % 6 == 0 else 512 for i in range(12))
    assert (a.rope_theta, a.rope_local_theta, a.rope_scaling["factor"]) == (1e6, 1e4, 8.0)


def test_sliding_window_fields_of_the_llama_family():
    base = dict(
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    assert read_config({**base, "architectures": ["MistralForCausalLM"], "sliding_window": None}).sliding_windows == ()
    assert read_config({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 8}).window(3) == 8
    # Llama has no sliding window, whatever the config says; Qwen2 only with use_sliding_window
    assert read_config({**base, "architectures": ["LlamaForCausalLM"], "sliding_window": 8}).sliding_windows == ()
    qwen = {**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 8, "max_window_layers": 2}
    assert read_config(qwen).sliding_windows == ()
    assert read_config({**qwen, "use_sliding_window": True}).sliding_windows == (None, None, 8, 8)
    from aiolm.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="sliding_window must be a positive integer"):
        read_config({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 0})
    with pytest.raises(ModelLoadError, match="use_bidirectional_attention"):
        read_config({**base, "architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True})


@pytest.mark.slow
def test_engine_serves_the_family_from_its_folder(family, prompts):
    """The whole path: the registry names the family, worker processes build it, the
    KV cache is sized from its config, and greedy answers are transformers' own."""
    from aiolm import LLM, SamplingParams

    kind, folder, _, expected = family
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    with LLM(
        str(folder), max_model_len=128, kv_cache_memory=16 << 20, max_num_seqs=4, num_threads=1, block_size=16
    ) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
