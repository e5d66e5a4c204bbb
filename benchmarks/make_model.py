"""Write a random-weight Llama of TinyLlama-1.1B's shape in every format the benchmarks run.

    python benchmarks/make_model.py [OUT] [--scale full|tiny] [--formats f32,bf16,q8_0,q4_0]

OUT (default ~/.cache/aiolm-bench/llama-1.1b-random, or .../llama-tiny-random with
--scale tiny) receives:

    hf-float32/    config.json, model.safetensors (float32), tokenizer files
    hf-bfloat16/   the same weights rounded to bfloat16
    model-Q8_0.gguf, model-Q4_0.gguf   the same weights quantized (norms stay F32)
    make_model.json   what was written; written last, so its presence means complete

The shape is TinyLlama's (hidden 2048, intermediate 5632, 22 layers, 32 heads, 4 KV
heads, untied LM head, RoPE theta 10000, RMS eps 1e-5, 2048 positions) except the
vocabulary: 49152 tokens, so that the embedded SmolLM2 tokenizer (its tokenizer.json
and chat template, and its GGUF tokenizer metadata) serves prompts and chats unchanged.
That makes 1.17B parameters instead of 1.10B, but a decode step reads the same
~1.07B of them (the LM head and the layers; the embedding is only indexed).
``--scale tiny`` keeps every structural choice (GQA, untied head, head_dim 64, the
vocabulary) at a size that is written in seconds, for tests.

Weights are normal(0, 0.02) and norms 1, so activations stay finite through every
layer; each tensor comes from its own seeded generator, so every format holds the
same values. Tensors are generated, written and quantized one at a time, straight
into all outputs, so memory stays at a few of the largest tensor (the 400 MB head).
"""

from __future__ import annotations

import argparse
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
GGUF_TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0"}
ALL_FORMATS = ("f32", "bf16", "q8_0", "q4_0")


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
}


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


def hf_config(s: Shape, dtype: str) -> dict[str, Any]:
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


class SafetensorsStream:
    """A safetensors file written one tensor at a time: the header (names, shapes and
    offsets) is known from the specs up front, so no tensor has to wait in memory."""

    def __init__(self, path: Path, specs: list[tuple[str, tuple[int, ...]]], dtype: str) -> None:
        self.dtype = dtype  # "F32" or "BF16"
        size = 4 if dtype == "F32" else 2
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape in specs:
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


class GGUFStream:
    """A Llama GGUF written one tensor at a time with gguf.GGUFWriter: metadata and
    tensor infos first, then each tensor's data as it is made."""

    def __init__(self, path: Path, s: Shape, qtype: str, specs: list[tuple[str, tuple[int, ...]]]) -> None:
        import gguf

        from aiolm.checkpoint.gguf_convert import gguf_name

        self.gguf = gguf
        self.qtype = gguf.GGMLQuantizationType[qtype]
        self.s = s
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_name(f"random llama {path.stem}")
        w.add_context_length(s.max_positions)
        w.add_embedding_length(s.hidden)
        w.add_block_count(s.layers)
        w.add_feed_forward_length(s.intermediate)
        w.add_head_count(s.heads)
        w.add_head_count_kv(s.kv_heads)
        w.add_rope_dimension_count(s.head_dim)
        w.add_rope_freq_base(s.rope_theta)
        w.add_layer_norm_rms_eps(s.rms_eps)
        w.add_vocab_size(s.vocab)
        w.add_file_type(getattr(gguf.LlamaFileType, f"MOSTLY_{qtype}"))
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        copy_gguf_tokenizer(w)
        for name, shape in specs:
            info = self._stored_shape(shape)
            nbytes = int(np.prod(info[0]))
            w.add_tensor_info(
                gguf_name(name),
                info[0],
                info[1],
                nbytes * (4 if info[1] == np.float32 else 1),
                raw_dtype=None if info[1] == np.float32 else self.qtype,
            )
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        self.w = w

    def _stored_shape(self, shape: tuple[int, ...]) -> tuple[tuple[int, ...], Any]:
        if len(shape) == 1:
            return shape, np.float32
        return self.gguf.quants.quant_shape_to_byte_shape(shape, self.qtype), np.uint8

    def write(self, name: str, arr: np.ndarray) -> None:
        from aiolm.checkpoint.gguf_convert import permute_rope_rows

        if arr.ndim == 1:
            self.w.write_tensor_data(arr.astype(np.float32))
            return
        if name.endswith(("q_proj.weight", "k_proj.weight")):  # llama.cpp's RoPE row order
            arr = permute_rope_rows(arr, self.s.heads if "q_proj" in name else self.s.kv_heads)
        rows = 4096  # quantize in slices: the numpy quantizer's temporaries are several times the input
        out = np.concatenate(
            [
                self.gguf.quants.quantize(np.ascontiguousarray(arr[i : i + rows]), self.qtype)
                for i in range(0, arr.shape[0], rows)
            ]
        )
        self.w.write_tensor_data(out)

    def close(self) -> None:
        self.w.close()


