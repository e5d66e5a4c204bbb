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
- Mixture of experts (Qwen2-MoE, Qwen3-MoE, and Mixtral, which is a ``llama`` file with
  ``llama.expert_count``): it stacks a layer's experts into one 3-D tensor per projection
  (``ffn_{gate,up,down}_exps``, numpy shape [experts, rows, cols]); we split them back into
  the per-expert names Hugging Face checkpoints use. A layer with a dense ``ffn_gate``
  instead of experts becomes one of Qwen's ``mlp_only_layers``. The router's top-k weights
  are renormalised as llama.cpp runs each architecture (Qwen3-MoE and Mixtral yes, Qwen2-MoE
  no), which the config says as ``norm_topk_prob``.

Tensors are written to model.safetensors one at a time (the header is known from the
tensor table), so a conversion holds one dequantized tensor, not the model, in memory.
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
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}
_MIXTRAL = ("MixtralForCausalLM", "mixtral")  # a "llama" file with experts
_MOE_ARCHS = ("qwen2moe", "qwen3moe")  # architectures that are always mixtures of experts
# llama.cpp's build_moe_ffn renormalises the top-k router weights for these (norm_w);
# Mixtral always does, and its config has no field for it
_NORM_TOPK = {"qwen2moe": False, "qwen3moe": True}
_PERMUTED_QK = ("llama", "mistral")  # architectures whose Q/K rows llama.cpp permuted


def gguf_architecture(architecture: str) -> str:
    """The GGUF ``general.architecture`` of a file of ModelConfig.architecture ``architecture``
    (Mixtral's files are ``llama`` ones with experts)."""
    return {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "mixtral": "llama"}.get(architecture, architecture)


def permuted_qk(architecture: str) -> bool:
    """Whether a GGUF file of ModelConfig.architecture ``architecture`` holds its Q and K rows
    in llama.cpp's RoPE order (undone by ``unpermute_rope_rows``)."""
    return gguf_architecture(architecture) in _PERMUTED_QK


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
# A sparse layer's router and shared expert. Its experts (ffn_*_exps) are one GGUF tensor
# for many Hugging Face ones: hf_expert_names, not hf_name, names them.
_QWEN_MOE_NAMES = {"ffn_gate_inp.weight": "mlp.gate.weight"}
_QWEN2_MOE_NAMES = {
    **_QWEN_MOE_NAMES,
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
_LAYER_NAMES_OF = {  # architectures not named here: _LAYER_NAMES
    "gemma3": _GEMMA3_LAYER_NAMES,
    "llama": {**_LAYER_NAMES, "ffn_gate_inp.weight": "block_sparse_moe.gate.weight"},  # Mixtral's router
    "qwen2moe": {**_LAYER_NAMES, **_QWEN2_MOE_NAMES},
    "qwen3moe": {**_LAYER_NAMES, **_QWEN_MOE_NAMES},
}
# expert projections: GGUF kind -> the Hugging Face module and projection names of each expert
_EXPERT_KINDS = ("gate", "up", "down")
_QWEN_EXPERTS = ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"})
_MIXTRAL_EXPERTS = ("block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"})
_EXPERTS_OF = {"llama": _MIXTRAL_EXPERTS, "qwen2moe": _QWEN_EXPERTS, "qwen3moe": _QWEN_EXPERTS}
_EXPS = re.compile(r"^ffn_(gate|up|down)_exps\.weight$")
# Mixtral files from before llama.cpp stacked experts hold one tensor per expert
_ONE_EXPERT = re.compile(r"^ffn_(gate|up|down)\.(\d+)\.weight$")
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
    m = _BLK.match(gguf_name)
    if m is None:
        return None
    i, part = m.groups()
    layer = _LAYER_NAMES_OF.get(arch, _LAYER_NAMES)
    if part in layer:
        return f"model.layers.{i}.{layer[part]}"
    one = _ONE_EXPERT.match(part)
    if one and arch in _EXPERTS_OF:
        module, proj = _EXPERTS_OF[arch]
        return f"model.layers.{i}.{module}.experts.{one.group(2)}.{proj[one.group(1)]}.weight"
    return None  # stacked experts (ffn_*_exps) among them: see hf_expert_names


