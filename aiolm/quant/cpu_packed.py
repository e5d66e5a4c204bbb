"""Float32 and bfloat16 linear layers on the CPU, with each weight laid out once at load time.

``F.linear`` goes to MKL's sgemm, which re-lays out the weight on every call and
takes a slow path on AMD CPUs. aiolm's own kernel (``aiolm::panel_linear``,
ext/cpu/panel_gemm.cpp) reads the weight as panels of 16 output columns, and in a
whole model's sequence of layers beats oneDNN's packed GEMM at small batches and
matches it above (benchmarks/bench_linear.py). Without the compiled kernels, oneDNN's
packed weight is the fallback. Either layout is checked against ``F.linear`` on a probe
before it is used, once per shape and layout in a process (the kernels do not depend on
the values, and a model's hundreds of linears have a handful of shapes, so probing every
weight would only slow each worker's start: docs/benchmarks/log.md), and a layer whose
layout fails the probe keeps its plain weight.

With a bfloat16 matmul dtype (``--dtype bfloat16`` on a CPU that multiplies in it) the
weight is instead packed by oneDNN in bfloat16, which runs on AMX or AVX512-BF16: x is
rounded to bfloat16 on the way in and y comes back as float32, so everything between
the matmuls stays float32. The LM head always multiplies in float32, so that greedy
picks and logprobs do not hang on bfloat16's 8-bit logits.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from aiolm.kernels import cpu as cpu_kernels
from aiolm.quant.base import ExpertsMethod, ExpertsSpec, LinearMethod, LinearSpec, QuantConfig

log = logging.getLogger(__name__)

PANEL = 16  # output columns per panel, as panel_gemm.cpp lays them out
_ONEDNN_BATCH_HINT = 64  # oneDNN picks its weight layout for about this many rows


@dataclass(frozen=True)
class PackedWeight:
    """A weight [out, in] in the layout of the kernel that multiplies a float32 x by it."""

    data: torch.Tensor
    out_features: int
    panels: bool  # True: aiolm::panel_linear's [P, in, 16]; False: oneDNN's opaque layout
    hand_over_bf16: bool = False  # a bfloat16 matmul's y as it comes (the next op reads bfloat16)

    def fuses(self, activation: str) -> bool:
        """Whether the kernel applies ``activation`` to y as it writes it: not a bfloat16
        matmul whose y comes back as float32 (its bias is added after the rounding)."""
        if self.panels:
            return activation in _PANEL_ACTS
        return activation in _ONEDNN_ACTS and (self.data.dtype != torch.bfloat16 or self.hand_over_bf16)

    def __call__(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = None
    ) -> torch.Tensor:
        """act(x W^T + b) in float32, or in bfloat16 for a bfloat16 matmul that hands its
        output over; ``activation`` only one that ``fuses`` names."""
        # The bias and activation are applied inside each kernel, to the float32 sums: no
        # pass of their own over y, and a handed-over bfloat16 y is rounded once, after
        # them. A bfloat16 y that comes back as float32 gets its bias after the rounding
        # instead, exactly: a large bias (Qwen2's on k) would otherwise round y's own bits away.
        if self.panels:
            return torch.ops.aiolm.panel_linear(
                x, self.data, self.out_features, bias, _PANEL_ACTS.get(activation, "none")
            )
        attr, algorithm = _ONEDNN_ACTS.get(activation, ("none", ""))
        if self.data.dtype == torch.bfloat16:
            x = x.to(torch.bfloat16)
            if self.hand_over_bf16:
                return torch.ops.mkldnn._linear_pointwise(x, self.data, bias, attr, [], algorithm)
            y = torch.ops.mkldnn._linear_pointwise(x, self.data, None, "none", [], "").float()
            return y if bias is None else y.add_(bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.data, bias, attr, [], algorithm)


# hidden_act names -> the kernels' own: aiolm::panel_linear's act, oneDNN's post-op and algorithm
_PANEL_ACTS = {"gelu": "gelu"}
_ONEDNN_ACTS = {
    "gelu": ("gelu", "none"),
    "gelu_new": ("gelu", "tanh"),
    "gelu_pytorch_tanh": ("gelu", "tanh"),
    "relu": ("relu", ""),
}


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [ceil(out / 16), in, 16], zero-padded: panel p holds columns 16p..16p+15."""
    n, k = weight.shape
    p = -(-n // PANEL)
    if n % PANEL:
        padded = weight.new_zeros(p * PANEL, k)
        padded[:n] = weight
        weight = padded
    # numpy's strided copy, because torch's .contiguous() is slower at this transpose
    # (docs/benchmarks/log.md); torch allocates the panels (64-byte aligned, as panel_linear needs)
    panels = torch.empty(p, k, PANEL)
    np.copyto(panels.numpy(), weight.detach().reshape(p, PANEL, k).numpy().transpose(0, 2, 1))
    return panels


def _pack(weight: torch.Tensor, dtype: torch.dtype) -> PackedWeight | None:
    if dtype == torch.float32 and cpu_kernels.ready(weight):
        return PackedWeight(to_panels(weight), weight.shape[0], panels=True)
    weight = weight.to(dtype)
    try:
        data = torch.ops.mkldnn._reorder_linear_weight(weight, _ONEDNN_BATCH_HINT)
    except (AttributeError, RuntimeError) as e:
        log.info("oneDNN packed linear unavailable, using F.linear: %s", e)
        return None
    return PackedWeight(data, weight.shape[0], panels=False)


def pack_weight(
    weight: torch.Tensor, dtype: torch.dtype = torch.float32, hand_over_bf16: bool = False
) -> PackedWeight | None:
    """A packed copy of a float32 CPU weight [out, in] to multiply in ``dtype`` (float32 or
    bfloat16), or None if none can be used."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"packed CPU matmuls run in float32 or bfloat16, not {dtype}")
    packed = _pack(weight.contiguous(), dtype)
    if packed is None:
        return None
    key = (tuple(weight.shape), dtype, packed.panels, packed.data.dtype)
    if key not in _PROBED:
        _PROBED[key] = _probe(packed, weight, dtype)
    if not _PROBED[key]:
        return None
    if hand_over_bf16 and packed.data.dtype == torch.bfloat16:
        packed = dataclasses.replace(packed, hand_over_bf16=True)
    return packed


# (shape, matmul dtype, layout) -> whether the packed layout passed its probe in this process
_PROBED: dict[tuple, bool] = {}


def _probe(packed: PackedWeight, weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the packed layout multiplies like ``F.linear`` on a probe x."""
    probe = torch.randn(7, weight.shape[1], generator=torch.Generator().manual_seed(0))
    got = packed(probe).float()
    want = nn.functional.linear(probe.to(dtype), weight.to(dtype)).float()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    if torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max()) + 1e-6):
        return True
    log.warning("packed %s linear of shape %s disagrees with F.linear on a probe; not using it", dtype, weight.shape)
    return False


