"""Linear layers on the CPU through oneDNN with weights packed once at load time.

``F.linear`` on a CPU goes to MKL's sgemm, which re-lays out the weight on every
call and, on AMD CPUs, takes a slower path; a oneDNN primitive over a
pre-reordered weight does neither. Measured with this machine's two threads
(benchmarks/bench_linear.py) it is 1.1-2x faster for SmolLM2's shapes, the LM
head most of all. Packing is float32-only and falls back to ``F.linear`` when
the ops are missing or disagree with it on a probe.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

_BATCH_HINT = 64  # oneDNN picks its weight layout for about this many rows


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A oneDNN-packed copy of a float32 CPU weight [out, in], or None if it can't be used."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _BATCH_HINT)
        probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0))
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except (AttributeError, RuntimeError) as e:
        log.info("oneDNN packed linear unavailable, using F.linear: %s", e)
        return None
    want = nn.functional.linear(probe, weight)
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()) + 1e-6):
        log.warning("oneDNN packed linear disagrees with F.linear on a probe; not using it")
        return None
    return packed


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
