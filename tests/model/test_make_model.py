"""benchmarks/make_model.py: aiolm reads every format it writes, and agrees with transformers.

The 1.1B model is for benchmarks only; ``--scale tiny`` has its structure (grouped KV
heads, an untied LM head, head_dim 64, the SmolLM2 vocabulary and tokenizer) and is
written in seconds. transformers reads the same files: the float32 folder in a plain
greedy loop, the GGUF through its own GGUF loader (which undoes llama.cpp's Q/K row
order by its own code), so a wrong permutation or a wrong tensor name shows as
different logits.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from aiolm.checkpoint.gguf_cache import gguf_cache_folder
from aiolm.checkpoint.source import embedded_model_path, resolve_model
from aiolm.kernels import cpu as cpu_kernels
from aiolm.model.loader import iter_weights
from aiolm.model.registry import build_model
from paged import PagedHarness, hf_from_gguf, hf_greedy

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from make_model import SCALES, GGUFStream, make_model, read_manifest  # noqa: E402

NEW_TOKENS = 8
TEXT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    out = tmp_path_factory.mktemp("made")
    # the embedded tokenizer comes from the user's cache, converted once for the whole suite
    manifest = make_model(out / "tiny", "tiny", formats=("f32", "bf16", "q4_0", "q4_k_m", "gptq"))
    # The tiny GGUF's conversion goes to a private cache; the compiled CPU kernels are the
    # suite's own (built once per machine), linked in rather than built again for one test.
    private = out / "aiolm-cache"
    private.mkdir()
    cpu_kernels.cache_dir().mkdir(parents=True, exist_ok=True)
    (private / "kernels").symlink_to(cpu_kernels.cache_dir(), target_is_directory=True)
    # So is the embedded model's converted folder (make_model copies its tokenizer from it):
    # the later tests' make_model calls run under the private cache, and converted it again.
    embedded = gguf_cache_folder(embedded_model_path())  # make_model above converted it already
    (private / embedded.name).symlink_to(embedded, target_is_directory=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AIOLM_CACHE_DIR", str(private))
        yield out / "tiny", manifest


@pytest.fixture(scope="module")
def prompt(made):
    return resolve_model(made[0] / "hf-float32").load_tokenizer()(TEXT, add_special_tokens=False)["input_ids"]


def weights(path: Path) -> dict[str, torch.Tensor]:
    return dict(iter_weights(resolve_model(path)))


def aiolm_greedy(path: Path, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """aiolm's model over a paged cache: greedy tokens, and the prompt's last logits."""
    model = build_model(resolve_model(path), torch.float32)
    first = PagedHarness(model).step({0: prompt})[0]
    return PagedHarness(model).greedy([prompt], NEW_TOKENS)[0], first


def test_manifest_and_shape(made):
    out, manifest = made
    assert read_manifest(out) == manifest
    assert manifest["files"] == {
        "f32": "hf-float32",
        "bf16": "hf-bfloat16",
        "q4_0": "model-Q4_0.gguf",
        "q4_k_m": "model-Q4_K_M.gguf",
        "gptq": "hf-gptq",
    }
    src = resolve_model(out / "hf-float32")
    tiny = SCALES["tiny"]
    assert (
        src.config.hidden_size,
        src.config.num_layers,
        src.config.num_heads,
        src.config.num_kv_heads,
        src.config.head_dim,
        src.config.vocab_size,
    ) == (tiny.hidden, tiny.layers, tiny.heads, tiny.kv_heads, 64, 49152)
    assert not src.config.tie_word_embeddings
    w = weights(out / "hf-float32")
    assert sum(t.numel() for t in w.values()) == manifest["parameters"]
    q = w["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype == torch.float32 and 0.019 < float(q.std()) < 0.021
    assert torch.equal(w["model.norm.weight"], torch.ones(tiny.hidden))
    assert not torch.equal(q, w["model.layers.1.self_attn.q_proj.weight"])  # each tensor its own draw


def test_float32_folder_matches_transformers(made, prompt):
    from transformers import AutoModelForCausalLM

    path = made[0] / "hf-float32"
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = ref(torch.tensor([prompt])).logits[0, -1]
    tokens, logits = aiolm_greedy(path, prompt)
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert tokens == hf_greedy(ref, prompt, NEW_TOKENS)


def test_bfloat16_folder_holds_the_float32_weights_rounded(made, prompt):
    f32, bf16 = weights(made[0] / "hf-float32"), weights(made[0] / "hf-bfloat16")
    assert f32.keys() == bf16.keys()
    for name, t in bf16.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, f32[name].to(torch.bfloat16)), name
    tokens, logits = aiolm_greedy(made[0] / "hf-bfloat16", prompt)
    assert torch.isfinite(logits).all() and len(tokens) == NEW_TOKENS


def test_gguf_holds_the_same_weights_and_matches_transformers(made, prompt):
    gguf_path = made[0] / "model-Q4_0.gguf"
    f32, q4 = weights(made[0] / "hf-float32"), weights(gguf_path)
    assert f32.keys() == q4.keys()
    for name, t in q4.items():
        # Q4_0 rounds each block of 32 to 16 levels a step of its largest magnitude / 8
        # apart (the top level clipped, the step stored in float16): the error is at most
        # about one step, while a row from the wrong place would be off by the block's size
        bound = f32[name].abs().reshape(-1, 32).amax(1, keepdim=True) / 7.5 + 1e-7
        assert ((t - f32[name]).reshape(-1, 32).abs() <= bound).all(), name
    ref = hf_from_gguf(gguf_path)
    with torch.no_grad():
        expected = ref(torch.tensor([prompt])).logits[0, -1]
    tokens, logits = aiolm_greedy(gguf_path, prompt)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert tokens == hf_greedy(ref, prompt, NEW_TOKENS)
    # the GGUF's tokenizer metadata is the embedded SmolLM2's: same ids for the same text
    tok = resolve_model(gguf_path).load_tokenizer()
    assert tok(TEXT, add_special_tokens=False)["input_ids"] == prompt


def test_q4_k_m_gguf_has_llama_cpps_mix_of_the_same_weights(made):
    """--formats q4_k_m on the dense Llama: llama.cpp's choice for each tensor (at the 1.1B
    shape Q4_K, and Q6_K for the output and for attn_v and ffn_down in the layers given more
    bits; at the tiny shape, whose rows are not whole super-blocks of 256, the types llama.cpp
    falls back to: Q5_0 and Q8_0), each holding the float32 folder's weight. (aiolm's reading
    of these types is tested with the kernels: tests/kernels/test_gguf_kquants.py.)"""
    import gguf

    from aiolm.checkpoint.gguf_convert import gguf_name, permute_rope_rows

    full = SimpleNamespace(gguf=gguf, s=SCALES["full"], qtype="Q4_K_M")
    hidden, inter = SCALES["full"].hidden, SCALES["full"].intermediate
    chosen = {
        name: GGUFStream.tensor_type(full, name, shape).name
        for name, shape in [
            ("output.weight", (49152, hidden)),
            ("blk.0.attn_v.weight", (256, hidden)),  # the first eighth of 22 layers: 0 and 1
            ("blk.2.attn_v.weight", (256, hidden)),
            ("blk.4.ffn_down.weight", (hidden, inter)),  # every third from the first eighth's end
            ("blk.4.attn_q.weight", (hidden, hidden)),
            ("blk.21.ffn_down.weight", (hidden, inter)),  # the last eighth: 20 and 21
            ("blk.4.attn_norm.weight", (hidden,)),
        ]
    }
    assert chosen == {
        "output.weight": "Q6_K",
        "blk.0.attn_v.weight": "Q6_K",
        "blk.2.attn_v.weight": "Q4_K",
        "blk.4.ffn_down.weight": "Q6_K",
        "blk.4.attn_q.weight": "Q4_K",
        "blk.21.ffn_down.weight": "Q6_K",
        "blk.4.attn_norm.weight": "F32",
    }
    tensors = {t.name: t for t in gguf.GGUFReader(str(made[0] / "model-Q4_K_M.gguf")).tensors}
    types = {name: t.tensor_type.name for name, t in tensors.items()}
    assert types["output.weight"] == types["blk.1.ffn_down.weight"] == "Q8_0"  # Q6_K's fallback
    assert types["blk.0.attn_q.weight"] == types["blk.0.ffn_down.weight"] == "Q5_0"  # Q4_K's
    heads, kv_heads = SCALES["tiny"].heads, SCALES["tiny"].kv_heads
    f32 = weights(made[0] / "hf-float32")
    assert {gguf_name(name) for name in f32} == set(tensors)
    for name, w in f32.items():
        t = tensors[gguf_name(name)]
        got = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(w.shape)
        want = w.numpy()
        if name.endswith(("q_proj.weight", "k_proj.weight")):  # llama.cpp's RoPE row order
            want = permute_rope_rows(want, heads if "q_proj" in name else kv_heads)
        # Q5_0 rounds a block of 32 to steps of its largest magnitude / 16, Q8_0 / 127: the error
        # is at most a step, while a row from the wrong place would be off by the block's size
        bound = np.abs(want).reshape(-1, 32).max(1, keepdims=True) / 15 + 1e-7 if w.dim() == 2 else 0
        assert (np.abs(got - want).reshape(-1, 32) <= bound).all(), name


def test_gptq_folder_holds_the_float32_weights_rounded_to_4_bits(made, prompt):
    """The benchmark's GPTQ folder (symmetric, no activation order, groups of 32 at this size):
    each decoder linear within half a step of the float32 weight, the rest unchanged; aiolm
    runs it as it reads it (transformers on those values is the reference)."""
    from transformers import AutoModelForCausalLM

    f32, q = weights(made[0] / "hf-float32"), weights(made[0] / "hf-gptq")
    assert f32.keys() == q.keys()
    for name, t in q.items():
        if name.endswith("proj.weight"):
            step = f32[name].abs().reshape(-1, 32).amax(1, keepdim=True) / 7
            assert ((t - f32[name]).reshape(-1, 32).abs() <= step * 0.5001 + 1e-6).all(), name
            assert not torch.equal(t, f32[name])
        else:
            assert torch.equal(t, f32[name]), name
    ref = AutoModelForCausalLM.from_pretrained(made[0] / "hf-float32", dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(q[name])
    tokens, logits = aiolm_greedy(made[0] / "hf-gptq", prompt)
    with torch.no_grad():
        expected = ref(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert tokens == hf_greedy(ref, prompt, NEW_TOKENS)


def test_engine_generates_from_the_gguf(made, prompt):
    """The real engine (worker process, C++ block kernels for one-row steps) on the Q4_0 file."""
    from aiolm import LLM, SamplingParams

    gguf_path = made[0] / "model-Q4_0.gguf"
    expected, _ = aiolm_greedy(gguf_path, prompt)
    llm = LLM(str(gguf_path), dtype="float32", max_model_len=256)  # the fixture's cache: converted already
    try:
        out = llm.generate(
            [{"prompt_token_ids": prompt}],
            SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1),
            use_tqdm=False,
        )[0].outputs[0]
    finally:
        llm.close()
    assert list(out.token_ids) == expected
    assert all(np.isfinite(lp[t].logprob) for lp, t in zip(out.logprobs, out.token_ids))


def test_a_format_added_later_keeps_the_earlier_ones_of_the_same_model(tmp_path):
    make_model(tmp_path, "tiny", formats=("f32",))
    added = make_model(tmp_path, "tiny", formats=("q8_0",))
    assert added["files"] == {"f32": "hf-float32", "q8_0": "model-Q8_0.gguf"}
    assert read_manifest(tmp_path) == added
    # another seed is another model: the earlier files no longer hold its weights
    assert make_model(tmp_path, "tiny", formats=("q8_0",), seed=1)["files"] == {"q8_0": "model-Q8_0.gguf"}


def test_a_mixture_of_experts_bound_counts_the_weights_a_token_uses(tmp_path):
    from machine_bounds import model_cost

    manifest = make_model(tmp_path, "tiny", formats=("f32", "q8_0"), moe=True)
    cost = model_cost(str(tmp_path / "hf-float32"))
    shape = manifest["shape"]
    assert cost.routed == shape["active"] / shape["experts"]
    experts = shape["layers"] * 3 * shape["experts"] * shape["moe_intermediate"] * shape["hidden"]
    assert cost.expert_params == experts
    # what a token leaves out is exactly the experts it is not routed to
    assert cost.matmul_params - cost.active_params == experts - experts * shape["active"] // shape["experts"]
    # the routed share of the experts' bytes: less than the file, more than its dense part
    gguf = tmp_path / "model-Q8_0.gguf"
    expert_share = cost.expert_params / cost.matmul_params
    size = gguf.stat().st_size
    assert size * (1 - expert_share) < cost.gguf_bytes(str(gguf)) < size
    make_model(tmp_path / "dense", "tiny", formats=("f32", "q8_0"))
    dense = model_cost(str(tmp_path / "dense" / "hf-float32"))
    assert (dense.expert_params, dense.routed, dense.active_params) == (0, 1.0, dense.matmul_params)
    assert (
        dense.gguf_bytes(str(tmp_path / "dense" / "model-Q8_0.gguf"))
        == (tmp_path / "dense" / "model-Q8_0.gguf").stat().st_size
    )