def hf_expert_names(gguf_name: str, arch: str, num_experts: int) -> list[str] | None:
    """The Hugging Face names of the experts a stacked GGUF expert tensor holds, in its order
    (``blk.N.ffn_gate_exps.weight`` is [experts, rows, cols]: expert e's gate projection is
    slice e); None for any other tensor."""
    m = _BLK.match(gguf_name)
    exps = _EXPS.match(m.group(2)) if m else None
    if m is None or exps is None or arch not in _EXPERTS_OF:
        return None
    module, proj = _EXPERTS_OF[arch]
    return [f"model.layers.{m.group(1)}.{module}.experts.{e}.{proj[exps.group(1)]}.weight" for e in range(num_experts)]


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
        # the dense architectures, then the mixtures of experts
        known = sorted(set(_ARCHS) - set(_MOE_ARCHS)) + sorted(_MOE_ARCHS)
        raise ModelLoadError(f"{path}: unknown GGUF architecture {arch!r}; supported: {', '.join(known)}")
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
    else:
        freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
        factors = None if freqs is None else np.asarray(freqs.data, dtype=np.float64).reshape(-1)
        cfg["rope_scaling"] = _rope_scaling(lambda key: _field(reader, f"{arch}.{key}"), factors, cfg, path)
    if arch in _MOE_ARCHS or int(_field(reader, f"{arch}.expert_count", 0) or 0) > 0:
        shapes = {t.name: _shape(t) for t in reader.tensors}
        cfg.update(_moe_config(lambda key: _field(reader, f"{arch}.{key}"), arch, cfg, shapes, path))
    return cfg


def _shape(t: Any) -> tuple[int, ...]:
    """A GGUF tensor's shape as numpy and Hugging Face order it (the file lists it innermost first)."""
    return tuple(reversed([int(d) for d in t.shape]))


def _moe_config(
    field: Any, arch: str, cfg: dict[str, Any], shapes: dict[str, tuple[int, ...]], path: Path
) -> dict[str, Any]:
    """What a mixture-of-experts config.json has beyond the common fields, spelled as the
    original checkpoints spell it (Qwen: ``num_experts``, Mixtral: ``num_local_experts``)."""
    experts = int(field("expert_count") or 0)
    used = int(field("expert_used_count") or 0)
    if experts <= 0 or not 0 < used <= experts:
        raise ModelLoadError(
            f"{path}: {arch}.expert_count {experts} and {arch}.expert_used_count {used}: "
            "a mixture of experts needs 0 < used <= count"
        )
    layers = cfg["num_hidden_layers"]
    eps = _decimal(cfg["rms_norm_eps"])  # the checkpoint's 1e-06, not its float32 neighbour
    # llama.cpp's files of these architectures have experts in every layer; a layer that has
    # a dense feed-forward instead (and no router) is one of Qwen's mlp_only_layers
    dense = [
        i
        for i in range(layers)
        if f"blk.{i}.ffn_gate_inp.weight" not in shapes and f"blk.{i}.ffn_gate.weight" in shapes
    ]
    if arch == "llama":  # Mixtral: the expert width is the feed-forward length; no dense layers
        if dense:
            raise ModelLoadError(
                f"{path}: layer {dense[0]} has a dense feed-forward; Mixtral has experts in every layer"
            )
        width = int(field("expert_feed_forward_length") or cfg["intermediate_size"])
        return {
            "architectures": [_MIXTRAL[0]],
            "model_type": _MIXTRAL[1],
            "intermediate_size": width,
            "num_local_experts": experts,
            "num_experts_per_tok": used,
            "sliding_window": None,
            "rms_norm_eps": eps,
        }
    out: dict[str, Any] = {
        "num_experts": experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": int(field("expert_feed_forward_length") or cfg["intermediate_size"]),
        "norm_topk_prob": _NORM_TOPK[arch],
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
        "rms_norm_eps": eps,
    }
    if arch == "qwen2moe":
        shared = field("expert_shared_feed_forward_length")
        if shared is None:  # older files: the shared expert's own width
            sparse = next((i for i in range(layers) if i not in dense), 0)
            shared = shapes.get(f"blk.{sparse}.ffn_up_shexp.weight", (0,))[0]
        out["shared_expert_intermediate_size"] = int(shared)
        out["qkv_bias"] = cfg["attention_bias"]
        out["use_sliding_window"] = False
    return out


