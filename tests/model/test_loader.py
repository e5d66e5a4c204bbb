"""Model loading: GGUF conversion of every tensor type, the conversion cache, Hugging Face
folders (single file, sharded, tied/untied, both RoPE config spellings) and typed errors.

Every GGUF here is written by the test with gguf.GGUFWriter. Their tokenizer is a tiny
byte-level BPE (256 byte symbols, 3 control tokens, 10 merges) rather than a copy of the
real 49152-token one: gguf's reader and transformers' GGUF tokenizer builder spend tens of
seconds on the real vocabulary, and the conversion path under test is the same.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from aiolm.checkpoint.families import MODELS, read_config
from aiolm.checkpoint.gguf_cache import cache_root
from aiolm.checkpoint.gguf_convert import SUPPORTED_TYPES, unpermute_rope_rows
from aiolm.checkpoint.source import embedded_model_path, resolve_model
from aiolm.errors import ModelLoadError
from aiolm.model.loader import iter_weights
from aiolm.model.registry import build_context, build_from_config, build_model, finish
from aiolm.platforms import get_platform
from aiolm.platforms.cpu import bfloat16_matmuls
from paged import PagedHarness

ROOT = Path(__file__).resolve().parents[2]
Q = gguf.GGMLQuantizationType

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 64, 4, 2, 256, 2
HEAD_DIM = HIDDEN // HEADS
ROPE_THETA = 50000.0
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "a n", "e r", "Ġ a", "o n", "r e", "Ġ s"]

# Where each type goes. K-quants need rows of 256: ffn_down's input is FFN = 256 wide.
MIXED_TYPES = {
    "embd": Q.Q8_0,
    "out": Q.Q4_0,
    0: {"q": Q.Q4_0, "k": Q.Q4_1, "v": Q.Q8_0, "o": Q.F16, "gate": Q.BF16, "up": Q.Q4_0, "down": Q.Q4_K},
    1: {"q": Q.F16, "k": Q.BF16, "v": Q.Q4_1, "o": Q.Q8_0, "gate": Q.Q4_1, "up": Q.F32, "down": Q.Q6_K},
}
BRIEF_TYPES = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"}


# ----------------------------------------------------------------------------- helpers


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's Q/K permutation (rotate-half -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_level_vocab() -> tuple[list[str], list[int]]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + list(bytes_to_unicode().values())
    tokens += [m.replace(" ", "") for m in MERGES]
    return tokens, [3, 3, 3] + [1] * (len(tokens) - 3)


VOCAB = len(byte_level_vocab()[0])


def _k_quant_bytes(rng: np.random.Generator, qtype: Q, rows: int, cols: int) -> np.ndarray:
    """Random but valid K-quant blocks: random quants and sub-scales, sane fp16 super-scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    f16 = lambda x: np.frombuffer(np.float16(x).tobytes(), np.uint8)  # noqa: E731
    if qtype == Q.Q4_K:  # d, dmin, scales[12], qs[128]
        raw[:, 0:2], raw[:, 2:4] = f16(2e-3), f16(1e-3)
    elif qtype == Q.Q6_K:  # ql[128], qh[64], scales[16] (int8), d
        raw[:, 208:210] = f16(1e-4)
    else:
        raise AssertionError(qtype)
    return raw.reshape(rows, cols // block * size)


def _metadata(w: gguf.GGUFWriter, *, skip: tuple[str, ...] = (), tokenizer: bool = True) -> None:
    if "block_count" not in skip:
        w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    if "feed_forward_length" not in skip:
        w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(ROPE_THETA)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_vocab_size(VOCAB)
    if tokenizer:
        tokens, types = byte_level_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(MERGES)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(False)
        w.add_chat_template(CHAT_TEMPLATE)


def _finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_llama_gguf(path: Path, types: dict, tied: bool = False, seed: int = 0) -> dict:
    """A tiny random Llama in llama.cpp's layout. Returns hf_name -> (HF-layout float32, type)."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    _metadata(w)
    written: dict[str, tuple[np.ndarray, Q]] = {}

    def add(name: str, hf: str, arr: np.ndarray, qtype: Q, heads: int | None = None) -> None:
        arr = arr.astype(np.float32)
        stored = llama_cpp_permute(arr, heads) if heads else arr
        if qtype in (Q.Q4_K, Q.Q6_K):  # gguf-py can only dequantize these: write raw blocks
            w.add_tensor(name, _k_quant_bytes(rng, qtype, *arr.shape), raw_dtype=qtype)
            arr = None  # the values are whatever the blocks say
        elif qtype == Q.F32:
            w.add_tensor(name, stored)
        elif qtype == Q.F16:
            w.add_tensor(name, stored.astype(np.float16))
        else:
            w.add_tensor(name, gguf_quantize(stored, qtype), raw_dtype=qtype)
        written[hf] = (arr, qtype)

    def norm(n: int) -> np.ndarray:
        return 1 + 0.1 * rng.standard_normal(n)

    def mat(rows: int, cols: int) -> np.ndarray:
        return 0.1 * rng.standard_normal((rows, cols))

    add(
        "token_embd.weight", "model.embed_tokens.weight", rng.standard_normal((VOCAB, HIDDEN)), types.get("embd", Q.F32)
    )
    for i in range(LAYERS):
        g, h, t = f"blk.{i}.", f"model.layers.{i}.", types.get(i, {})
        add(g + "attn_norm.weight", h + "input_layernorm.weight", norm(HIDDEN), Q.F32)
        add(g + "ffn_norm.weight", h + "post_attention_layernorm.weight", norm(HIDDEN), Q.F32)
        add(g + "attn_q.weight", h + "self_attn.q_proj.weight", mat(HEADS * HEAD_DIM, HIDDEN), t.get("q", Q.F32), HEADS)
        add(
            g + "attn_k.weight",
            h + "self_attn.k_proj.weight",
            mat(KV_HEADS * HEAD_DIM, HIDDEN),
            t.get("k", Q.F32),
            KV_HEADS,
        )
        add(g + "attn_v.weight", h + "self_attn.v_proj.weight", mat(KV_HEADS * HEAD_DIM, HIDDEN), t.get("v", Q.F32))
        add(g + "attn_output.weight", h + "self_attn.o_proj.weight", mat(HIDDEN, HEADS * HEAD_DIM), t.get("o", Q.F32))
        add(g + "ffn_gate.weight", h + "mlp.gate_proj.weight", mat(FFN, HIDDEN), t.get("gate", Q.F32))
        add(g + "ffn_up.weight", h + "mlp.up_proj.weight", mat(FFN, HIDDEN), t.get("up", Q.F32))
        add(g + "ffn_down.weight", h + "mlp.down_proj.weight", mat(HIDDEN, FFN), t.get("down", Q.F32))
    add("output_norm.weight", "model.norm.weight", norm(HIDDEN), Q.F32)
    if not tied:
        add("output.weight", "lm_head.weight", mat(VOCAB, HIDDEN), types.get("out", Q.F32))
    _finish(w)
    return written


def write_small_gguf(
    path: Path, tensors: dict[str, tuple[np.ndarray, Q]], arch: str = "llama", skip: tuple[str, ...] = ()
) -> None:
    """Valid Llama metadata but no tokenizer and only the tensors given (for error paths)."""
    w = gguf.GGUFWriter(str(path), arch)
    if arch == "llama":
        _metadata(w, skip=skip, tokenizer=False)
    for name, (data, qtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=None if qtype == Q.F32 else qtype)
    _finish(w)


def hf_last_logits(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            out.append(model(x, attention_mask=torch.ones_like(x)).logits[0, -1].float())
    return out


def our_last_logits(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    """All prompts in one flat batch over the paged cache."""
    got = PagedHarness(model).step({i: p for i, p in enumerate(prompts)})
    return [got[i] for i in range(len(prompts))]


def assert_logits_close(ours: list[torch.Tensor], theirs: list[torch.Tensor], atol: float = 1e-4) -> None:
    for i, (o, t) in enumerate(zip(ours, theirs)):
        assert o.shape == t.shape
        assert t.abs().max() > 0.1, "reference logits are degenerate; the comparison would prove nothing"
        diff = (o - t).abs().max().item()
        assert diff < atol, f"prompt {i}: max |ours - transformers| = {diff:.3g}"


def final_folders(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def temp_folders(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.name.startswith("."))


# ----------------------------------------------------------------------------- GGUF: fixtures


@pytest.fixture(scope="module")
def gguf_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("aiolm_cache")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, gguf_cache):
    """The mixed-type GGUF converted once: (gguf path, written arrays, ModelSource)."""
    folder = tmp_path_factory.mktemp("mixed_gguf")
    path = folder / "tiny-mixed.gguf"
    written = write_llama_gguf(path, MIXED_TYPES)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AIOLM_CACHE_DIR", str(gguf_cache))
        source = resolve_model(path)
    return path, written, source


@pytest.fixture(scope="module")
def tied_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("tied_gguf") / "tiny-tied.gguf"
    write_llama_gguf(path, {}, tied=True, seed=1)
    return path


@pytest.fixture(scope="module")
def tiny_prompts(mixed):
    tok = mixed[2].load_tokenizer()
    texts = ["the cat in the hat sat on the mat, then ran", "héllo wörld ∑ 日本"]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


# ----------------------------------------------------------------------------- GGUF: conversion


def test_mixed_gguf_really_holds_every_tensor_type(mixed):
    path, _, _ = mixed
    types = {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert BRIEF_TYPES <= types, BRIEF_TYPES - types
    assert types <= SUPPORTED_TYPES


@pytest.mark.parametrize("which", ["mixed", "embedded"])
def test_tensor_index_reads_what_the_gguf_library_reads(which, mixed):
    """gguf_index.read_tensors (the fast path for attaching blocks) gives every tensor's type,
    shape and bytes exactly as gguf.GGUFReader does: on a file of every supported type, and
    on the embedded model, whose metadata holds a full vocabulary."""
    from aiolm.model.gguf_index import read_tensors

    path = mixed[0] if which == "mixed" else embedded_model_path()
    ours = read_tensors(path)
    theirs = gguf.GGUFReader(str(path)).tensors
    assert sorted(ours) == sorted(t.name for t in theirs)
    for t in theirs:
        got = ours[t.name]
        assert got.type_name == t.tensor_type.name, t.name
        assert got.data.tobytes() == np.ascontiguousarray(t.data).tobytes(), t.name
        if t.tensor_type.name not in ("F32", "F16"):
            assert got.data.shape == np.asarray(t.data).shape, t.name


def test_gguf_config_tokenizer_and_chat_template(mixed):
    _, _, src = mixed
    cfg = src.config
    assert (cfg.architecture, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == ("llama", VOCAB, 64, 256)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 16)
    assert cfg.rope_theta == ROPE_THETA and cfg.rms_norm_eps == pytest.approx(1e-5)
    assert cfg.max_position_embeddings == 256 and not cfg.tie_word_embeddings and cfg.rope_scaling is None
    assert cfg.bos_token_id == 1 and src.eos_token_ids == (2, 0)  # and <|endoftext|>, as llama.cpp ends
    assert src.hf_config["torch_dtype"] == "float32"
    assert src.chat_template == CHAT_TEMPLATE
    assert src.name == "tiny-mixed" and src.origin.suffix == ".gguf"
    tok = src.load_tokenizer()
    text = "the cat — ünïcödé 日本語"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text and max(ids) < VOCAB
    assert tok("<|im_start|>", add_special_tokens=False)["input_ids"] == [1]  # control token stays whole
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_gguf_weights_of_every_type_dequantize_and_unpermute(mixed):
    path, written, src = mixed
    reader = gguf.GGUFReader(str(path))
    raw = {t.name: t for t in reader.tensors}
    ours = load_file(str(src.path / "model.safetensors"))
    assert set(ours) == set(written)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "lm_head.weight": "output.weight",
        "model.norm.weight": "output_norm.weight",
    }  # hf name -> gguf name
    for i in range(LAYERS):
        for g, h in [
            ("attn_norm", "input_layernorm"),
            ("ffn_norm", "post_attention_layernorm"),
            ("attn_q", "self_attn.q_proj"),
            ("attn_k", "self_attn.k_proj"),
            ("attn_v", "self_attn.v_proj"),
            ("attn_output", "self_attn.o_proj"),
            ("ffn_gate", "mlp.gate_proj"),
            ("ffn_up", "mlp.up_proj"),
            ("ffn_down", "mlp.down_proj"),
        ]:
            names[f"model.layers.{i}.{h}.weight"] = f"blk.{i}.{g}.weight"
    seen_types = set()
    for hf, (orig, qtype) in written.items():
        t = raw[names[hf]]
        assert t.tensor_type == qtype
        seen_types.add(qtype.name)
        w = ours[hf].numpy()
        assert w.dtype == np.float32
        heads = HEADS if "q_proj" in hf else KV_HEADS if "k_proj" in hf else None
        # 1. exactly gguf-py's dequantization of the stored bytes, moved back to HF row order
        stored = np.asarray(gguf_dequantize(t.data, t.tensor_type), dtype=np.float32)
        back = llama_cpp_permute(w, heads) if heads else w
        assert np.array_equal(back, stored.reshape(w.shape)), f"{hf} ({qtype.name})"
        if orig is None:
            # 2a. K-quants: transformers' own (torch) dequantizer of the same bytes agrees
            from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

            hf_vals = hf_dequantize(torch.from_numpy(np.array(t.data)).reshape(-1), int(qtype)).numpy()
            np.testing.assert_allclose(w, hf_vals.reshape(w.shape), rtol=1e-6, atol=1e-7, err_msg=hf)
            assert np.isfinite(w).all() and w.std() > 1e-3 and len(np.unique(w)) > 100
            continue
        # 2b. close to the HF-layout weights we started from (wrong row order would be far off)
        assert w.shape == orig.shape
        amax = float(np.abs(orig).max())
        if qtype == Q.F32:
            assert np.array_equal(w, orig), hf
        elif qtype == Q.F16:
            assert np.array_equal(w, orig.astype(np.float16).astype(np.float32)), hf
        elif qtype == Q.BF16:
            assert np.array_equal(w, torch.from_numpy(orig).bfloat16().float().numpy()), hf
        else:
            bound = {Q.Q8_0: amax / 127, Q.Q4_0: amax / 8, Q.Q4_1: amax / 7.5}[qtype]
            err = float(np.abs(w - orig).max())
            assert err <= bound, f"{hf} ({qtype.name}): max error {err:.3g} > {bound:.3g}"
    assert seen_types == BRIEF_TYPES


def test_gguf_logits_match_transformers_reading_the_same_file(mixed, tiny_prompts):
    from transformers import AutoModelForCausalLM

    path, _, src = mixed
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    expected = hf_last_logits(ref, tiny_prompts)
    model = build_model(src, torch.float32)
    assert_logits_close(our_last_logits(model, tiny_prompts), expected)

    # The comparison can see a Q/K layout error: leave llama.cpp's permutation in and it fails.
    def still_permuted():
        for name, t in iter_weights(src):
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                t = torch.from_numpy(llama_cpp_permute(t.numpy(), HEADS if "q_proj" in name else KV_HEADS))
            yield name, t

    wrong = _built_with(src.config, still_permuted())
    diffs = [(o - e).abs().max().item() for o, e in zip(our_last_logits(wrong, tiny_prompts), expected)]
    assert max(diffs) > 1e-2


def _built_with(config, weights):
    """A float32 CPU model of ``config`` loaded from ``weights``: what build_model makes of a
    source, with the config or the weights changed."""
    ctx = build_context(get_platform("cpu"), torch.float32)
    model = build_from_config(config, ctx)
    model.load_weights(weights)
    return finish(model, ctx)


def test_gguf_tied_embeddings(tied_gguf, tmp_path, monkeypatch, tiny_prompts):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("AIOLM_CACHE_DIR", str(tmp_path))
    src = resolve_model(tied_gguf)
    assert src.config.tie_word_embeddings
    with safe_open(str(src.path / "model.safetensors"), framework="pt") as st:
        assert "lm_head.weight" not in set(st.keys())
    model = build_model(src)
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    ref = AutoModelForCausalLM.from_pretrained(
        str(tied_gguf.parent), gguf_file=tied_gguf.name, dtype=torch.float32
    ).eval()
    assert_logits_close(our_last_logits(model, tiny_prompts), hf_last_logits(ref, tiny_prompts))


def test_unsupported_tensor_type_names_tensor_and_type(tmp_path, monkeypatch):
    monkeypatch.setenv("AIOLM_CACHE_DIR", str(tmp_path / "cache"))
    assert "IQ4_NL" not in SUPPORTED_TYPES
    block, size = gguf.GGML_QUANT_SIZES[Q.IQ4_NL]
    raw = np.random.default_rng(0).integers(0, 256, size=(HIDDEN, HIDDEN // block * size), dtype=np.uint8)
    path = tmp_path / "iq.gguf"
    write_small_gguf(
        path,
        {"token_embd.weight": (np.ones((VOCAB, HIDDEN), np.float32), Q.F32), "blk.0.attn_q.weight": (raw, Q.IQ4_NL)},
    )
    with pytest.raises(ModelLoadError) as e:
        resolve_model(path)
    msg = str(e.value)
    assert "blk.0.attn_q.weight" in msg and "IQ4_NL" in msg and "Q4_K" in msg and str(path) in msg
    # the failed conversion leaves neither a cache folder nor a temporary one behind
    assert final_folders(tmp_path / "cache") == [] and temp_folders(tmp_path / "cache") == []


def test_gguf_unknown_architecture_and_missing_metadata(tmp_path, monkeypatch):
    monkeypatch.setenv("AIOLM_CACHE_DIR", str(tmp_path / "cache"))
    one = {"token_embd.weight": (np.ones((8, 32), np.float32), Q.F32)}
    write_small_gguf(tmp_path / "g.gguf", one, arch="gpt2")
    with pytest.raises(ModelLoadError, match=r"unknown GGUF architecture 'gpt2'.*llama.*qwen3"):
        resolve_model(tmp_path / "g.gguf")
    write_small_gguf(tmp_path / "m.gguf", one, skip=("feed_forward_length",))
    with pytest.raises(ModelLoadError, match=r"llama\.feed_forward_length missing"):
        resolve_model(tmp_path / "m.gguf")
    assert final_folders(tmp_path / "cache") == [] and temp_folders(tmp_path / "cache") == []


def test_not_a_gguf_file(tmp_path, monkeypatch):
    monkeypatch.setenv("AIOLM_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"this is not GGUF at all" * 10)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file") as e:
        resolve_model(bad)
    assert str(bad) in str(e.value)
    assert final_folders(tmp_path / "cache") == [] and temp_folders(tmp_path / "cache") == []
    other = tmp_path / "model.bin"
    other.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match=r"not a \.gguf file.*config\.json"):
        resolve_model(other)


# ----------------------------------------------------------------------------- GGUF: cache


def test_first_conversion_is_said_where_nobody_set_up_logging(tied_gguf, tmp_path):
    """A script calling LLM() (or `aiolm generate`, at warnings only) sees the one-time
    conversion's progress on stderr; the second start converts nothing and says nothing.
    The conversion runs in a child process: the caller (an engine process) imports no torch."""
    code = (
        "import sys; from aiolm.checkpoint.source import resolve_model; resolve_model(sys.argv[1]); "
        "print('torch' in sys.modules)"
    )
    env = dict(os.environ, AIOLM_CACHE_DIR=str(tmp_path / "cache"))
    runs = [
        subprocess.run(
            [sys.executable, "-c", code, str(tied_gguf)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            cwd=Path(__file__).resolve().parents[2],
        )
        for _ in range(2)
    ]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr + runs[1].stderr
    assert "aiolm: converting " in runs[0].stderr and "(once)" in runs[0].stderr
    assert ": tensor 1 of " in runs[0].stderr
    assert "converting" not in runs[1].stderr
    assert [r.stdout.strip() for r in runs] == ["False", "False"]


def test_cache_is_reused_and_keyed_by_content(tied_gguf, tmp_path, monkeypatch, caplog):
    from aiolm.checkpoint import gguf_cache

    cache = tmp_path / "cache"
    monkeypatch.setenv("AIOLM_CACHE_DIR", str(cache))
    assert cache_root() == cache
    path = tmp_path / "model.gguf"
    shutil.copy(tied_gguf, path)
    # the same file converted by an earlier aiolm (an older cache format): removed once replaced
    stale = gguf_cache._folder(gguf_cache.gguf_content_hash(path), gguf_cache._CACHE_FORMAT - 1)
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    with caplog.at_level("INFO", logger="aiolm.checkpoint"):
        first = resolve_model(path)
    assert not stale.exists()
    progress = [r.getMessage() for r in caplog.records if ": tensor " in r.getMessage()]
    assert progress and progress[0].startswith("converting model.gguf: tensor 1 of ")  # the first start says how far
    assert first.path.parent == cache and first.path.name.startswith("gguf-")
    assert first.name == "model"  # the served name still comes from the file the user named
    stamps = {f.name: f.stat().st_mtime_ns for f in first.path.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "generation_config.json",
        "chat_template.jinja",
    } <= set(stamps)

    t0 = time.perf_counter()
    second = resolve_model(path)
    elapsed = time.perf_counter() - t0
    assert second.path == first.path
    assert {f.name: f.stat().st_mtime_ns for f in second.path.iterdir()} == stamps  # nothing rewritten
    assert elapsed < 1.0, f"second resolve took {elapsed:.2f}s: reconverted?"
    assert final_folders(cache) == [first.path] and temp_folders(cache) == []

    # The same bytes elsewhere, or touched: the same folder, nothing converted again.
    other = tmp_path / "elsewhere" / "renamed.gguf"
    other.parent.mkdir()
    shutil.copy(path, other)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    for again in (resolve_model(other), resolve_model(path)):
        assert again.path == first.path
    assert {f.name: f.stat().st_mtime_ns for f in first.path.iterdir()} == stamps
    assert resolve_model(other).name == "renamed"

    # Other bytes: another folder.
    with open(other, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    third = resolve_model(other)
    assert third.path != first.path and third.path.name.startswith("gguf-")
    assert (third.path / "config.json").exists() and (third.path / "model.safetensors").exists()
    assert final_folders(cache) == sorted([first.path, third.path]) and temp_folders(cache) == []


_RACER = r"""
import json, sys, time
from pathlib import Path
import gguf, torch, safetensors.torch  # heavy imports before the start line
from transformers import AutoTokenizer
import aiolm.checkpoint.gguf_convert
from aiolm.checkpoint.gguf_cache import cache_root
from aiolm.checkpoint.source import resolve_model

gguf_path, barrier = sys.argv[1:3]
Path(barrier, "child").touch()
deadline = time.time() + 600
while not Path(barrier, "parent").exists():
    if time.time() > deadline:
        sys.exit("parent never gave the start signal")
    time.sleep(0.001)
root = cache_root()
before = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) if root.exists() else []
src = resolve_model(gguf_path)
print(json.dumps({"path": str(src.path), "before": before}))
"""
RACE_TEST = "test_two_processes_converting_at_once"


@pytest.fixture(scope="module", autouse=True)
def racer(request, tied_gguf, tmp_path_factory):
    """The child process of the race test, started with the module so its imports (seconds of
    torch and transformers) overlap the other tests; it waits at a barrier until the test."""
    if not any(item.name == RACE_TEST for item in request.session.items):
        yield None
        return
    base = tmp_path_factory.mktemp("race")
    (base / "barrier").mkdir()
    (base / "racer.py").write_text(_RACER)
    env = dict(
        os.environ,
        AIOLM_CACHE_DIR=str(base / "cache"),
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    with open(base / "out.txt", "w") as out, open(base / "err.txt", "w") as err:
        child = subprocess.Popen(
            [sys.executable, str(base / "racer.py"), str(tied_gguf), str(base / "barrier")],
            env=env,
            cwd=str(ROOT),
            stdout=out,
            stderr=err,
        )
    yield child, base
    if child.poll() is None:
        child.kill()
        child.wait()


def test_two_processes_converting_at_once(racer, tied_gguf, monkeypatch):
    """This process and a child convert the same file into the same cache at the same moment."""
    child, base = racer
    cache, barrier = base / "cache", base / "barrier"
    monkeypatch.setenv("AIOLM_CACHE_DIR", str(cache))
    deadline = time.time() + 300
    while not (barrier / "child").exists():  # the child has done its imports
        assert child.poll() is None, (base / "err.txt").read_text()[-3000:]
        assert time.time() < deadline, "child never got ready"
        time.sleep(0.005)
    assert not cache.exists() or final_folders(cache) == []
    (barrier / "parent").touch()
    ours = resolve_model(tied_gguf)
    assert child.wait(timeout=300) == 0, (base / "err.txt").read_text()[-3000:]
    theirs = json.loads((base / "out.txt").read_text().strip().splitlines()[-1])
    assert theirs["before"] == []  # the child found no finished folder either: both converted
    assert Path(theirs["path"]) == ours.path
    assert final_folders(cache) == [ours.path]
    assert temp_folders(cache) == [], "a temporary conversion folder was left behind"
    again = resolve_model(tied_gguf)  # the folder is complete and loads
    assert again.path == ours.path and again.config.tie_word_embeddings
    assert (ours.path / "tokenizer.json").exists()
    build_model(again)


# ----------------------------------------------------------------------------- Hugging Face folders

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 20000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 20000.0, "factor": 4.0, "original_max_position_embeddings": 32}


def make_hf_model(vocab: int, tied: bool, rope: dict | None = None, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
        rope_parameters=rope or {"rope_type": "default", "rope_theta": 20000.0},
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # bigger than the init's 0.02 so logits are far from zero
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return model


def save_hf(model, folder: Path, shard: bool = False) -> None:
    model.save_pretrained(str(folder), max_shard_size="300KB" if shard else "1GB")


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
    """An untied tiny Llama folder without tokenizer files (for the error tests)."""
    folder = tmp_path_factory.mktemp("tiny_hf")
    save_hf(make_hf_model(VOCAB, tied=False), folder)
    return folder


HF_CASES = {
    # transformers 5 writes rope_parameters and no top-level rope_theta
    "single-tied-rope_parameters": dict(tied=True, shard=False, rope=None, legacy=False, tok=True),
    # older configs: top-level rope_theta, no rope_parameters
    "sharded-untied-legacy_rope_theta": dict(tied=False, shard=True, rope=None, legacy=True),
    "single-untied-llama3-rope_parameters": dict(tied=False, shard=False, rope=LLAMA3_ROPE, legacy=False),
    "sharded-tied-llama3-legacy_rope_scaling": dict(tied=True, shard=True, rope=LLAMA3_ROPE, legacy=True),
    "single-untied-yarn-rope_parameters": dict(tied=False, shard=False, rope=YARN_ROPE, legacy=False),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_hf_folder_logits_match_transformers(case, tmp_path, tokenizer, tokenizer_dir):
    c = HF_CASES[case]
    ref = make_hf_model(len(tokenizer), c["tied"], c["rope"])
    save_hf(ref, tmp_path, c["shard"])
    for f in tokenizer_dir.iterdir():  # the real tokenizer's files, as tokenizer.save_pretrained wrote them
        if f.name != "config.json":
            shutil.copy(f, tmp_path)
    cfg_path = tmp_path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    assert "rope_parameters" in cfg and "rope_theta" not in cfg
    if c["legacy"]:
        params = cfg.pop("rope_parameters")
        cfg["rope_theta"] = params.pop("rope_theta")
        if params.get("rope_type", "default") != "default":
            cfg["rope_scaling"] = params
        cfg_path.write_text(json.dumps(cfg))

    src = resolve_model(tmp_path)
    files = src.safetensors_files()
    if c["shard"]:
        assert (tmp_path / "model.safetensors.index.json").exists() and len(files) > 1
    else:
        assert files == [tmp_path / "model.safetensors"]
    names = {n for f in files for n in safe_open(str(f), framework="pt").keys()}
    assert ("lm_head.weight" in names) != c["tied"]
    assert src.config.tie_word_embeddings == c["tied"]
    assert src.config.rope_theta == 20000.0
    if c["rope"]:
        assert src.config.rope_scaling["rope_type"] == c["rope"]["rope_type"]
        assert src.config.rope_scaling["original_max_position_embeddings"] == 32
    else:
        assert src.config.rope_scaling is None

    texts = ["The quick brown fox jumps over the lazy dog. " * 4, "Bonjour, ça va? 日本語"]
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    if c.get("tok"):  # loading the tokenizer costs seconds: once is enough
        tok = src.load_tokenizer()
        assert [tok(t, add_special_tokens=False)["input_ids"] for t in texts] == prompts
        assert src.chat_template and src.chat_template == tok.chat_template
    assert len(prompts[0]) > 32  # past the scalings' original context, where scaling matters most
    model = build_model(src, torch.float32)
    expected = hf_last_logits(ref, prompts)
    assert_logits_close(our_last_logits(model, prompts), expected)
    if c["rope"]:  # the comparison can see the scaling: without it the logits move
        plain = _built_with(dataclasses.replace(src.config, rope_scaling=None), iter_weights(src))
        diffs = [(o - e).abs().max().item() for o, e in zip(our_last_logits(plain, prompts), expected)]
        assert max(diffs) > 1e-3


# the fields every Llama config.json needs, at toy sizes (config-only tests)
TINY_LLAMA_CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=10,
    hidden_size=8,
    intermediate_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
)


def test_hf_rope_config_spellings():
    base = TINY_LLAMA_CONFIG
    assert read_config(base).rope_theta == 10000.0
    assert read_config({**base, "rope_theta": 5e5}).rope_theta == 5e5
    new = read_config({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 7e5}})
    assert new.rope_theta == 7e5 and new.rope_scaling is None
    scaled = read_config({**base, "rope_parameters": LLAMA3_ROPE})
    assert scaled.rope_theta == 20000.0 and scaled.rope_scaling["factor"] == 8.0
    legacy = read_config({**base, "rope_theta": 3.0, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert legacy.rope_theta == 3.0 and legacy.rope_scaling == {"type": "linear", "factor": 2.0}
    assert read_config({**base, "architectures": None, "model_type": "qwen2"}).attention_bias
    # a scaling not computed would run as plain RoPE: refused by name at the config
    with pytest.raises(ModelLoadError, match="rope_scaling type 'dynamic' is not supported"):
        read_config({**base, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    with pytest.raises(ModelLoadError, match=r"rope_scaling \(llama3\) needs a positive original_max"):
        read_config({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    # YaRN's trained length is the positions where the config does not say it, as in transformers
    yarn = read_config({**base, "max_position_embeddings": 64, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    assert yarn.rope_scaling["original_max_position_embeddings"] == 64


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, tokenizer):
    """config.json + the real tokenizer's files, no weights: enough for chat templates."""
    folder = tmp_path_factory.mktemp("tok_only")
    tokenizer.save_pretrained(str(folder))
    cfg = make_hf_model(8, tied=True).config.to_dict()
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_chat_template_from_jinja_file(tokenizer_dir, tmp_path, tokenizer):
    folder = tmp_path / "m"
    shutil.copytree(tokenizer_dir, folder)
    (folder / "chat_template.jinja").write_text("JINJA {{ messages[0]['content'] }}")
    src = resolve_model(folder)
    assert src.chat_template == "JINJA {{ messages[0]['content'] }}"
    tok = src.load_tokenizer()
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "JINJA x"


