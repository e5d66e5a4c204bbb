"""The tensors of a quantized checkpoint's linear layer, unpacked (the formats are described
in aiolm/checkpoint/quantization.py).

A layer's 4-bit weights become ``Int4Codes``: codes 0-15 [N, K], a scale and a zero point per
output row and group, and the group of each input feature. ``dense()`` is the float32 weight
s * (q - z), exactly: a float16 or bfloat16 scale times a difference of 4-bit integers needs
at most 15 significant bits. The loader hands every model these dense weights
(``dequantized_weights``), and the CPU's small steps read the codes themselves
(aiolm/quant/int4_blocks.py). fp8 weights become float32 the same way (e4m3 times its scale).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from aiolm.checkpoint.quantization import WeightQuant
from aiolm.errors import ModelLoadError

# The parts of one linear layer, by method: (required, optional)
_PARTS = {
    "gptq": (("qweight", "qzeros", "scales"), ("g_idx",)),
    "awq": (("qweight", "qzeros", "scales"), ()),
    "ct4": (("weight_packed", "weight_scale", "weight_shape"), ("weight_zero_point", "weight_g_idx")),
    "fp8": (("weight",), ("weight_scale", "weight_scale_inv")),
}
# Scales of a format's activations: activations stay in the model's dtype, unquantized. (The
# KV cache's scales, self_attn.k_scale and v_scale, are read by the builder: model/registry.py.)
_UNUSED = ("input_scale", "output_scale")
# AWQ packs output column j of a group of 8 into nibble _AWQ_NIBBLE[j] of its int32
_AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)


@dataclass(frozen=True)
class Int4Codes:
    """One layer's 4-bit weight: w[n, k] = scale[n, g] * (codes[n, k] - zero[n, g]), g = group[k]."""

    codes: torch.Tensor  # uint8 [N, K], 0-15
    scale: torch.Tensor  # float32 [N, G]
    zero: torch.Tensor  # float32 [N, G], 0-15
    group: torch.Tensor  # int64 [K]

    def dense(self) -> torch.Tensor:
        g = self.group
        return self.scale[:, g] * (self.codes.float() - self.zero[:, g])


def _kind(quant: WeightQuant) -> str:
    if quant.method == "compressed-tensors":
        return "ct4" if quant.int4 else "fp8"
    return quant.method


def _nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their 8 nibbles, low first, laid out along ``dim`` (uint8)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    w = packed.to(torch.int32).unsqueeze(-1)
    nib = ((w >> shifts) & 15).to(torch.uint8)  # [..., words, 8]
    if dim == packed.dim() - 1:
        return nib.flatten(-2)
    return nib.movedim(-1, dim + 1).flatten(dim, dim + 1)  # dim 0: [words, 8, cols] -> [words * 8, cols]


def _g_idx(p: dict[str, torch.Tensor], name: str, quant: WeightQuant, where: str) -> torch.Tensor | None:
    """A layer's g_idx where its groups are in activation order (required there: the contiguous
    groups assumed without it would load the wrong scales); None where they are not."""
    if not quant.act_order:
        return None
    if name not in p:
        raise ModelLoadError(f"{where}.{name}: missing (the groups are in activation order)")
    return p[name]


def _groups(k: int, size: int, g_idx: torch.Tensor | None, where: str) -> torch.Tensor:
    if g_idx is not None:
        if g_idx.numel() != k:
            raise ModelLoadError(f"{where}: g_idx has {g_idx.numel()} entries for {k} input features")
        return g_idx.to(torch.int64)
    return torch.arange(k) // (k if size == -1 else size)