def _check_moe_tensors(cfg: dict[str, Any], arch: str, shapes: dict[str, tuple[int, ...]], path: Path) -> None:
    """Every sparse layer has its router and all its experts, of the config's shapes (a file
    cut short or from another converter otherwise loads as a model with missing experts)."""
    hidden = cfg["hidden_size"]
    experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)))
    width = int(cfg.get("moe_intermediate_size", cfg["intermediate_size"]))
    dense = set(cfg.get("mlp_only_layers", ()))

    def need(name: str, *expected: tuple[int, ...], what: str) -> None:
        if name not in shapes:
            raise ModelLoadError(f"{path}: tensor {name} ({what}) missing")
        if shapes[name] not in expected:
            want = " or ".join(str(list(e)) for e in expected)
            raise ModelLoadError(f"{path}: tensor {name} ({what}) has shape {list(shapes[name])}; expected {want}")

    for i in range(cfg["num_hidden_layers"]):
        b = f"blk.{i}."
        if i in dense:
            ffn = cfg["intermediate_size"]
            for kind, shape in (("gate", (ffn, hidden)), ("up", (ffn, hidden)), ("down", (hidden, ffn))):
                need(f"{b}ffn_{kind}.weight", shape, what=f"layer {i}'s dense {kind} projection")
            continue
        need(f"{b}ffn_gate_inp.weight", (experts, hidden), what=f"layer {i}'s router")
        one_each = arch == "llama" and f"{b}ffn_gate.0.weight" in shapes  # the unstacked Mixtral layout
        for kind in _EXPERT_KINDS:
            rows, cols = (hidden, width) if kind == "down" else (width, hidden)
            if one_each:
                for e in range(experts):
                    need(f"{b}ffn_{kind}.{e}.weight", (rows, cols), what=f"layer {i}'s expert {e} {kind} projection")
            else:
                need(f"{b}ffn_{kind}_exps.weight", (experts, rows, cols), what=f"layer {i}'s stacked {kind} experts")
        if arch == "qwen2moe":
            sh = cfg["shared_expert_intermediate_size"]
            for kind, shape in (("gate", (sh, hidden)), ("up", (sh, hidden)), ("down", (hidden, sh))):
                need(f"{b}ffn_{kind}_shexp.weight", shape, what=f"layer {i}'s shared expert {kind} projection")
            # [1, hidden] as the converter writes it; [hidden] in some quantized files
            need(f"{b}ffn_gate_inp_shexp.weight", (1, hidden), (hidden,), what=f"layer {i}'s shared expert gate")


# llama.cpp's Gemma 3 constants (src/llama-model.cpp, LLM_ARCH_GEMMA3): with a sliding
# window, layer i is global when (i + 1) % 6 == 0; the sliding layers' RoPE base
GEMMA3_GLOBAL_EVERY = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0


def _decimal(x: float) -> float:
    """A float32 metadata value as the shortest decimal that is that float32 (1e-06, not
    9.999999974752427e-07): the value the original config.json wrote."""
    return float(str(np.float32(x)))