def test_chat_template_from_tokenizer_config(tokenizer_dir, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tokenizer_dir, folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    tc_path = folder / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["chat_template"] = "TC {{ messages[0]['content'] }}"
    tc_path.write_text(json.dumps(tc))
    src = resolve_model(folder)
    assert src.chat_template == "TC {{ messages[0]['content'] }}"
    tok = src.load_tokenizer()
    assert tok.apply_chat_template([{"role": "user", "content": "y"}], tokenize=False) == "TC y"

    tc["chat_template"] = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}]
    tc_path.write_text(json.dumps(tc))
    assert resolve_model(folder).chat_template == "DEFAULT"

    del tc["chat_template"]
    tc_path.write_text(json.dumps(tc))
    assert resolve_model(folder).chat_template is None


def test_generation_config_eos_ids_are_merged(tiny_hf_dir, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_hf_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    src = resolve_model(folder)
    assert src.config.eos_token_ids == (2,) and src.eos_token_ids == (2, 7, 9)
    assert src.name == "m" and src.origin == folder


# ----------------------------------------------------------------------------- errors


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file or directory") as e:
        resolve_model(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(e.value)


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match=r"config\.json: missing"):
        resolve_model(tmp_path)


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "tokenizer_config.json"])
def test_broken_json_names_the_file(name, tiny_hf_dir, tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    shutil.copy(tiny_hf_dir / "config.json", folder)
    (folder / name).write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON") as e:
        resolve_model(folder)
    assert str(folder / name) in str(e.value)
    (folder / name).write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="expected a JSON object"):
        resolve_model(folder)