def _int4(kind: str, quant: WeightQuant, p: dict[str, torch.Tensor], where: str) -> Int4Codes:
    if kind == "gptq":
        codes = _nibbles(p["qweight"], 0).t()  # [K, N] -> [N, K]
        scale = p["scales"].float().t()  # [G, N] -> [N, G]
        # GPTQ v1 stores z - 1 in 4 bits: a zero point of 0 is stored as 15 and wraps back
        zero = ((_nibbles(p["qzeros"], 1).t()[: codes.shape[0]] + quant.zero_offset) & 15).float()
        group = _groups(codes.shape[1], quant.group_size, _g_idx(p, "g_idx", quant, where), where)
    elif kind == "awq":
        order = torch.tensor(_AWQ_NIBBLE)

        def columns(packed: torch.Tensor) -> torch.Tensor:  # [R, N/8] -> [R, N] in column order
            nib = _nibbles(packed, 1).view(packed.shape[0], -1, 8)
            return nib[:, :, order].flatten(1)

        codes = columns(p["qweight"]).t()
        scale = p["scales"].float().t()
        zero = columns(p["qzeros"]).t().float()
        group = _groups(codes.shape[1], quant.group_size, None, where)
    else:  # compressed-tensors pack-quantized
        n, k = (int(v) for v in p["weight_shape"].tolist())
        codes = _nibbles(p["weight_packed"], 1)[:, :k]
        scale = p["weight_scale"].float()
        if quant.symmetric:
            zero = torch.full_like(scale, 8.0)
        else:
            if "weight_zero_point" not in p:
                raise ModelLoadError(f"{where}.weight_zero_point: missing (asymmetric weights)")
            zero = _nibbles(p["weight_zero_point"], 0)[:n].float()
        group = _groups(k, quant.group_size, _g_idx(p, "weight_g_idx", quant, where), where)
        if codes.shape[0] != n:
            raise ModelLoadError(f"{where}.weight_packed: {codes.shape[0]} rows, weight_shape says {n}")
    n, k = codes.shape
    groups = int(group.max()) + 1 if k else 0
    if scale.shape != (n, groups) or zero.shape != (n, groups) or int(group.min()) < 0:
        raise ModelLoadError(
            f"{where}: scales {tuple(scale.shape)} and zero points {tuple(zero.shape)} do not fit "
            f"a [{n}, {k}] weight in {groups} groups"
        )
    return Int4Codes(codes.contiguous(), scale.contiguous(), zero.contiguous(), group)


@dataclass(frozen=True)
class Fp8Weight:
    """One layer's fp8 weight: w[n, k] = values[n, k] * scale[k // scale_k, n]. Block scales
    (weight_block_size) give one row per block of inputs; per-tensor and per-channel ones a
    single row (scale_k covers every input, rounded up to the GEMM's step of 32)."""

    values: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # float32 [ceil(K / scale_k), N]
    scale_k: int

    def dense(self) -> torch.Tensor:
        k = self.values.shape[1]
        return self.values.float() * self.scale.t().repeat_interleave(self.scale_k, 1)[:, :k]


