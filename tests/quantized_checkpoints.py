"""Test helper: a small quantizer that writes a Hugging Face model's linear layers in the
layouts quantized checkpoints use (GPTQ, AWQ GEMM, compressed-tensors pack-quantized and
float-quantized, fp8 with block scales), and the float32 model of the values it wrote.

Each layout is written as its documented producer writes it (AutoGPTQ's packing, AutoAWQ's
GEMM order, compressed-tensors' pack_to_int32), from integer codes computed here; the
reference weights are s * (q - z) from those codes before any packing, so a reader that
unpacks in the wrong order, or ignores g_idx, gets other weights than the reference.
"""

from __future__ import annotations

import json
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i of a word holds column AWQ_ORDER[i]


@dataclass
class Codes:
    q: torch.Tensor  # int64 [N, K], 0-15
    scale: torch.Tensor  # float32 [N, G], values of the stored dtype
    zero: torch.Tensor  # int64 [N, G], 0-15
    g_idx: torch.Tensor  # int64 [K]

    def dense(self) -> torch.Tensor:
        return self.scale[:, self.g_idx] * (self.q - self.zero[:, self.g_idx]).float()


def quantize4(
    w: torch.Tensor,
    group_size: int,
    sym: bool,
    scale_dtype: torch.dtype,
    act_order: bool = False,
    seed: int = 0,
) -> Codes:
    """4-bit codes of w [N, K] per output row and group of ``group_size`` inputs (-1: all);
    ``act_order``: the groups are taken over a random order of the inputs, as GPTQ's
    desc_act takes them by the activations' size."""
    n, k = w.shape
    gs = k if group_size == -1 else group_size
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if act_order else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // gs
    groups = k // gs
    q = torch.empty(n, k, dtype=torch.int64)
    scale = torch.empty(n, groups)
    zero = torch.empty(n, groups, dtype=torch.int64)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        wg = w[:, cols]
        if sym:
            s = (wg.abs().amax(1) / 7).clamp_min(1e-6)
            z = torch.full((n,), 8, dtype=torch.int64)
        else:
            lo, hi = wg.amin(1).clamp_max(0), wg.amax(1).clamp_min(0)
            s = ((hi - lo) / 15).clamp_min(1e-6).to(scale_dtype).float()
            z = torch.round(-lo / s).long().clamp(0, 15)
        s = s.to(scale_dtype).float()
        q[:, cols] = (torch.round(wg / s[:, None]).long() + z[:, None]).clamp(0, 15)
        scale[:, g], zero[:, g] = s, z
    return Codes(q, scale, zero, g_idx)


def pack_rows(v: torch.Tensor) -> torch.Tensor:
    """int codes [R, C] (0-15) -> int32 [R / 8, C]: row 8r + i in nibble i of word r."""
    v = v.to(torch.int64).reshape(-1, 8, v.shape[1])
    word = sum(v[:, i] << (4 * i) for i in range(8))
    return torch.from_numpy(word.numpy().astype(np.uint32).view(np.int32))