def _rope_scaling(field: Any, factors: np.ndarray | None, cfg: dict[str, Any], path: Path) -> dict[str, Any] | None:
    """config.json's ``rope_scaling`` from a file's ``rope.scaling.*`` fields, or from the
    per-frequency divisors of its ``rope_freqs`` tensor (how llama.cpp's converter stores
    Llama 3.1's scaling: no field names it). A scaling read as none would answer wrong past
    the first positions, so what cannot be stated is refused."""
    kind = field("rope.scaling.type")
    factor = field("rope.scaling.factor")
    if factor is None:
        factor = field("rope.scale_linear")  # the key older files used
    if kind is None and factor is not None and factor != 1:
        kind = "linear"  # as llama.cpp reads a factor without a type
    if factors is not None:
        if kind not in (None, "none"):
            raise ModelLoadError(f"{path}: both rope_freqs.weight and rope.scaling.type {kind!r}; expected one")
        return _llama3_scaling(factors, cfg, path)
    if kind in (None, "none"):
        return None
    if not isinstance(factor, (int, float)) or not factor > 0:
        raise ModelLoadError(f"{path}: rope.scaling.type {kind!r} needs a positive rope.scaling.factor, got {factor!r}")
    if kind == "linear":
        return {"rope_type": "linear", "factor": _decimal(factor)}
    if kind == "yarn":
        # llama.cpp's knobs beyond YaRN's own: their defaults are what it computes anyway
        for key, default in (("rope.scaling.attn_factor", 1.0), ("rope.scaling.yarn_log_multiplier", 0.1)):
            value = field(key)
            if value is not None and abs(value - default) > 1e-6:
                raise ModelLoadError(f"{path}: {key} {value!r} is not supported (only {default})")
        scaling = {"rope_type": "yarn", "factor": _decimal(factor)}
        original = field("rope.scaling.original_context_length")
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        for key, name in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
            if field(key) is not None:
                scaling[name] = _decimal(field(key))
        return scaling
    raise ModelLoadError(f"{path}: rope.scaling.type {kind!r} is not supported; supported: linear, yarn, none")


# (low_freq_factor, high_freq_factor) pairs and trained lengths tried against a file's
# rope_freqs, Llama 3.1-3.3's (1, 4) and 8192 first. Scaling all three alike gives the same
# divisors, so low_freq_factor 1 stands for every equivalent triple.
_LLAMA3_RAMPS = [(1.0, hi) for hi in (4.0, 2.0, 8.0, 16.0)]
_LLAMA3_LENGTHS = [8192] + [2**n for n in range(10, 21) if n != 13]


