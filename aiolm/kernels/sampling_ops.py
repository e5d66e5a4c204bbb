"""Sampling's native kernels behind plain functions.

The sampler calls these and never asks which implementation runs: the C++ op
where it can take the tensor, torch otherwise, with the same results.
"""

from __future__ import annotations

import torch

from aiolm.kernels import cpu as cpu_kernels


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(x, -1)`` of logits [rows, vocab], the same indices (ties: the first).

    Float32 CPU rows with dense rows go to ``aiolm::argmax_rows`` (ext/cpu/argmax.cpp),
    a vector max then the first index holding it: torch's own argmax is
    memory-bound well below what a CPU can read.
    """
    if cpu_kernels.ready(x) and x.dim() == 2 and x.shape[1] > 0 and x.stride(1) == 1:
        return torch.ops.aiolm.argmax_rows(x)
    return x.argmax(dim=-1)