def test_unknown_architecture_lists_supported(tiny_hf_dir, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_hf_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as e:
        resolve_model(folder)
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg and str(folder / "config.json") in msg
    assert all(a in msg for a in MODELS)
    # a head of a known family's (a Qwen3 classifier) is not loaded as that family's causal LM: it
    # failed on its head's weight with a KeyError
    cfg.update(architectures=["LlamaForSequenceClassification"], model_type="llama")
    with pytest.raises(ModelLoadError, match="'LlamaForSequenceClassification' is not supported"):
        read_config(cfg)
    cfg.update(architectures=["LlamaModel"])  # a bare model (embedders): the family's, by its model_type
    assert read_config(cfg).architecture == "llama"
    # an encoder's masked-LM checkpoint (bert-base-uncased's) is its bare model plus a head left out
    bert = {"model_type": "bert", "vocab_size": 30, "hidden_size": 8, "num_hidden_layers": 1}
    bert |= {"num_attention_heads": 2, "intermediate_size": 16}
    assert read_config({**bert, "architectures": ["BertForMaskedLM"]}).architecture == "bert"


def test_config_missing_field(tiny_hf_dir, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_hf_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["hidden_size"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="missing field 'hidden_size'"):
        resolve_model(folder)


def test_config_without_safetensors(tiny_hf_dir, tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    shutil.copy(tiny_hf_dir / "config.json", folder)
    src = resolve_model(folder)
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weight files"):
        build_model(src)


def test_index_names_a_missing_shard(tiny_hf_dir, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_hf_dir, folder)
    save_hf(make_hf_model(VOCAB, tied=False), folder, shard=True)
    (folder / "model.safetensors").unlink(missing_ok=True)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (folder / shard).unlink()
    with pytest.raises(ModelLoadError, match="listed in model.safetensors.index.json but missing") as e:
        build_model(resolve_model(folder))
    assert shard in str(e.value)


def test_checkpoint_missing_or_unknown_weights(tiny_hf_dir, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_hf_dir, folder)
    weights = load_file(str(folder / "model.safetensors"))
    gone = weights.pop("model.layers.1.mlp.down_proj.weight")
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(KeyError, match=r"missing 1 weights.*layers\.1\.mlp\.down_proj\.weight"):
        build_model(resolve_model(folder))
    weights["model.layers.1.mlp.down_proj.weight"] = gone
    weights["model.layers.0.self_attn.bogus.weight"] = torch.zeros(2)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(KeyError, match="model.layers.0.self_attn.bogus.weight"):
        build_model(resolve_model(folder))
    del weights["model.layers.0.self_attn.bogus.weight"]
    weights["model.layers.9.mlp.down_proj.weight"] = gone.clone()  # a layer the config does not have: was skipped
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(KeyError, match=r"model.layers.9.mlp.down_proj.weight.*past the config"):
        build_model(resolve_model(folder))


def test_resolve_dtype():
    resolve_dtype = get_platform("cpu").resolve_dtype
    with pytest.raises(ModelLoadError) as e:
        resolve_dtype("float64")
    msg = str(e.value)
    assert "'float64'" in msg and all(s in msg for s in ("auto", "float32", "bfloat16", "float16"))
    assert resolve_dtype("auto") is torch.float32
    assert resolve_dtype("float32") is torch.float32
    # bfloat16 where this CPU multiplies in it; elsewhere (AVX2 only) float32, not an emulation
    assert resolve_dtype("bfloat16") is (torch.bfloat16 if bfloat16_matmuls() else torch.float32)


def _cpu_has_avx512_or_ne_convert() -> bool:
    flags = Path("/proc/cpuinfo").read_text().split()
    return {"avx512bw", "avx512vl", "avx512dq"} <= set(flags) or "avx_ne_convert" in flags


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads the CPU flags from /proc/cpuinfo")
def test_bfloat16_matmuls_follow_the_cpu_flags():
    """oneDNN packs bfloat16 weights with AVX-512 BW/VL/DQ or AVX-NE-CONVERT, and only then."""
    assert bfloat16_matmuls() == _cpu_has_avx512_or_ne_convert()


def test_bfloat16_on_a_cpu_without_bfloat16_matmuls_builds_float32_and_says_so(tiny_hf_dir, caplog):
    if bfloat16_matmuls():
        pytest.skip("this CPU has bfloat16 matmuls (the test below covers them)")
    from aiolm.platforms import cpu

    exact = build_model(resolve_model(tiny_hf_dir), torch.float32)
    cpu._say_no_bfloat16.cache_clear()  # said once per process: an earlier test may have said it
    with caplog.at_level("WARNING", logger="aiolm.platforms.cpu"):
        model = build_model(resolve_model(tiny_hf_dir), torch.bfloat16)
        build_model(resolve_model(tiny_hf_dir), torch.bfloat16)
    said = [r.getMessage() for r in caplog.records if "no bfloat16 matmuls" in r.getMessage()]
    assert len(said) == 1 and "runs in float32" in said[0]
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    assert model.layers[0].mlp.gate_up_proj.packed.data.dtype == torch.float32
    assert torch.equal(model.layers[0].mlp(x), exact.layers[0].mlp(x))


@pytest.mark.skipif(
    not bfloat16_matmuls(),
    reason="this CPU has no bfloat16 matmuls (AVX2 only: no AVX-512 "
    "BW/VL/DQ, no AVX-NE-CONVERT); the model runs in float32 there",
)
def test_build_model_in_bfloat16_on_cpu_multiplies_in_bfloat16_and_keeps_the_rest_float32(tiny_hf_dir):
    exact = build_model(resolve_model(tiny_hf_dir), torch.float32)
    model = build_model(resolve_model(tiny_hf_dir), torch.bfloat16)
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # embeddings, norms: float32
    mlp = model.layers[0].mlp
    assert mlp.gate_up_proj.packed.data.dtype == torch.bfloat16
    assert model.lm_head.packed.data.dtype == torch.float32  # logits stay float32
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    got, want = mlp(x), exact.layers[0].mlp(x)
    assert got.dtype == torch.bfloat16  # the down matmul's output, handed on to add_rms_norm_ as it is
    assert not torch.equal(got.float(), want)  # it did round to bfloat16 ...
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05 * float(want.abs().max()))  # ... only that
    # gate/up reaches the fused SiLU as bfloat16 and the down projection reads its bfloat16 output:
    # the same numbers as the float32 hand-over, which rounds the same values at the same places
    up = dataclasses.replace(mlp.gate_up_proj.packed, hand_over_bf16=False)(x)
    assert up.dtype == torch.float32
    unfused = dataclasses.replace(mlp.down_proj.packed, hand_over_bf16=False)(torch.ops.aiolm.silu_and_mul(up))
    assert torch.equal(got.float(), unfused)
    # add_rms_norm_ on that bfloat16 output: the float32 sum and norm, rounded once at the end
    res = torch.randn(5, model.config.hidden_size)
    res32 = res.clone()
    h, res = model.layers[1].input_layernorm(got.clone(), res)
    h32, res32 = exact.layers[1].input_layernorm(got.float(), res32)
    assert h.dtype == torch.bfloat16 and torch.equal(res, res32) and torch.equal(h, h32.to(torch.bfloat16))


# ----------------------------------------------------------------------------- RoPE row order


@pytest.mark.parametrize("rows,heads,rest", [(64, 4, (64,)), (32, 2, (64,)), (48, 3, ()), (8, 1, (5, 3))])
def test_unpermute_is_exact_inverse_of_llama_cpp_permute(rows, heads, rest):
    w = np.random.default_rng(rows).standard_normal((rows, *rest)).astype(np.float32)
    assert np.array_equal(unpermute_rope_rows(llama_cpp_permute(w, heads), heads), w)
    assert np.array_equal(llama_cpp_permute(unpermute_rope_rows(w, heads), heads), w)
    assert not np.array_equal(llama_cpp_permute(w, heads), w)


def test_unpermute_row_order():
    # llama.cpp stores each head's rotate-half halves as interleaved pairs (x_i, x_{i+d/2})
    assert unpermute_rope_rows(np.array([0, 4, 1, 5, 2, 6, 3, 7]), 1).tolist() == list(range(8))
    two_heads = np.array([0, 2, 1, 3, 4, 6, 5, 7])
    assert unpermute_rope_rows(two_heads, 2).tolist() == list(range(8))


# ----------------------------------------------------------------------------- the embedded model


def test_embedded_model_resolves(real_source):
    path = embedded_model_path()
    assert path.is_file() and path.suffix == ".gguf"
    src = real_source
    assert src.origin == path and src.name == path.stem
    assert (src.path / "config.json").exists() and (src.path / "model.safetensors").exists()
    cfg = src.config
    assert (cfg.architecture, cfg.vocab_size, cfg.hidden_size, cfg.num_layers) == ("llama", 49152, 576, 30)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == (9, 3, 64, 1536)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    assert 2 in src.eos_token_ids and src.chat_template and "<|im_start|>" in src.chat_template


def test_embedded_tokenizer_loads_without_torch_as_autotokenizer_does(real_source):
    """The converted folder's tokenizer.json class loads directly (no torch: the engine
    process loads it) and tokenizes and renders chats exactly as AutoTokenizer's pick."""
    from transformers import AutoTokenizer

    probe = (
        "import sys, json\nfrom aiolm.checkpoint.source import resolve_model\n"
        "tok = resolve_model(None).load_tokenizer()\n"
        "print(json.dumps([type(tok).__name__, 'torch' in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=300)
    assert json.loads(out.stdout.strip().splitlines()[-1])[1] is False
    ours, auto = real_source.load_tokenizer(), AutoTokenizer.from_pretrained(str(real_source.path))
    assert type(ours) is type(auto) and len(ours) == len(auto)
    texts = ["Hello, world!", "  spaces\tand\nnewlines ", "<|im_start|>user\nhi<|im_end|>", "日本語 ça va?"]
    for t in texts:
        assert ours(t)["input_ids"] == auto(t)["input_ids"]
        assert ours.decode(ours(t)["input_ids"]) == auto.decode(auto(t)["input_ids"])
    chat = [{"role": "user", "content": "What is 2+2?"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == auto.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )
    assert (ours.eos_token, ours.bos_token, ours.all_special_ids) == (
        auto.eos_token,
        auto.bos_token,
        auto.all_special_ids,
    )


def test_config_values_these_layers_do_not_have_are_refused():
    """A Llama-family MLP is SiLU-gated and its o_proj and MLP have no bias here: a config
    naming GELU ran as SiLU (transformers runs GELU), and the biases failed a bare assert."""
    base = TINY_LLAMA_CONFIG
    for extra, words in (
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"hidden_act": "swishy"}, "hidden_act 'swishy'"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"attention_bias": True}, "attention_bias"),
        ({"architectures": ["Qwen3ForCausalLM"], "attention_bias": True}, "attention_bias"),
        (
            {"architectures": ["MixtralForCausalLM"], "num_local_experts": 2, "hidden_act": "gelu"}
            | {"num_key_value_heads": base["num_attention_heads"]},  # (MixtralConfig's default is 8)
            "hidden_act",
        ),
    ):
        with pytest.raises(ModelLoadError, match=words):
            read_config({**base, **extra})
    for extra, words in (  # a TypeError traceback, or a ZeroDivisionError in the workers, before
        ({"rms_norm_eps": "tiny"}, "rms_norm_eps must be a positive number, got 'tiny'"),
        ({"vocab_size": None}, "vocab_size must be a positive integer, got None"),
        ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer"),
        ({"max_position_embeddings": 0}, "max_position_embeddings must be a positive integer"),
        ({"num_hidden_layers": -1}, "num_hidden_layers must be a positive integer"),
        ({"num_attention_heads": 3, "num_key_value_heads": 2}, "3 attention heads do not split into 2"),
    ):
        with pytest.raises(ModelLoadError, match=words):
            read_config({**base, **extra})
    assert read_config({**base, "hidden_act": "silu"}).architecture == "llama"
    assert read_config({**base, "architectures": ["Qwen2ForCausalLM"], "attention_bias": True}).attention_bias
    # transformers' Qwen2 has QKV biases and Mistral none, whatever the config says (a Qwen2's
    # attention_bias false failed on an assert at load)
    assert read_config({**base, "architectures": ["Qwen2ForCausalLM"], "attention_bias": False}).attention_bias
    # rope_parameters' own rope_theta wins over a top-level one, as transformers 5 reads them
    both = {**base, "rope_theta": 500.0, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    assert read_config(both).rope_theta == 10000.0
    mistral = {**base, "architectures": ["MistralForCausalLM"], "num_key_value_heads": base["num_attention_heads"]}
    assert not read_config({**mistral, "attention_bias": True}).attention_bias


@pytest.mark.parametrize(
    "tensor, shape, words",
    [
        ("model.layers.0.mlp.up_proj.weight", lambda s: (s[0], 1), "up_proj"),  # copy_ broadcast it
        ("model.norm.weight", lambda s: (1,), "model.norm.weight"),
        ("model.embed_tokens.weight", lambda s: (s[0], 1), "embed_tokens"),
        ("model.embed_tokens.weight", lambda s: (s[0] + 7, s[1]), "vocab_size"),  # rows never read
        ("model.layers.1.self_attn.o_proj.weight", lambda s: (s[0], s[1] + 4), "o_proj"),  # slice hid the width
        ("model.layers.0.self_attn.k_proj.weight", lambda s: (s[0], s[1] * 2), "k_proj"),
    ],
)
def test_a_misshapen_weight_is_named(tensor, shape, words, tiny_hf_dir, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_hf_dir, folder)
    weights = load_file(str(folder / "model.safetensors"))
    weights[tensor] = torch.zeros(shape(tuple(weights[tensor].shape)))
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="expected") as e:
        build_model(resolve_model(folder))
    assert tensor in str(e.value) and words in str(e.value)


def test_a_safetensors_file_cut_short_is_named(tiny_hf_dir, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_hf_dir, folder)
    path = folder / "model.safetensors"
    for cut in (path.read_bytes()[:100], b""):
        path.write_bytes(cut)
        with pytest.raises(ModelLoadError, match="not a readable safetensors file") as e:
            build_model(resolve_model(folder))
        assert str(path) in str(e.value)


def test_max_model_len_past_the_positions_is_refused(tiny_hf_dir, tmp_path):
    """Past its positions a model's answers are garbage, or a position table's lookup fails
    in the workers; RoPE scaling that states its factor stretches the limit, as vLLM reads it."""
    from aiolm.config import EngineArgs
    from aiolm.engine.async_engine import check_model_args, position_limit

    limit = read_config(json.loads((tiny_hf_dir / "config.json").read_text())).max_position_embeddings
    check_model_args(EngineArgs(model=str(tiny_hf_dir), max_model_len=limit))
    with pytest.raises(ValueError, match=f"--max-model-len {limit + 1} is more than the {limit} positions"):
        check_model_args(EngineArgs(model=str(tiny_hf_dir), max_model_len=limit + 1))
    base = {**TINY_LLAMA_CONFIG, "max_position_embeddings": 1000}
    assert position_limit(read_config(base)) == 1000
    assert position_limit(read_config({**base, "rope_scaling": {"type": "linear", "factor": 2.0}})) == 2000
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 500}
    assert position_limit(read_config({**base, "rope_scaling": yarn})) == 2000
    assert position_limit(read_config({**base, "rope_parameters": LLAMA3_ROPE})) == 1000


