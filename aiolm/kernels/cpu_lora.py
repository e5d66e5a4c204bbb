"""Batched LoRA on the CPU: ``torch.ops.aiolm.lora_apply_`` (ext/cpu/lora.cpp).

A batch mixes requests of different adapters, so a LoRA linear layer adds to each row the
update of that row's own adapter slot. In torch that is a loop over the slots present, each
turn a mask, two index copies and two small matmuls: a dozen dispatches per slot, four
layers' worth per decoder layer per step. The C++ op does a layer in one call: it sorts the
rows by slot, shrinks each slot's rows by its A and expands them by its B straight into y,
splitting the slots' work over the cores, and never touches a row without an adapter.
Without the compiled kernels, or for other dtypes and devices, ``lora_reference`` does the
same sums in torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from aiolm.kernels import cpu as cpu_kernels
from aiolm.kernels.lora_reference import lora_reference


def available() -> bool:
    """Whether ``torch.ops.aiolm.lora_apply_`` is loaded (a C++ compiler built the kernels)."""
    return cpu_kernels.load()


def lora_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slot_ids: torch.Tensor,
    slice_starts: Sequence[int],
) -> None:
    """``y += `` each row's adapter update, in place, as ``lora_reference`` defines it: by the
    C++ op when the kernels are loaded and y, x, lora_a and lora_b are float32 CPU tensors,
    else by ``lora_reference``."""
    if all(cpu_kernels.ready(t) for t in (y, x, lora_a, lora_b)):
        torch.ops.aiolm.lora_apply_(y, x, lora_a, lora_b, slot_ids, list(slice_starts))
    else:
        lora_reference(y, x, lora_a, lora_b, slot_ids, slice_starts)