def copy_gguf_tokenizer(w: Any) -> None:
    """The embedded GGUF's tokenizer metadata (BPE tokens, types, merges, special ids,
    chat template), so llama.cpp and aiolm's GGUF path tokenize as SmolLM2 does."""
    import gguf

    from aiolm.checkpoint.source import embedded_model_path

    src = gguf.GGUFReader(str(embedded_model_path()))

    def f(key: str) -> Any:
        field = src.fields.get(key)
        return None if field is None else field.contents()

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


def write_hf_folder_files(folder: Path, s: Shape, dtype: str) -> None:
    """Everything but the weights: config, generation config, the embedded tokenizer."""
    from aiolm.checkpoint.source import resolve_model

    folder.mkdir(parents=True, exist_ok=True)
    src = resolve_model(None).path  # the embedded GGUF's converted folder (tokenizer.json, template)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / name).exists():
            shutil.copy(src / name, folder / name)
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}, indent=2))
    (folder / "config.json").write_text(json.dumps(hf_config(s, dtype), indent=2))


def make_model(out: Path, scale: str = "full", formats: tuple[str, ...] = ALL_FORMATS, seed: int = 0) -> dict:
    """Write the model into ``out`` in ``formats``; returns the manifest (also written)."""
    s = SCALES[scale]
    specs = tensor_specs(s)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)
    files: dict[str, str] = {}
    st: list[SafetensorsStream] = []
    for fmt, dt, torch_dt in (("f32", "F32", "float32"), ("bf16", "BF16", "bfloat16")):
        if fmt in formats:
            folder = out / f"hf-{torch_dt}"
            write_hf_folder_files(folder, s, torch_dt)
            st.append(SafetensorsStream(folder / "model.safetensors", specs, dt))
            files[fmt] = folder.name
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
            w.write(arr)
        for g in gg:
            g.write(name, arr)
        if i % 20 == 0:
            print(f"  {i + 1}/{len(specs)} tensors, {time.perf_counter() - t0:.0f} s", flush=True)
    for w in [*st, *gg]:
        w.close()
    params = sum(int(np.prod(shape)) for _, shape in specs)
    manifest = {
        "scale": scale,
        "shape": asdict(s),
        "parameters": params,
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
    p.add_argument("--formats", default=",".join(ALL_FORMATS), help=f"any of {','.join(ALL_FORMATS)}")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    formats = tuple(f for f in a.formats.split(",") if f)
    bad = [f for f in formats if f not in ALL_FORMATS]
    if bad:
        p.error(f"--formats: unknown {bad}; choose from {','.join(ALL_FORMATS)}")
    name = "llama-1.1b-random" if a.scale == "full" else f"llama-{a.scale}-random"
    out = (a.out or Path("~/.cache/aiolm-bench") / name).expanduser().resolve()
    t = time.perf_counter()
    m = make_model(out, a.scale, formats, a.seed)
    print(
        f"{out}: {m['parameters'] / 1e9:.3f}B parameters, {', '.join(m['files'].values())} "
        f"in {time.perf_counter() - t:.0f} s"
    )


if __name__ == "__main__":
    main()