# The Hub's config.json of llava-hf/llava-1.5-7b-hf and google/gemma-3-4b-it: transformers 4
# wrote their nested configs as differences from the classes' defaults.
_LLAVA_15 = {
    "architectures": ["LlavaForConditionalGeneration"], "image_token_index": 32000, "model_type": "llava",
    "pad_token_id": 32001, "projector_hidden_act": "gelu",
    "text_config": {
        "architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096, "model_type": "llama",
        "rms_norm_eps": 1e-05, "torch_dtype": "float16", "vocab_size": 32064,
    },
    "tie_word_embeddings": False, "torch_dtype": "float16",
    "vision_config": {
        "hidden_size": 1024, "image_size": 336, "intermediate_size": 4096, "model_type": "clip_vision_model",
        "num_attention_heads": 16, "num_hidden_layers": 24, "patch_size": 14, "projection_dim": 768,
        "vocab_size": 32000,
    },
    "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064,
}  # fmt: skip
_GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "mm_tokens_per_image": 256, "model_type": "gemma3",
    "text_config": {
        "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024,
    },
    "torch_dtype": "bfloat16",
    "vision_config": {
        "hidden_size": 1152, "image_size": 896, "intermediate_size": 4304, "model_type": "siglip_vision_model",
        "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False,
    },
}  # fmt: skip


