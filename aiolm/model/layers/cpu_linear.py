"""Float32 linear layers on the CPU, with each weight laid out once at load time.

``F.linear`` goes to MKL's sgemm, which re-lays out the weight on every call and
takes a slow path on AMD CPUs. aiolm's own kernel (``aiolm::panel_linear``,
kernels/csrc/panel_gemm.cpp) reads the weight as panels of 16 output columns;
in a whole model's sequence of layers it beats oneDNN's packed GEMM by 15-40%
at 16-128 rows and matches it above (benchmarks/bench_linear.py). Without the
compiled kernels, oneDNN's packed weight is the fallback. Either layout is
checked against ``F.linear`` on a probe before it is used.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from aiolm.kernels import cpu as cpu_kernels

log = logging.getLogger(__name__)

PANEL = 16  # output columns per panel, as panel_gemm.cpp lays them out
_ONEDNN_BATCH_HINT = 64  # oneDNN picks its weight layout for about this many rows


@dataclass(frozen=True)
class PackedWeight:
    """A float32 weight [out, in] in the layout of the kernel that multiplies by it."""

    data: torch.Tensor
    out_features: int
    panels: bool  # True: aiolm::panel_linear's [P, in, 16]; False: oneDNN's opaque layout

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.panels:
            y = torch.ops.aiolm.panel_linear(x, self.data, self.out_features)
            return y if bias is None else y.add_(bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.data, bias, "none", [], "")


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [ceil(out / 16), in, 16], zero-padded: panel p holds columns 16p..16p+15."""
    n, k = weight.shape
    p = -(-n // PANEL)
    padded = weight.new_zeros(p * PANEL, k)
    padded[:n] = weight
    return padded.view(p, PANEL, k).transpose(1, 2).contiguous()


def _pack(weight: torch.Tensor) -> PackedWeight | None:
    if cpu_kernels.ready(weight):
        return PackedWeight(to_panels(weight), weight.shape[0], panels=True)
    try:
        data = torch.ops.mkldnn._reorder_linear_weight(weight, _ONEDNN_BATCH_HINT)
    except (AttributeError, RuntimeError) as e:
        log.info("oneDNN packed linear unavailable, using F.linear: %s", e)
        return None
    return PackedWeight(data, weight.shape[0], panels=False)


def pack_weight(weight: torch.Tensor) -> PackedWeight | None:
    """A packed copy of a float32 CPU weight [out, in], or None if none can be used."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    packed = _pack(weight.contiguous())
    if packed is None:
        return None
    probe = torch.randn(7, weight.shape[1], generator=torch.Generator().manual_seed(0))
    got, want = packed.linear(probe), nn.functional.linear(probe, weight)
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()) + 1e-6):
        log.warning("packed linear disagrees with F.linear on a probe; not using it")
        return None
    return packed
