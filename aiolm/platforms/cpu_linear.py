"""Float32 linear layers on the CPU, with each weight laid out once at load time.

``F.linear`` goes to MKL's sgemm, which re-lays out the weight on every call and
takes a slow path on AMD CPUs. aiolm's own kernel (``aiolm::panel_linear``,
ext/cpu/panel_gemm.cpp) reads the weight as panels of 16 output columns;
in a whole model's sequence of layers it beats oneDNN's packed GEMM by 15-40%
at 16-128 rows and matches it above (benchmarks/bench_linear.py). Without the
compiled kernels, oneDNN's packed weight is the fallback. Either layout is
checked against ``F.linear`` on a probe before it is used.

With ``dtype=torch.bfloat16`` (``--dtype bfloat16`` on a CPU) the weight is
instead packed by oneDNN in bfloat16, which runs on AMX or AVX512-BF16 where the
CPU has them (3-4x the float32 rate on long prefills here): x is rounded to
bfloat16 on the way in and y comes back as float32, so everything between the
matmuls stays float32.
"""

from __future__ import annotations

import dataclasses
import functools
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
    """A weight [out, in] in the layout of the kernel that multiplies a float32 x by it."""

    data: torch.Tensor
    out_features: int
    panels: bool  # True: aiolm::panel_linear's [P, in, 16]; False: oneDNN's opaque layout
    hand_over_bf16: bool = False  # a bfloat16 matmul's y as it comes (the next op reads bfloat16)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y in float32, or in bfloat16 for a bfloat16 matmul that hands its output over."""
        if self.panels:
            y = torch.ops.aiolm.panel_linear(x, self.data, self.out_features)
            return y if bias is None else y.add_(bias)
        if self.data.dtype == torch.bfloat16:
            y = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), self.data, None, "none", [], "")
            if not self.hand_over_bf16:
                y = y.float()
            return y if bias is None else y.add_(bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.data, bias, "none", [], "")


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [ceil(out / 16), in, 16], zero-padded: panel p holds columns 16p..16p+15."""
    n, k = weight.shape
    p = -(-n // PANEL)
    padded = weight.new_zeros(p * PANEL, k)
    padded[:n] = weight
    return padded.view(p, PANEL, k).transpose(1, 2).contiguous()


@functools.cache
def bfloat16_matmuls() -> bool:
    """Whether oneDNN packs bfloat16 weights on this CPU. It needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT; an AVX2-only CPU has neither, and bfloat16 there would be emulated."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), _ONEDNN_BATCH_HINT)
    except (AttributeError, RuntimeError):
        return False
    return True


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


def pack_weight(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> PackedWeight | None:
    """A packed copy of a float32 CPU weight [out, in] to multiply in ``dtype`` (float32 or
    bfloat16), or None if none can be used."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"packed CPU matmuls run in float32 or bfloat16, not {dtype}")
    packed = _pack(weight.contiguous(), dtype)
    if packed is None:
        return None
    probe = torch.randn(7, weight.shape[1], generator=torch.Generator().manual_seed(0))
    got = packed(probe).float()
    want = nn.functional.linear(probe.to(dtype), weight.to(dtype)).float()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    if not torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max()) + 1e-6):
        log.warning("packed linear disagrees with F.linear on a probe; not using it")
        return None
    return packed


def pack_model(model: nn.Module, matmul_dtype: torch.dtype, hand_over_bf16: bool) -> int:
    """Swap each float32 linear's weight for a packed copy once loading is done.

    The decoder layers multiply in ``matmul_dtype``; the LM head always in float32, so
    that greedy picks and logprobs do not hang on bfloat16's 8-bit logits, and it keeps
    its plain weight when tied, since the embedding reads it. With ``hand_over_bf16``,
    bfloat16 matmuls whose output feeds a kernel that reads bfloat16 (gate/up into
    silu_and_mul, o/down into the fused residual norm, with one rank) return it as it
    is; QKV's output goes to RoPE and attention in float32. Returns how many were packed.
    """
    from aiolm.model.layers.linear import PackableLinear, QKVParallelLinear, RowParallelLinear

    head = getattr(model, "lm_head", None)
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    n = 0
    for m in model.modules():
        if not isinstance(m, PackableLinear):
            continue
        is_head = m is head
        dtype = torch.float32 if is_head else matmul_dtype
        packed = pack_weight(m.weight.data, dtype)
        if packed is None:
            continue
        feeds_bf16 = not isinstance(m, QKVParallelLinear) and not (
            isinstance(m, RowParallelLinear) and m.tp.world_size > 1)
        if hand_over_bf16 and feeds_bf16 and not is_head and dtype == torch.bfloat16:
            packed = dataclasses.replace(packed, hand_over_bf16=True)
        m.method = packed
        if not (tied and is_head):
            m.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        n += 1
    return n