@pytest.mark.parametrize("cfg", [_LLAVA_15, _GEMMA3_4B], ids=["llava-1.5", "gemma-3-4b"])
def test_nested_configs_take_their_classes_defaults(cfg):
    """A field a nested config leaves out has its class's default, as transformers reads it
    (both failed with "missing field", and Gemma 3's KV heads and length were wrong)."""
    from transformers import CONFIG_MAPPING

    ref = CONFIG_MAPPING[cfg["model_type"]](**{k: v for k, v in cfg.items() if k != "model_type"})
    text, vision = ref.text_config, ref.vision_config
    got = read_config(cfg)
    assert (got.hidden_size, got.num_heads, got.num_kv_heads, got.head_dim) == (
        text.hidden_size, text.num_attention_heads, text.num_key_value_heads, text.head_dim
    )  # fmt: skip
    assert (got.vocab_size, got.max_position_embeddings, got.rms_norm_eps, got.num_layers) == (
        text.vocab_size, text.max_position_embeddings, text.rms_norm_eps, text.num_hidden_layers
    )  # fmt: skip
    tower = got.vision
    assert (tower.hidden_size, tower.num_layers, tower.num_heads, tower.image_size, tower.patch_size) == (
        vision.hidden_size, vision.num_hidden_layers, vision.num_attention_heads, vision.image_size, vision.patch_size
    )  # fmt: skip
    assert (tower.layer_norm_eps, tower.hidden_act) == (vision.layer_norm_eps, vision.hidden_act)


