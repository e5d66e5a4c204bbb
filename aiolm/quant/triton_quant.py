"""A quantized checkpoint's layers kept packed on the GPU and multiplied by the Triton GEMMs
(aiolm/kernels/triton/quant_gemm.py): 4-bit codes (GPTQ, AWQ, compressed-tensors W4A16) or
fp8 bytes (fp8, compressed-tensors W8A8-fp8).

The loader gives every layer its dense weight (aiolm/quant/checkpoint_formats.py); once the
model is on its device, each layer whose tensors the checkpoint quantized reads them again,
keeps them in the kernel's layout, and lets the dense weight go. Activations stay in the
model's dtype (no per-token fp8 rounding of x). A fused layer (q/k/v, gate/up) stacks its
tensors' outputs; one whose tensors order their inputs differently (activation order) or
whose groups are uneven keeps its dense weight. One tensor-parallel rank: on more, every
layer runs its dense slice.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aiolm.checkpoint.quantization import WeightQuant
from aiolm.quant.base import ExpertsMethod, ExpertsSpec, LinearMethod, LinearSpec, QuantConfig
from aiolm.quant.checkpoint_formats import CheckpointReader, Int4Codes, input_order
from aiolm.quant.dense import DenseConfig

log = logging.getLogger(__name__)


def pack_int4(parts: list[Int4Codes]) -> dict[str, Any] | None:
    """The w4a16_gemm operands of the layer stacking ``parts``: qweight [K/8, N] int32 over the
    inputs sorted by group, scale and mins [G, N] float32, group size, and perm (None: in
    order); None where the parts' groups differ or are uneven."""
    perm = input_order(parts)
    if perm is None:
        return None
    k = perm.numel()
    groups = parts[0].group[perm]
    num_groups = int(groups[-1]) + 1
    size = k // num_groups
    if size % 32 or not torch.equal(groups, torch.arange(k) // size):
        return None
    codes = torch.cat([p.codes for p in parts])[:, perm].t().to(torch.int64)  # [K, N]
    words = sum(codes[i::8] << (4 * i) for i in range(8))  # [K/8, N]
    qweight = words.to(torch.uint32).view(torch.int32)  # the top nibble's bit 31 wraps, as GPTQ's words do
    scale = torch.cat([p.scale for p in parts]).t().contiguous()
    mins = -torch.cat([p.scale * p.zero for p in parts]).t().contiguous()
    identity = bool((perm == torch.arange(k)).all())
    return {
        "qweight": qweight.contiguous(),
        "scale": scale,
        "mins": mins,
        "group_size": size,
        "perm": None if identity else perm.to(torch.int32),
    }


class TritonQuantMethod(LinearMethod):
    """Dense weights until loaded; then the checkpoint's packed tensors in ``layer.packed``."""

    def __init__(self, config: TritonQuantConfig, spec: LinearSpec) -> None:
        self.config, self.names = config, spec.names

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        device, reader = layer.weight.device, self.config.reader
        layer.packed = None
        if self.config.quant.int4:
            codes = [reader.int4(n) for n in self.names]
            packed = pack_int4(codes) if all(c is not None for c in codes) else None  # type: ignore[arg-type]
            if packed is not None:
                layer.packed = ("int4", {k: v.to(device) if torch.is_tensor(v) else v for k, v in packed.items()})
        else:
            got = [reader.fp8(n) for n in self.names]
            steps = {g.scale_k for g in got if g is not None}
            # fp8_gemm steps through K 32 at a time: other block sizes keep the dense weight
            if all(g is not None for g in got) and len(steps) == 1 and steps.pop() % 32 == 0:
                weight = torch.cat([g.values.view(torch.uint8) for g in got]).to(device)  # type: ignore[union-attr]
                scale = torch.cat([g.scale for g in got], 1).to(device)  # type: ignore[union-attr]
                layer.packed = ("fp8", {"weight": weight, "scale": scale, "scale_k": got[0].scale_k})  # type: ignore[union-attr]
        if layer.packed is not None:
            layer.out_dtype = layer.weight.dtype
            layer.weight = nn.Parameter(torch.empty(0, dtype=layer.weight.dtype, device=device), requires_grad=False)
            self.config.packed_layers += 1

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if layer.packed is None:
            return super().apply(layer, x, bias)
        from aiolm.kernels.triton.quant_gemm import fp8_gemm, w4a16_gemm

        kind, t = layer.packed
        x2 = x.reshape(-1, x.shape[-1]).to(layer.out_dtype)
        if kind == "int4":
            y = w4a16_gemm(x2, t["qweight"], t["scale"], t["mins"], t["group_size"], t["perm"])
        else:
            y = fp8_gemm(x2, t["weight"], t["scale"], t["scale_k"])
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if bias is None else y + bias


class TritonQuantConfig(QuantConfig):
    """The checkpoint at ``path`` (``quant``'s format) through the Triton GEMMs; experts as
    the dense config runs them."""

    name = "triton_quant"

    def __init__(self, path: Path, quant: WeightQuant, experts: str = "triton") -> None:
        self.quant = quant
        self.reader = CheckpointReader(path, quant)
        self.dense = DenseConfig(experts=experts)
        self.packed_layers = 0

    def linear_method(self, spec: LinearSpec) -> LinearMethod:
        return TritonQuantMethod(self, spec)

    def experts_method(self, spec: ExpertsSpec) -> ExpertsMethod:
        return self.dense.experts_method(spec)

    def release(self) -> None:
        self.reader.release()
        log.info(
            "%d layers keep the checkpoint's %s weights for the Triton GEMMs", self.packed_layers, self.quant.method
        )