def fp8_weight(quant: WeightQuant, p: dict[str, torch.Tensor], where: str) -> Fp8Weight:
    """A fp8 layer's weight and scales from its checkpoint tensors (by leaf name)."""
    w = p["weight"]
    if w.dtype != torch.float8_e4m3fn:
        raise ModelLoadError(f"{where}.weight: {w.dtype} in an fp8 checkpoint; float8_e4m3fn expected")
    n, k = w.shape
    if quant.block_size is not None:
        if "weight_scale_inv" not in p:
            raise ModelLoadError(f"{where}.weight_scale_inv: missing (weight_block_size is set)")
        bn, bk = quant.block_size
        s = p["weight_scale_inv"].float()
        if s.shape != (-(-n // bn), -(-k // bk)):
            raise ModelLoadError(f"{where}.weight_scale_inv: shape {tuple(s.shape)} for a [{n}, {k}] weight")
        return Fp8Weight(w, s.repeat_interleave(bn, 0)[:n].t().contiguous(), bk)
    scale = p.get("weight_scale", p.get("weight_scale_inv"))
    if scale is None:
        raise ModelLoadError(f"{where}.weight_scale: missing")
    s = scale.float().reshape(-1)
    if s.numel() not in (1, n):  # per tensor, or per output channel
        raise ModelLoadError(f"{where}.weight_scale: {s.numel()} scales for {n} output channels")
    return Fp8Weight(w, s.expand(n).reshape(1, n).contiguous(), -(-k // 32) * 32)


def input_order(parts: list[Int4Codes]) -> torch.Tensor | None:
    """The order that sorts the inputs of the layer stacking ``parts`` by group, the layout the
    packed kernels read; None where the parts disagree on an input's group (activation orders
    of their own) or the inputs are not whole blocks of 32."""
    first = parts[0]
    if first.codes.shape[1] % 32 or any(not torch.equal(p.group, first.group) for p in parts[1:]):
        return None
    return torch.argsort(first.group, stable=True)


def int4_codes(quant: WeightQuant, parts: dict[str, torch.Tensor], where: str) -> Int4Codes:
    """A 4-bit layer's codes from its checkpoint tensors (by leaf name: qweight, scales, ...)."""
    return _int4(_kind(quant), quant, parts, where)


def dequantized_weights(weights: Iterable[tuple[str, Any]], quant: WeightQuant) -> Iterator[tuple[str, Any]]:
    """The checkpoint's (name, tensor) pairs with each quantized layer's parts replaced by its
    float32 ``<layer>.weight``; dense tensors pass through as they come. A layer's parts are
    collected wherever the files put them and its weight follows the last tensor read."""
    kind = _kind(quant)
    required, optional = _PARTS[kind]
    leaves = set(required) | set(optional)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, w in weights:
        layer, _, leaf = name.rpartition(".")
        if leaf in _UNUSED:
            continue
        if leaf not in leaves or (leaf == "weight" and not _is_fp8(w)):  # a dense layer's weight
            yield name, w
            continue
        pending.setdefault(layer, {})[leaf] = w[...]
    for layer, parts in pending.items():
        missing = [r for r in required if r not in parts]
        if missing:
            raise ModelLoadError(f"{layer}.{missing[0]}: missing from the {quant.method} checkpoint")
        if kind == "fp8":
            yield f"{layer}.weight", fp8_weight(quant, parts, layer).dense()
        else:
            yield f"{layer}.weight", int4_codes(quant, parts, layer).dense()


def _is_fp8(w: Any) -> bool:
    """Whether a tensor (or the loader's LazyWeight) holds float8 e4m3 values, without reading it."""
    return w.dtype in (torch.float8_e4m3fn, "F8_E4M3")


class CheckpointReader:
    """A quantized checkpoint's layers read again after loading, by the methods that keep them
    packed (the CPU's blocks, the GPU's quantized GEMMs): each layer's tensors by leaf name."""

    def __init__(self, path: Any, quant: WeightQuant) -> None:
        self.path, self.quant = path, quant
        self._layers: dict[str, dict[str, Any]] | None = None  # layer -> leaf name -> its open file

    def parts(self, layer: str) -> dict[str, torch.Tensor]:
        if self._layers is None:
            from safetensors import safe_open

            from aiolm.checkpoint.source import resolve_model

            self._layers = {}
            for f in resolve_model(self.path).safetensors_files():
                handle = safe_open(str(f), framework="pt")
                for name in handle.keys():  # noqa: SIM118 (a safetensors file handle, not a dict)
                    owner, _, leaf = name.rpartition(".")
                    self._layers.setdefault(owner, {})[leaf] = handle
        files = self._layers.get(layer, {})
        return {leaf: handle.get_tensor(f"{layer}.{leaf}") for leaf, handle in files.items()}

    def int4(self, layer: str) -> Int4Codes | None:
        """The layer's 4-bit codes; None where the checkpoint keeps it dense (its ignore list)."""
        parts = self.parts(layer)
        if "weight" in parts or not parts:
            return None
        return int4_codes(self.quant, parts, layer)

    def fp8(self, layer: str) -> Fp8Weight | None:
        """The layer's fp8 weight; None for a dense layer."""
        parts = self.parts(layer)
        w = parts.get("weight")
        if w is None or w.dtype != torch.float8_e4m3fn:
            return None
        return fp8_weight(self.quant, parts, layer)

    def release(self) -> None:
        self._layers = None