@pytest.mark.parametrize("model_type", ["mistral", "qwen3_moe", "qwen2_moe", "mixtral", "xlm-roberta"])
def test_a_config_without_a_field_takes_its_classes_default(model_type):
    """A hand-written config.json may leave out what its class defaults: RoPE base, eps,
    positions, KV heads and window are then transformers' (a Mixtral without rope_theta and
    rms_norm_eps ran with 10000 and 1e-6: logits 15 apart)."""
    from transformers import CONFIG_MAPPING

    sizes = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
    extra = {"num_attention_heads": 16, "num_experts": 4, "num_local_experts": 4, "moe_intermediate_size": 32}
    extra |= {"num_experts_per_tok": 2, "shared_expert_intermediate_size": 64}
    cfg = {"model_type": model_type, **sizes, **extra}
    ref = CONFIG_MAPPING[model_type](**{k: v for k, v in cfg.items() if k != "model_type"})
    got = read_config(cfg)
    assert got.max_position_embeddings == ref.max_position_embeddings - (2 if model_type == "xlm-roberta" else 0)
    if model_type == "xlm-roberta":
        assert got.layer_norm_eps == ref.layer_norm_eps
        return
    assert (got.num_kv_heads, got.rms_norm_eps) == (ref.num_key_value_heads, ref.rms_norm_eps)
    assert got.rope_theta == ref.rope_parameters["rope_theta"]
    assert set(got.sliding_windows) <= {ref.sliding_window or None}
