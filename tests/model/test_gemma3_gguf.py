"""Gemma 3 from a GGUF file, written as llama.cpp's converter writes one.

A tiny random Gemma 3 is built with transformers' own config class and written with
gguf.GGUFWriter under architecture ``gemma3``: llama.cpp's metadata keys (the window,
the global RoPE base, linear RoPE scaling; not the layer pattern, the local RoPE base or
the query scale, which llama.cpp hard-codes), its tensor names (gguf-py's own name map),
1 added to every norm weight, Q/K rows as they are, a SentencePiece vocabulary with a
chat template, and the block types of a real Q4_K_M file: Q4_K, Q5_0, Q6_K, Q8_0 and F32.
gguf-py cannot quantize K-quants, so those tensors are valid random blocks; the Hugging
Face folder holds what every written tensor dequantizes to (gguf-py's dequantizer), so
the file and the folder hold the same weights.

Checked: the converted folder holds the folder's weights bit for bit and a config that
aiolm and transformers read as the original one; aiolm's greedy tokens from the GGUF
(the file's blocks attached for decode steps, as on any CPU with the kernels) and from
the folder equal transformers' on the folder; a GGUF of another architecture is still
refused with the supported list.
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from safetensors.torch import load_file

from aiolm.checkpoint.source import resolve_model
from aiolm.errors import ModelLoadError
from aiolm.kernels import cpu as cpu_kernels
from aiolm.model.registry import build_model
from paged import PagedHarness, hf_greedy

Q = gguf.GGMLQuantizationType

# K-quants take rows of 256: hidden, heads * head_dim and the MLP's width are multiples of it
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 256, 4, 2, 64, 512, 7
WINDOW = 8  # keys a sliding layer sees; prompts are longer
ROPE_THETA, ROPE_FACTOR = 1e6, 2.0
NEW_TOKENS = 16

# Block types per layer, cycled: the real Gemma 3 270M Q4_K_M file's two kinds of layer,
# a larger model's Q4_K_M layer (as llama.cpp quantizes Llama's), and one whose fused
# q/k/v and gate/up each have one type that aiolm keeps as blocks.
LAYER_TYPES = [
    {"q": Q.Q5_0, "k": Q.Q5_0, "v": Q.Q8_0, "o": Q.Q4_K, "gate": Q.Q5_0, "up": Q.Q5_0, "down": Q.Q6_K},
    {"q": Q.Q5_0, "k": Q.Q5_0, "v": Q.Q5_0, "o": Q.Q4_K, "gate": Q.Q5_0, "up": Q.Q5_0, "down": Q.Q4_K},
    {"q": Q.Q4_K, "k": Q.Q4_K, "v": Q.Q6_K, "o": Q.Q4_K, "gate": Q.Q4_K, "up": Q.Q4_K, "down": Q.Q6_K},
    {"q": Q.Q8_0, "k": Q.Q8_0, "v": Q.Q8_0, "o": Q.Q6_K, "gate": Q.Q4_K, "up": Q.Q4_K, "down": Q.Q8_0},
]
EMBED_TYPE = Q.Q8_0  # as in the real file
_PROJ = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
_PIECES = [
    "▁",
    "t",
    "h",
    "e",
    "a",
    "c",
    "s",
    "o",
    "n",
    "r",
    "i",
    "d",
    "g",
    "m",
    "w",
    "l",
    "u",
    "y",
    "f",
    "p",
    "b",
    ".",
    ",",
    "?",
    "!",
    "▁t",
    "he",
    "▁the",
    "▁a",
    "▁c",
    "at",
    "▁cat",
    "in",
    "▁s",
    "on",
    "er",
    "re",
    "an",
    "▁o",
    "▁w",
    "nd",
    "▁an",
    "▁and",
    "ow",
    "▁m",
    "at",
    "▁is",
    "is",
    "▁on",
    "▁mat",
    "ma",
]


def sentencepiece_vocab() -> tuple[list[str], list[float], list[int]]:
    """Gemma's layout in small: control tokens (<end_of_turn> among them), byte fallbacks,
    then pieces; as llama.cpp's _set_vocab_sentencepiece writes them (tokens, scores, types)."""
    control = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    pieces = list(dict.fromkeys(_PIECES))
    tokens = control + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [3] * 3 + [2] + [3] * 2 + [6] * 256 + [1] * len(pieces)  # CONTROL, UNKNOWN, BYTE, NORMAL
    scores = [0.0] * (len(control) + 256) + [-float(i) for i in range(len(pieces))]
    return tokens, scores, types