class CpuPackedMethod(LinearMethod):
    """The layer's float32 weight packed once for ``dtype`` matmuls; ``layer.packed`` holds
    the copy (None where no layout passed its probe: then the plain weight)."""

    def __init__(self, dtype: torch.dtype, hand_over_bf16: bool = False, keep_weight: bool = False) -> None:
        self.dtype = dtype
        self.hand_over_bf16 = hand_over_bf16
        self.keep_weight = keep_weight

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        super().create_weights(layer, in_features, out_features)
        layer.packed = None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        packed = pack_weight(layer.weight.data, self.dtype, self.hand_over_bf16)
        layer.packed = packed
        if packed is not None and not self.keep_weight:
            layer.weight = nn.Parameter(torch.empty(0), requires_grad=False)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = None
    ) -> torch.Tensor:
        packed = layer.packed
        if packed is None:
            return super().apply(layer, x, bias)
        return packed(x, bias, activation)

    def fuses(self, layer: nn.Module, activation: str) -> bool:
        return layer.packed is not None and layer.packed.fuses(activation)


class CpuPackedExpertsMethod(ExpertsMethod):
    """A layer of experts laid out once for ``aiolm::fused_moe`` (aiolm/kernels/cpu_moe.py:
    every routed expert over its tokens in one call) in ``dtype``; ``layer.cpu_experts`` holds
    them and the dense weights go."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        from aiolm.kernels.cpu_moe import CpuExperts

        layer.cpu_experts = CpuExperts.from_dense(layer.w13.data, layer.w2.data, self.dtype)
        layer.w13 = nn.Parameter(torch.empty(0), requires_grad=False)
        layer.w2 = nn.Parameter(torch.empty(0), requires_grad=False)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        return layer.cpu_experts(x, topk_weights, topk_ids)


class CpuPackedConfig(QuantConfig):
    """Decoder layers multiply in ``matmul_dtype`` (float32 or bfloat16), the LM head in
    float32. With ``hand_over_bf16`` (the fused C++ ops read bfloat16), a bfloat16 matmul
    whose output goes straight into such an op hands it over as it is."""

    name = "cpu_packed"

    def __init__(self, matmul_dtype: torch.dtype = torch.float32, hand_over_bf16: bool = False) -> None:
        self.matmul_dtype = matmul_dtype
        self.hand_over_bf16 = hand_over_bf16

    def linear_method(self, spec: LinearSpec) -> LinearMethod:
        if spec.lm_head:
            return CpuPackedMethod(torch.float32, keep_weight=spec.shared_weight)
        return CpuPackedMethod(
            self.matmul_dtype, self.hand_over_bf16 and spec.output_to_kernel, keep_weight=spec.shared_weight
        )

    def experts_method(self, spec: ExpertsSpec) -> ExpertsMethod:
        return CpuPackedExpertsMethod(self.matmul_dtype)