def pack_cols(v: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int codes [R, C] -> int32 [R, C / 8]: column 8c + order[i] in nibble i of word c."""
    v = v.to(torch.int64).reshape(v.shape[0], -1, 8)
    word = sum(v[:, :, order[i]] << (4 * i) for i in range(8))
    return torch.from_numpy(word.numpy().astype(np.uint32).view(np.int32))


def gptq_tensors(c: Codes, v2: bool = False) -> dict[str, torch.Tensor]:
    """AutoGPTQ's layout: qweight [K/8, N], qzeros [G, N/8] (zero - 1 unless v2), scales [G, N]
    float16, g_idx [K] int32."""
    return {
        "qweight": pack_rows(c.q.t()),
        "qzeros": pack_cols((c.zero - (0 if v2 else 1)).t() & 15),
        "scales": c.scale.t().to(torch.float16).contiguous(),
        "g_idx": c.g_idx.to(torch.int32),
    }


def awq_tensors(c: Codes) -> dict[str, torch.Tensor]:
    """AutoAWQ's GEMM layout: qweight [K, N/8] and qzeros [G, N/8] in its column order,
    scales [G, N] float16."""
    return {
        "qweight": pack_cols(c.q.t(), AWQ_ORDER),
        "qzeros": pack_cols(c.zero.t(), AWQ_ORDER),
        "scales": c.scale.t().to(torch.float16).contiguous(),
    }


def ct4_tensors(c: Codes, sym: bool, act_order: bool, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """compressed-tensors' pack-quantized layout: weight_packed [N, K/8] (signed codes + 8),
    weight_scale [N, G], weight_zero_point packed along the outputs [N/8, G] when asymmetric,
    weight_shape, and weight_g_idx with activation order."""
    t = {
        "weight_packed": pack_cols(c.q),
        "weight_scale": c.scale.to(scale_dtype),
        "weight_shape": torch.tensor(list(c.q.shape)),
    }
    if not sym:
        t["weight_zero_point"] = pack_rows(c.zero)
    if act_order:
        t["weight_g_idx"] = c.g_idx.to(torch.int32)
    return t


def fp8_weight(w: torch.Tensor, block: tuple[int, int] | None, per_channel: bool = False):
    """(fp8 e4m3 weight, its scale tensor, the float32 values they hold): per 128 x 128-style
    block (``block``: the scale is weight_scale_inv), per output channel or per tensor."""
    n, k = w.shape
    if block is not None:
        bn, bk = block
        s = torch.empty(-(-n // bn), -(-k // bk))
        for i in range(s.shape[0]):
            for j in range(s.shape[1]):
                s[i, j] = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].abs().max() / 448
        full = s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    elif per_channel:
        s = (w.abs().amax(1, keepdim=True) / 448).clamp_min(1e-8)
        full = s
    else:
        s = (w.abs().max() / 448).reshape(1)
        full = s
    q = (w / full).to(torch.float8_e4m3fn)
    return q, s.float(), q.float() * full


FORMATS = ("gptq", "gptq_v2", "awq", "ct4", "fp8", "ct_fp8")


def quantization_config(fmt: str, group_size: int, sym: bool, act_order: bool) -> dict:
    if fmt in ("gptq", "gptq_v2"):
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group_size,
            "desc_act": act_order,
            "sym": sym,
            "checkpoint_format": fmt,
        }
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    if fmt == "ct4":
        weights = {
            "num_bits": 4,
            "type": "int",
            "symmetric": sym,
            "strategy": "group" if group_size != -1 else "channel",
            "group_size": group_size if group_size != -1 else None,
            "actorder": "group" if act_order else None,
            "dynamic": False,
            "observer": "minmax",
        }
        return {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
            "ignore": ["lm_head"],
            "quantization_status": "compressed",
        }
    if fmt == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
    if fmt == "ct_fp8":
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
        return {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
            "ignore": ["lm_head"],
            "quantization_status": "compressed",
        }
    raise ValueError(fmt)


def write_quantized(
    base: Path,
    out: Path,
    reference: Path,
    fmt: str,
    group_size: int = 32,
    sym: bool = True,
    act_order: bool = False,
) -> dict[str, Codes]:
    """The float32 Hugging Face model at ``base`` written to ``out`` with its decoder layers'
    linears in ``fmt`` (the LM head and embeddings stay dense), and to ``reference`` with those
    linears replaced by the values ``out`` holds. Returns the 4-bit codes by layer name."""
    from safetensors.torch import load_file, save_file

    state = {}
    for f in sorted(base.glob("*.safetensors")):
        state.update(load_file(f))
    quantized, ref, codes = {}, {}, {}
    scale_dtype = torch.bfloat16 if fmt == "ct4" else torch.float16
    for name, w in sorted(state.items()):
        layer = name.removesuffix(".weight")
        if not (name.endswith(".weight") and layer.rpartition(".")[2] in LINEARS):
            quantized[name] = ref[name] = w
            continue
        if fmt in ("fp8", "ct_fp8"):
            q, s, values = fp8_weight(w, (32, 32) if fmt == "fp8" else None, per_channel=fmt == "ct_fp8")
            quantized[name] = q
            quantized[f"{layer}.weight_scale_inv" if fmt == "fp8" else f"{layer}.weight_scale"] = s
            ref[name] = values
            continue
        # layers that read one input (q, k, v; gate, up) get one activation order, as GPTQ
        # gives them (it orders by the statistics of the input they share)
        shared = layer.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
        c = quantize4(w, group_size, sym, scale_dtype, act_order, seed=zlib.crc32(shared.encode()))
        codes[layer] = c
        ref[name] = c.dense()
        if fmt in ("gptq", "gptq_v2"):
            parts = gptq_tensors(c, v2=fmt == "gptq_v2")
        elif fmt == "awq":
            parts = awq_tensors(c)
        else:
            parts = ct4_tensors(c, sym, act_order, scale_dtype)
        quantized.update({f"{layer}.{k}": v for k, v in parts.items()})
    config = json.loads((base / "config.json").read_text())
    for folder, tensors, qc in (
        (out, quantized, quantization_config(fmt, group_size, sym, act_order)),
        (reference, ref, None),
    ):
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors")
        (folder / "config.json").write_text(json.dumps({**config, **({"quantization_config": qc} if qc else {})}))
        for f in base.iterdir():
            if f.name not in ("config.json", "model.safetensors") and f.is_file():
                shutil.copy(f, folder / f.name)
    return codes