VOCAB = len(sentencepiece_vocab()[0])
EOT_ID = sentencepiece_vocab()[0].index("<end_of_turn>")


def _hf_model():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        query_pre_attn_scalar=HEAD_DIM,  # as in every Gemma 3 but the 27B
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        sliding_window=WINDOW,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(LAYERS)],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": ROPE_FACTOR, "rope_theta": ROPE_THETA},
        },
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(cfg).float().eval()
    # Norms random too (Gemma's multiply by 1 + w). Small embeddings: the input, scaled by
    # sqrt(hidden), would otherwise outweigh every layer's branch and the greedy answer
    # would repeat the last token whatever attention does.
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((0.5 if "norm" in name else 0.05 if "embed" in name else 0.15) * torch.randn_like(p))
    return model


def _k_quant_blocks(rng: np.random.Generator, qtype: Q, rows: int, cols: int) -> np.ndarray:
    """Valid K-quant blocks with random codes and sub-block scales, super-block scales chosen
    so that the weights they stand for are centred and of the size of the others."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    f16 = lambda x: np.frombuffer(np.float16(x).tobytes(), np.uint8)  # noqa: E731
    if qtype == Q.Q4_K:  # d, dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles: d * sc * q - dmin * m
        raw[:, 0:2], raw[:, 2:4] = f16(1e-3), f16(7.5e-3)
    elif qtype == Q.Q6_K:  # 128 + 64 bytes of 6-bit codes, 16 int8 scales, d: d * sc * (q - 32)
        raw[:, 208:210] = f16(1.5e-4)
    else:
        raise AssertionError(qtype)
    return raw.reshape(rows, cols // block * size)


def write_gemma3_gguf(path, hf, *, tokenizer: bool = True) -> dict[str, torch.Tensor]:
    """``hf`` written as llama.cpp's Gemma3Model converter and llama-quantize would;
    returns the Hugging Face state the file holds (what each tensor dequantizes to)."""
    rng = np.random.default_rng(0)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, LAYERS)  # llama.cpp's own mapping
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_name("tiny gemma 3")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_freq_base(ROPE_THETA)
    w.add_sliding_window(WINDOW)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(ROPE_FACTOR)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if tokenizer:
        tokens, scores, types = sentencepiece_vocab()
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_unk_token_id(3)
        w.add_pad_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)
        w.add_add_space_prefix(False)
        w.add_chat_template(CHAT_TEMPLATE)

    types = {"model.embed_tokens.weight": EMBED_TYPE}
    for i in range(LAYERS):
        layer = LAYER_TYPES[i % len(LAYER_TYPES)]
        types.update({f"model.layers.{i}.{_PROJ[k]}.weight": t for k, t in layer.items()})
    held: dict[str, torch.Tensor] = {}
    for hf_name, p in hf.state_dict().items():
        if hf_name == "lm_head.weight":
            continue  # tied: llama.cpp writes no output tensor
        arr = p.detach().numpy().astype(np.float32)
        name = names.get_name(hf_name.removesuffix(".weight")) + ".weight"
        qtype = types.get(hf_name, Q.F32)
        if hf_name.endswith("norm.weight"):
            w.add_tensor(name, arr + np.float32(1))  # convert_hf_to_gguf.py: data_torch + 1
            value = (arr + np.float32(1)) - np.float32(1)
        elif qtype in (Q.Q4_K, Q.Q6_K):
            raw = _k_quant_blocks(rng, qtype, *arr.shape)
            w.add_tensor(name, raw, raw_dtype=qtype)
            value = gguf_dequantize(raw, qtype)
        else:
            raw = gguf_quantize(arr, qtype)
            w.add_tensor(name, raw, raw_dtype=qtype)
            value = gguf_dequantize(raw, qtype)
        held[hf_name] = torch.from_numpy(np.asarray(value, np.float32).reshape(arr.shape).copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(the GGUF, its converted ModelSource, the Hugging Face folder of the same weights,
    transformers' model on it)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("gemma3_gguf")
    hf = _hf_model()
    path = root / "tiny-gemma3-Q4_K_M.gguf"
    held = write_gemma3_gguf(path, hf)
    hf.load_state_dict(held, strict=False)  # the tied lm_head follows the embedding
    folder = root / "hf"
    hf.save_pretrained(str(folder))
    AutoTokenizer.from_pretrained(str(root), gguf_file=path.name).save_pretrained(str(folder))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AIOLM_CACHE_DIR", str(root / "cache"))
        source = resolve_model(path)
    return path, source, folder, hf


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    return [rng.integers(0, VOCAB, n).tolist() for n in (23, 30, 5)]  # two past the window, one inside


def test_the_file_is_what_llama_cpp_writes(written):
    path, _, _, _ = written
    r = gguf.GGUFReader(str(path))
    assert r.fields["general.architecture"].contents() == "gemma3"
    kinds = {t.tensor_type.name for t in r.tensors}
    assert kinds == {"Q4_K", "Q5_0", "Q6_K", "Q8_0", "F32"}
    norms = [t for t in r.tensors if t.name.endswith("norm.weight")]
    assert len(norms) == 6 * LAYERS + 1 and all(t.tensor_type == Q.F32 for t in norms)
    assert "output.weight" not in {t.name for t in r.tensors}


def test_converted_folder_holds_the_same_weights_and_config(written):
    from transformers import AutoConfig

    _, src, folder, _ = written
    ours, theirs = load_file(str(src.path / "model.safetensors")), load_file(str(folder / "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for name in theirs:  # norms less the 1 again, no Q/K permutation, nothing re-rounded
        assert torch.equal(ours[name], theirs[name]), name
    # aiolm reads the reconstructed config as the original one (whose RoPE entry also has its theta)...
    original = resolve_model(folder).config
    assert dataclasses.replace(src.config, rope_scaling=None) == dataclasses.replace(original, rope_scaling=None)
    assert src.config.rope_scaling == {k: original.rope_scaling[k] for k in ("rope_type", "factor")}
    assert src.config.sliding_windows == tuple(None if i == 5 else WINDOW for i in range(LAYERS))
    assert src.config.query_pre_attn_scalar == HEAD_DIM and src.config.rope_local_theta == 10000.0
    # ...and so does transformers
    a, b = AutoConfig.from_pretrained(str(src.path)), AutoConfig.from_pretrained(str(folder))
    for key in (
        "layer_types",
        "sliding_window",
        "query_pre_attn_scalar",
        "head_dim",
        "rms_norm_eps",
        "final_logit_softcapping",
        "attn_logit_softcapping",
        "hidden_activation",
        "num_key_value_heads",
        "vocab_size",
        "tie_word_embeddings",
    ):
        assert getattr(a, key) == getattr(b, key), key
    for kind in ("full_attention", "sliding_attention"):
        assert {k: v for k, v in a.rope_parameters[kind].items()} == {
            k: v for k, v in b.rope_parameters[kind].items()
        }, kind


def test_tokenizer_chat_template_and_turn_end(written):
    _, src, _, _ = written
    tok = src.load_tokenizer()
    ids = tok("the cat is on the mat")["input_ids"]
    assert ids[0] == 2 and tok.decode(ids, skip_special_tokens=True) == "the cat is on the mat"
    assert "▁cat" in tok.convert_ids_to_tokens(ids)
    assert tok.decode(tok("naïve ✓", add_special_tokens=False)["input_ids"]) == "naïve ✓"  # byte fallback
    assert src.chat_template == CHAT_TEMPLATE
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    # a chat answer ends at <end_of_turn>, as in a Gemma checkpoint's generation_config and llama.cpp
    assert src.eos_token_ids == (1, EOT_ID)


def test_greedy_from_the_gguf_and_the_folder_match_transformers(written, prompts, monkeypatch):
    from aiolm.quant import gguf_blocks
    from aiolm.quant.gguf_blocks import TYPE_IDS, GGUFLinear, GGUFParts, GGUFWeight

    monkeypatch.setattr(gguf_blocks, "KEEP_Q5_0", False)  # as without int8 on VNNI

    path, src, folder, hf = written
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert all(set(e) != {p[-1]} for p, e in zip(prompts, expected))  # not just the last token again
    from_folder = build_model(resolve_model(folder), torch.float32)
    assert PagedHarness(from_folder).greedy(prompts, NEW_TOKENS) == expected
    from_gguf = build_model(src, torch.float32)
    if cpu_kernels.load():  # decode steps read the file's own blocks where aiolm keeps that type
        layers = from_gguf.layers
        assert isinstance(layers[3].self_attn.qkv_proj.gguf.blocks, GGUFWeight)  # Q8_0 q, k, v
        assert isinstance(layers[2].self_attn.qkv_proj.gguf.blocks, GGUFParts)  # Q4_K q, k beside a Q6_K v
        q5_0 = layers[0].self_attn.qkv_proj.gguf.blocks  # Q5_0 q, k widened to join the Q8_0 v (KEEP_Q5_0)
        assert isinstance(q5_0, GGUFWeight) and q5_0.qtype == TYPE_IDS["Q8_0"]
        assert all(isinstance(layer.mlp.down_proj.gguf, GGUFLinear) for layer in layers)
        assert isinstance(from_gguf.lm_head.gguf, GGUFLinear)  # the tied Q8_0 embedding
        assert all(getattr(layer, "fused", None) is None for layer in layers)  # the Llama-only fused step
    assert PagedHarness(from_gguf).greedy(prompts, NEW_TOKENS) == expected
    assert PagedHarness(from_gguf, block_size=4).greedy(prompts, NEW_TOKENS, split=3) == expected


def _metadata_only(path, arch: str = "gemma3", **keys) -> None:
    """A GGUF with llama.cpp's Gemma 3 metadata for a given shape, and no tensors."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in keys.items():
        if value is not None:
            getattr(w, f"add_{key}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


_27B = dict(
    context_length=131072,
    embedding_length=5376,
    block_count=62,
    feed_forward_length=21504,
    head_count=32,
    head_count_kv=16,
    key_length=128,
    value_length=128,
    layer_norm_rms_eps=1e-6,
    rope_freq_base=1e6,
    sliding_window=1024,
    rope_scaling_type=gguf.RopeScalingType.LINEAR,
    rope_scaling_factor=8.0,
    vocab_size=262208,
)


def test_config_of_the_27b_shape_and_of_a_file_without_a_window(tmp_path):
    """What llama.cpp hard-codes, as google/gemma-3-27b's config says it: queries scaled by
    hidden / heads = 168, not head_dim; linear RoPE scaling on the global layers only."""
    from aiolm.checkpoint.families import read_config
    from aiolm.checkpoint.gguf_convert import read_hf_config

    _metadata_only(tmp_path / "27b.gguf", **_27B)
    cfg = read_hf_config(gguf.GGUFReader(str(tmp_path / "27b.gguf")), tmp_path / "27b.gguf")
    assert cfg["query_pre_attn_scalar"] == 168 and cfg["sliding_window"] == 1024
    assert cfg["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    ours = read_config(cfg)
    assert [i for i, w in enumerate(ours.sliding_windows) if w is None] == list(range(5, 62, 6))
    assert (ours.rope_theta, ours.rope_local_theta, ours.rms_norm_eps) == (1e6, 10000.0, 1e-6)
    # a file with no window (llama.cpp's converter writes none for sliding_window_pattern 1):
    # every layer global, as llama.cpp then runs it
    _metadata_only(tmp_path / "nowin.gguf", **{**_27B, "sliding_window": None, "block_count": 4})
    cfg = read_hf_config(gguf.GGUFReader(str(tmp_path / "nowin.gguf")), tmp_path / "nowin.gguf")
    assert cfg["layer_types"] == ["full_attention"] * 4 and cfg["query_pre_attn_scalar"] == 128
    assert read_config(cfg).sliding_windows in ((), (None,) * 4)
    _metadata_only(tmp_path / "yarn.gguf", **{**_27B, "rope_scaling_type": gguf.RopeScalingType.YARN})
    with pytest.raises(ModelLoadError, match=r"gemma3\.rope\.scaling\.type 'yarn' is not supported"):
        read_hf_config(gguf.GGUFReader(str(tmp_path / "yarn.gguf")), tmp_path / "yarn.gguf")


def test_unknown_architecture_is_refused_with_the_supported_list(tmp_path, monkeypatch):
    monkeypatch.setenv("AIOLM_CACHE_DIR", str(tmp_path / "cache"))
    _metadata_only(tmp_path / "g2.gguf", arch="gemma2", **{**_27B, "block_count": 4})
    with pytest.raises(ModelLoadError) as e:
        resolve_model(tmp_path / "g2.gguf")
    assert str(tmp_path / "g2.gguf") in str(e.value)
    assert "unknown GGUF architecture 'gemma2'; supported: gemma3, llama, mistral, qwen2, qwen3" in str(e.value)
    assert not [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]  # nothing left behind