def _llama3_scaling(factors: np.ndarray, cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """The ``llama3`` rope_scaling whose divisors equal ``factors`` (float32-close), found by
    trying the parameters such files are made with."""
    dim = cfg["head_dim"]
    if factors.shape != (dim // 2,):
        raise ModelLoadError(f"{path}: rope_freqs.weight has {factors.size} values; head_dim {dim} needs {dim // 2}")
    factor = float(factors.max())
    if not factor >= 1 or not float(factors.min()) > 0:
        raise ModelLoadError(f"{path}: rope_freqs.weight holds divisors outside [1, ...): {factors.min()}-{factor}")
    inv = 1.0 / cfg["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * np.pi / inv
    for low, high in _LLAMA3_RAMPS:
        for length in _LLAMA3_LENGTHS:
            smooth = np.clip((length / wavelen - low) / (high - low), 0.0, 1.0)
            expect = 1.0 / ((1 - smooth) / factor + smooth)
            if np.allclose(expect, factors, rtol=1e-5, atol=0):
                return {
                    "rope_type": "llama3",
                    "factor": _decimal(factor),
                    "low_freq_factor": low,
                    "high_freq_factor": high,
                    "original_max_position_embeddings": length,
                }
    raise ModelLoadError(
        f"{path}: rope_freqs.weight is not a Llama 3 frequency scaling aiolm can state "
        "(no factor, ramp and trained length give its divisors)"
    )


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

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from e
    cfg = read_hf_config(reader, path)
    arch = _field(reader, "general.architecture")
    experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)))
    if experts:
        _check_moe_tensors(cfg, arch, {t.name: _shape(t) for t in reader.tensors}, path)
    # what each GGUF tensor becomes: one Hugging Face tensor, or one per expert (slices of dim 0)
    plan: list[tuple[Any, list[str], tuple[int, ...]]] = []
    for t in reader.tensors:
        shape = _shape(t)
        names = hf_expert_names(t.name, arch, experts) if experts else None
        if names is not None:
            plan.append((t, names, shape[1:]))
            continue
        name = hf_name(t.name, arch)
        if name is None:
            continue  # e.g. rope_freqs: recomputed from the config's rope_scaling
        if name.endswith("shared_expert_gate.weight"):
            shape = (1, shape[-1])  # a [hidden] one in some files; Hugging Face's is a 1-row linear
        plan.append((t, [name], shape))
    for t, _, _ in plan:  # refused before anything is written
        _check_type(t, path)
    with _SafetensorsWriter(out_dir / "model.safetensors", [(n, s) for _, names, s in plan for n in names]) as out:
        for i, (t, names, shape) in enumerate(plan):
            if i % max(1, len(plan) // 10) == 0:
                progress("converting %s: tensor %d of %d", path.name, i + 1, len(plan))
            arr = _dequantize(gguf, t, path).reshape(len(names), *shape)
            for name, part in zip(names, arr):
                out.write(_undo_llama_cpp(name, part, arch, cfg))
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if cfg.get(k) is not None}
    ends = generation_ends(gen.get("eos_token_id"), _turn_end_ids(reader, arch))
    if ends is not None:
        gen["eos_token_id"] = ends
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
    _save_tokenizer(path, out_dir, reader)
    # config.json last: the loader treats its presence as "the folder is complete".
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))


def _dequantize(gguf: Any, t: Any, path: Path) -> np.ndarray:
    """A GGUF tensor's values, float32 in numpy (Hugging Face) order."""
    try:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise ModelLoadError(f"{path}: tensor {t.name}: cannot dequantize {t.tensor_type.name} ({e})") from e
    return np.asarray(arr, dtype=np.float32).reshape(_shape(t))


def _check_type(t: Any, path: Path) -> None:
    ttype = t.tensor_type.name
    if ttype not in SUPPORTED_TYPES:
        raise ModelLoadError(
            f"{path}: tensor {t.name} has unsupported GGUF type {ttype}; "
            f"supported: {', '.join(sorted(SUPPORTED_TYPES))}"
        )


