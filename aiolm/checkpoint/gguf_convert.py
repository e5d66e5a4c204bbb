"""Convert a GGUF file into a Hugging Face-shaped folder of float32 weights.

Dequantization uses the `gguf` package and the weights are written with safetensors'
numpy API, without torch, so whichever process meets the file first (the engine, a
worker) can convert it. The values stored are exactly the dequantized ones (the worker
casts to the requested dtype later). What llama.cpp's converter
(convert_hf_to_gguf.py) changed on the way in is undone here, per architecture:

- Llama and Mistral: it permutes the Q and K rows for its RoPE layout; we unpermute
  them so the weights are the Hugging Face ones and RoPE (rotate-half) is right.
- Gemma 3: it adds 1 to every ``*norm.weight`` (Gemma's RMSNorm multiplies by 1 + w);
  we subtract it. Its Q/K rows are not permuted. The file leaves out what llama.cpp
  hard-codes for the architecture (src/llama-model.cpp): every 6th layer global and
  the others sliding-window, a RoPE base of 10000 for the sliding layers, and queries
  scaled by head_dim ** -0.5 (hidden / heads for the 62-layer 27B); the config written
  here says them as Gemma3TextConfig spells them. A tensor name can mean another
  Hugging Face one here: Gemma's ``ffn_norm`` is the pre-feedforward norm, Llama's the
  post-attention one.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

from aiolm.errors import ModelLoadError

log = logging.getLogger(__name__)
PROGRESS_PREFIX = "aiolm: "  # what a progress line starts with where nobody set up logging
REFUSAL_PREFIX = "aiolm-refused: "  # main()'s last stderr line when the file is refused: JSON, the message


def progress(msg: str, *args: Any) -> None:
    """Say how a first use's conversion goes, whoever set up logging (or nobody did).

    It runs once per model file and takes a while, so a user of ``LLM()`` or of
    ``aiolm generate`` (logging at warnings only) should still see that something is
    happening and why; where INFO reaches a handler it is a normal log line.
    """
    if log.isEnabledFor(logging.INFO) and log.hasHandlers():
        log.info(msg, *args)
    else:
        print(PROGRESS_PREFIX + msg % args, file=sys.stderr, flush=True)


# GGUF architecture name -> (HF architectures entry, model_type)
_ARCHS = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}
_PERMUTED_QK = ("llama", "mistral")  # architectures whose Q/K rows llama.cpp permuted
_NORM_SHIFT = {"gemma3": 1.0}  # what llama.cpp added to every *norm.weight

SUPPORTED_TYPES = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 3's four norms a layer (gguf-py's tensor_mapping.py: ATTN_POST_NORM, FFN_PRE_NORM,
# FFN_POST_NORM); the rest as in Llama
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_LAYER_NAMES_OF = {"gemma3": _GEMMA3_LAYER_NAMES}  # architectures not named here: _LAYER_NAMES
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a tensor of a GGUF file of architecture ``arch``."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    layer = _LAYER_NAMES_OF.get(arch, _LAYER_NAMES)
    m = _BLK.match(gguf_name)
    if m and m.group(2) in layer:
        return f"model.layers.{m.group(1)}.{layer[m.group(2)]}"
    return None


def gguf_name(hf: str, arch: str = "llama") -> str | None:
    """The GGUF tensor name of a Hugging Face one (the inverse of ``hf_name``), for writers."""
    top = {v: k for k, v in _TOP_NAMES.items()}
    if hf in top:
        return top[hf]
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", hf)
    layer = {v: k for k, v in _LAYER_NAMES_OF.get(arch, _LAYER_NAMES).items()}
    if m and m.group(2) in layer:
        return f"blk.{m.group(1)}.{layer[m.group(2)]}"
    return None


def permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K permutation (rotate-half halves -> interleaved pairs), as its
    converter applies it when writing a Llama GGUF; ``unpermute_rope_rows`` undoes it."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K permutation (interleaved pairs -> rotate-half halves)."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_hf_config(reader: Any, path: Path) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise ModelLoadError(f"{path}: unknown GGUF architecture {arch!r}; supported: {', '.join(sorted(_ARCHS))}")
    hf_arch, model_type = _ARCHS[arch]

    def need(key: str) -> Any:
        v = _field(reader, f"{arch}.{key}")
        if v is None:
            raise ModelLoadError(f"{path}: GGUF metadata field {arch}.{key} missing")
        return v

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    names = {t.name for t in reader.tensors}
    tokens = _field(reader, "tokenizer.ggml.tokens")
    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "vocab_size": int(_field(reader, f"{arch}.vocab_size", len(tokens) if tokens else 0)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if arch == "gemma3":
        cfg.update(_gemma3_config(lambda key: _field(reader, f"gemma3.{key}"), cfg, path))
    return cfg


# llama.cpp's Gemma 3 constants (src/llama-model.cpp, LLM_ARCH_GEMMA3): with a sliding
# window, layer i is global when (i + 1) % 6 == 0; the sliding layers' RoPE base
GEMMA3_GLOBAL_EVERY = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0


def _decimal(x: float) -> float:
    """A float32 metadata value as the shortest decimal that is that float32 (1e-06, not
    9.999999974752427e-07): the value the original config.json wrote."""
    return float(str(np.float32(x)))


def _gemma3_config(field: Any, cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """What a Gemma 3 config.json has beyond the Llama fields, as llama.cpp reads the file.

    Spelled as the original checkpoints' configs are (``rope_theta``, ``rope_local_base_freq``,
    ``rope_scaling``), which transformers 4.5x and 5 both read, with ``layer_types`` explicit."""
    n = cfg["num_hidden_layers"]
    window = int(field("attention.sliding_window") or 0)
    # no window: every layer global (llama.cpp then sets no sliding-window type at all)
    types = ["sliding_attention" if window and (i + 1) % GEMMA3_GLOBAL_EVERY else "full_attention" for i in range(n)]
    kind = field("rope.scaling.type")
    if kind in (None, "none"):
        scaling = None
    elif kind == "linear":  # the 4B-27B models: their global layers' RoPE only
        scaling = {"rope_type": "linear", "factor": _decimal(field("rope.scaling.factor"))}
    else:
        raise ModelLoadError(f"{path}: gemma3.rope.scaling.type {kind!r} is not supported; supported: linear, none")
    # queries scaled by head_dim ** -0.5, but by (hidden / heads) ** -0.5 in the 27B (62 layers)
    scalar = cfg["hidden_size"] // cfg["num_attention_heads"] if n == 62 else cfg["head_dim"]
    cap = field("final_logit_softcapping")
    return {
        "rms_norm_eps": _decimal(cfg["rms_norm_eps"]),
        "rope_theta": _decimal(cfg["rope_theta"]),
        "layer_types": types,
        "sliding_window": window or None,
        "rope_local_base_freq": GEMMA3_LOCAL_ROPE_THETA,
        "rope_scaling": scaling,
        "query_pre_attn_scalar": scalar,
        "final_logit_softcapping": _decimal(cap) if cap else None,
        "attn_logit_softcapping": None,
        "hidden_activation": "gelu_pytorch_tanh",
    }


def convert_gguf(path: Path, out_dir: Path) -> None:
    """Write config.json, generation_config.json, model.safetensors and tokenizer files."""
    import gguf
    from safetensors.numpy import save_file

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from e
    cfg = read_hf_config(reader, path)
    arch = _field(reader, "general.architecture")
    permute = arch in _PERMUTED_QK
    shift = _NORM_SHIFT.get(arch, 0.0)
    tensors: dict[str, np.ndarray] = {}
    total = len(reader.tensors)
    for i, t in enumerate(reader.tensors):
        if i % max(1, total // 10) == 0:
            progress("converting %s: tensor %d of %d", path.name, i + 1, total)
        name = hf_name(t.name, arch)
        if name is None:
            continue  # e.g. rope_freqs: recomputed from the config
        ttype = t.tensor_type.name
        if ttype not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"{path}: tensor {t.name} has unsupported GGUF type {ttype}; "
                f"supported: {', '.join(sorted(SUPPORTED_TYPES))}"
            )
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ModelLoadError(f"{path}: tensor {t.name}: cannot dequantize {ttype} ({e})") from e
        arr = np.asarray(arr, dtype=np.float32).reshape(tuple(reversed([int(d) for d in t.shape])))
        if permute and name.endswith(("q_proj.weight", "k_proj.weight")):
            n = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
            arr = unpermute_rope_rows(arr, n)
        if shift and name.endswith("norm.weight"):
            arr = arr - np.float32(shift)
        tensors[name] = np.ascontiguousarray(arr, dtype=np.float32)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors

    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if cfg.get(k) is not None}
    turn_end = _turn_end_id(reader) if arch == "gemma3" else None
    if turn_end is not None and turn_end != gen.get("eos_token_id"):
        gen["eos_token_id"] = [x for x in (gen.get("eos_token_id"), turn_end) if x is not None]
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
    _save_tokenizer(path, out_dir)
    # config.json last: the loader treats its presence as "the folder is complete".
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))


def _turn_end_id(reader: Any) -> int | None:
    """The id of ``<end_of_turn>``, where a chat turn ends: a Gemma checkpoint's
    generation_config.json lists it beside ``<eos>``, and llama.cpp ends generation on it
    (it finds it by its text), but the GGUF names only ``<eos>``."""
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    if eot is not None:
        return int(eot)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        return None
    for i, part in enumerate(tokens.data):  # the field's contents() would decode all 262144 tokens
        if bytes(tokens.parts[part]) == b"<end_of_turn>":
            return i
    return None


def _save_tokenizer(path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot build a tokenizer from GGUF metadata ({e})") from e
    tok.save_pretrained(str(out_dir))
    if getattr(tok, "chat_template", None):
        (out_dir / "chat_template.jinja").write_text(tok.chat_template)


def main(argv: list[str] | None = None) -> int:
    """``python -m aiolm.checkpoint.gguf_convert GGUF OUT_DIR``: progress on stderr; a refusal
    as a last stderr line, REFUSAL_PREFIX and the message in JSON, exit code 2 (gguf_cache.py
    reads them)."""
    gguf_path, out_dir = argv if argv is not None else sys.argv[1:]
    try:
        convert_gguf(Path(gguf_path), Path(out_dir))
    except ModelLoadError as e:
        print(REFUSAL_PREFIX + json.dumps(str(e)), file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
