"""Sampling's native kernels behind plain functions.

The sampler calls these and never asks which implementation runs: the C++ op
where it can take the tensor, torch otherwise, with the same results (for a random
draw, the same distribution: see :func:`sample_rows`).
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


def sample_rows(x: torch.Tensor, uniforms: torch.Tensor, knobs: torch.Tensor) -> torch.Tensor | None:
    """Each row's token drawn from logits ``x`` [rows, vocab] with its uniform number
    (float64 [rows]) and its knobs (float64 [rows, 4]: temperature, 0 for the argmax; top_k,
    0 for none; top_p; min_p), by ``aiolm::sample_rows`` (ext/cpu/sample.h), the function the
    whole-step call samples with too; None where the op does not take ``x`` (the sampler's
    torch path then draws from the same distribution, with its own rounding).
    """
    if cpu_kernels.ready(x) and x.dim() == 2 and x.shape[1] > 0 and x.stride(1) == 1:
        return torch.ops.aiolm.sample_rows(x, uniforms, knobs)
    return None


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int] | None = None) -> None:
    """Structured outputs' mask, in place: -inf wherever a row's bitmask bit is 0 (bit j % 32
    of int32 word j // 32), on ``indices`` only when given (bitmask row i masks logits row i).

    Float32 CPU logits with dense rows go to ``aiolm::apply_token_bitmask_``
    (ext/cpu/token_bitmask.cpp), which skips all-allowed words and writes the rest with
    masked vector stores; anything else to xgrammar's own kernel for its device.
    """
    if indices is not None and not indices:
        return
    if (
        cpu_kernels.ready(logits)
        and logits.dim() == 2
        and logits.stride(1) == 1
        and bitmask.device.type == "cpu"
        and bitmask.dtype == torch.int32
        and bitmask.is_contiguous()
        and bitmask.shape[0] == logits.shape[0]
    ):
        torch.ops.aiolm.apply_token_bitmask_(logits, bitmask, indices or [])
        return
    from aiolm.structured.backend import xgrammar_module

    xgrammar_module().apply_token_bitmask_inplace(
        logits, bitmask.to(logits.device, non_blocking=True), vocab_size=logits.shape[1], indices=indices
    )