def _undo_llama_cpp(name: str, arr: np.ndarray, arch: str, cfg: dict[str, Any]) -> np.ndarray:
    """What llama.cpp's converter changed in the tensor Hugging Face calls ``name``, undone."""
    if arch in _PERMUTED_QK and name.endswith(("q_proj.weight", "k_proj.weight")):
        arr = unpermute_rope_rows(arr, cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"])
    shift = _NORM_SHIFT.get(arch, 0.0)
    if shift and name.endswith("norm.weight"):
        arr = arr - np.float32(shift)
    return arr


class _SafetensorsWriter:
    """A float32 safetensors file written one tensor at a time: the header (names, shapes and
    offsets) is known from the tensor table up front, so no tensor waits in memory for the rest.
    The format: an 8-byte little-endian header length, the JSON header, then the data."""

    def __init__(self, path: Path, specs: list[tuple[str, tuple[int, ...]]]) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape in specs:
            n = int(np.prod(shape, dtype=np.int64)) * 4
            header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self.specs, self.done = specs, 0
        self.f = open(path, "wb")
        self.f.write(len(raw).to_bytes(8, "little") + raw)

    def write(self, arr: np.ndarray) -> None:
        name, shape = self.specs[self.done]
        assert arr.shape == shape, (name, arr.shape, shape)  # the header promised this shape here
        self.f.write(np.ascontiguousarray(arr, dtype="<f4").tobytes())
        self.done += 1

    def __enter__(self) -> _SafetensorsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.close()


def generation_ends(eos: int | None, turn_ends: list[int]) -> int | list[int] | None:
    """generation_config.json's ``eos_token_id``: the EOS alone, or a list where turn ends add
    to it (or stand without it)."""
    ends = [x for x in dict.fromkeys([eos, *turn_ends]) if x is not None]
    return ends if ends and ends != [eos] else eos


# The texts llama.cpp ends generation at beside a file's EOS (llama-vocab.cpp's end-of-generation
# tokens), where a file names no eot/eom token or names only some of them.
_END_TEXTS = frozenset(
    b.encode()
    for b in ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|end_of_text|>", "<EOT>", "_<EOT>", "<｜end▁of▁sentence｜>", "<|return|>", "<|call|>")
)  # fmt: skip


def _turn_end_ids(reader: Any, arch: str) -> list[int]:
    """The ids besides ``eos`` that end generation, as llama.cpp ends it: the file's end-of-turn
    and end-of-message tokens, and the tokens llama.cpp knows by their text (Llama 3's
    ``<|eot_id|>`` and ``<|eom_id|>``, Gemma's ``<end_of_turn>``, ``<|endoftext|>``), which a
    checkpoint's generation_config.json lists beside its eos but a file seldom names."""
    ids = [int(v) for v in (_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")) if v is not None]
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        for i, part in enumerate(tokens.data):  # the field's contents() would decode every token
            if bytes(tokens.parts[part]) in _END_TEXTS and i not in ids:
                ids.append(i)
    return ids


# tokenizer.ggml.pre values whose split transformers' GGUF tokenizer builds as llama.cpp splits:
# its own map (GGUF_PRE_TOKENIZER_SPLITS), and those llama.cpp splits with GPT-2's regex, which
# transformers applies to the rest (gpt-2, phi-2; smollm splits digits one by one, which changes
# nothing with SmolLM's vocabulary, whose digits are single tokens). Another one would be split
# with GPT-2's regex where llama.cpp splits otherwise (deepseek-coder keeps "\n\n\n" apart).
# "default" (or none) is an old file's, which llama.cpp too splits with a generic regex.
_SPLITS_AS_LLAMA_CPP = frozenset(
    "default gpt-2 phi-2 smollm llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano dbrx "
    "smaug-bpe tekken qwen2 deepseek-r1-qwen kormo f2llmv2 megrez qwen35 gpt-4o llama4 kanana2 talkie "
    "minimax-m2".split()
)
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types


def _save_tokenizer(path: Path, out_dir: Path, reader: Any) -> None:
    from transformers import AutoTokenizer

    model, pre = _field(reader, "tokenizer.ggml.model"), _field(reader, "tokenizer.ggml.pre")
    if model == "gpt2" and pre is not None and pre not in _SPLITS_AS_LLAMA_CPP:
        raise ModelLoadError(
            f"{path}: tokenizer.ggml.pre {pre!r} is not supported: its text would be split otherwise than "
            f"llama.cpp splits it; supported: {', '.join(sorted(_SPLITS_AS_LLAMA_CPP))}"
        )
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot build a tokenizer from GGUF metadata ({e})") from e
    if model == "gpt2":
        tok = _special_tokens_at_their_ids(tok, reader, path)
    tok.save_pretrained(str(out_dir))
    _as_llama_cpp_splits(out_dir / "tokenizer.json", model, pre, _field(reader, "tokenizer.ggml.add_space_prefix"))
    if getattr(tok, "chat_template", None):
        (out_dir / "chat_template.jinja").write_text(tok.chat_template)


def _special_tokens_at_their_ids(tok: Any, reader: Any, path: Path) -> Any:
    """``tok`` with the file's control and user-defined tokens whole, at their own ids.

    transformers respells a byte-level file's tokens into the byte alphabet, and then takes a
    control token outside that alphabet (DeepSeek's ``<｜begin▁of▁sentence｜>``) for a
    mislabel: its BOS and EOS came back as new ids past the vocabulary (every request failed),
    and ``<｜User｜>`` was cut into bytes. Here each such token is the vocabulary's entry at
    its id, matched whole in text as llama.cpp matches it, special where it is a control token.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokens, types = _field(reader, "tokenizer.ggml.tokens") or [], _field(reader, "tokenizer.ggml.token_type") or []
    marked = {i: t for i, (t, kind) in enumerate(zip(tokens, types)) if kind in (_CONTROL, _USER_DEFINED)}
    if len(tok) <= len(tokens) and all(tok.convert_tokens_to_ids(t) == i for i, t in marked.items()):
        return tok  # as the file has them
    spec = json.loads(tok.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    spelled = {i: text for text, i in vocab.items()}
    for i, text in marked.items():
        if spelled.get(i, text) != text:
            del vocab[spelled[i]]
        vocab[text] = i
    added = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False}
        | {"special": types[i] == _CONTROL}
        for i, t in marked.items()
    ]
    spec["added_tokens"] = added  # what transformers added past the vocabulary is gone with them
    ids = {t: i for i, t in marked.items()}
    for part in _parts(spec.get("post_processor"), "processors"):
        for text, entry in (part.get("special_tokens") or {}).items():
            if text in ids:
                entry["ids"] = [ids[text]]
    try:
        backend = Tokenizer.from_str(json.dumps(spec))
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot place the file's special tokens at their ids ({e})") from e

    def named(key: str) -> str | None:
        i = _field(reader, f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    fixed = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=named("bos"),
        eos_token=named("eos"),
        unk_token=named("unknown"),
        pad_token=named("padding"),
        chat_template=getattr(tok, "chat_template", None),
        clean_up_tokenization_spaces=False,
    )
    if len(fixed) > len(tokens):
        raise ModelLoadError(f"{path}: its tokenizer has {len(fixed)} tokens, more than the file's {len(tokens)}")
    return fixed


# llama.cpp's LLAMA3 pre-tokenizers: a word that is a vocabulary entry is a token whole, whatever
# the merges say (Llama 3's own tokenizer.json sets ignore_merges too)
_WHOLE_WORDS = frozenset("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2".split())


def _as_llama_cpp_splits(tokenizer_json: Path, model: Any, pre: Any, add_space_prefix: Any) -> None:
    """The saved tokenizer.json told what transformers' GGUF builder leaves out: whole words
    for Llama 3's pre-tokenizers, and no space put before the text of a SentencePiece file
    whose add_space_prefix is false (Yi's: "hello" is "he", "llo", not "▁hello")."""
    if not tokenizer_json.exists():
        return
    spec = json.loads(tokenizer_json.read_text())
    if model == "gpt2" and pre in _WHOLE_WORDS and spec.get("model", {}).get("type") == "BPE":
        spec["model"]["ignore_merges"] = True
    elif model == "llama" and add_space_prefix is False:
        for part in _parts(spec.get("pre_tokenizer"), "pretokenizers"):
            if part.get("type") == "Metaspace":
                part["prepend_scheme"] = "never"
        decoder = spec.get("decoder")
        if isinstance(decoder, dict) and decoder.get("type") == "Sequence":
            decoder["decoders"] = [d for d in decoder["decoders"] if d.get("type") != "Strip"]
        normalizer = spec.get("normalizer")
        if isinstance(normalizer, dict) and normalizer.get("type") == "Sequence":
            normalizer["normalizers"] = [n for n in normalizer["normalizers"] if n.get("type") != "Prepend"]
    else:
        return
    tokenizer_json.write_text(json.dumps(spec, ensure_ascii=False))


def _parts(node: Any, key: str) -> list[dict[str, Any]]:
    """A tokenizer.json component and the ones a Sequence of it holds under ``key``."""
    if not isinstance(node, dict):
        return []
    return [node, *(p for inner in node.get(key) or [] for p in _parts(inner, key))]


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
