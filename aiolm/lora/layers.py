"""LoRA slots inside a model's linear layers, and the per-step mapping of rows to slots.

A model built with LoRA (``BuildContext.lora``) gives each projection an adapter may
target (aiolm/lora/adapter.py: q/k/v/o, gate/up/down) a ``LoRASlots``: ``max_loras``
slots of stacked A and B matrices, zero until the worker's manager (aiolm/lora/manager.py)
writes an adapter in. A forward pass reads the slot of each token's request from the one
``LoRAContext`` all layers share, and one kernel call per layer adds every row's own
adapter to the base output (aiolm/kernels/lora_reference.py says what it computes; the
platform chooses the kernel). A step with no adapter rows makes no call at all.

The slot ids are a buffer of fixed address, written in place each step, so a CUDA graph
captured with the kernels in it replays with the step's own mapping.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

LoRAKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Sequence[int]], None]


class LoRAContext:
    """What every LoRA layer of one model shares: the sizes, the kernel and the step's rows."""

    def __init__(self, max_loras: int, max_rank: int, kernel: LoRAKernel, max_tokens: int = 256) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.kernel = kernel
        self.slot_ids = torch.full((max_tokens,), -1, dtype=torch.int32)
        # whether any row of this step has an adapter: False skips every LoRA call; a CUDA
        # graph is captured with it True and reads slot_ids when it replays
        self.active = False
        self._used = 0  # slot_ids past this are -1 already

    def to(self, device: torch.device) -> None:
        self.slot_ids = self.slot_ids.to(device)

    def set_rows(self, slots: Sequence[int] | torch.Tensor) -> None:
        """The step's slot of each token (-1: the base model); entries after them read -1."""
        n = len(slots)
        if n > self.slot_ids.shape[0]:
            self.slot_ids = torch.full((max(n, 2 * self.slot_ids.shape[0]),), -1, dtype=torch.int32).to(
                self.slot_ids.device
            )
            self._used = 0
        src = torch.as_tensor(slots, dtype=torch.int32)
        self.slot_ids[:n].copy_(src)
        if self._used > n:
            self.slot_ids[n : self._used].fill_(-1)
        self._used = n
        self.active = bool((src >= 0).any())


class LoRASlots(nn.Module):
    """One layer's adapters: ``a`` [S, L*R, K] (slice i's A in rows i*R..i*R+R-1) and ``b``
    [S, N, R] (slice i's B in its output columns), for this rank's share of the layer."""

    def __init__(self, ctx: LoRAContext, in_features: int, slice_sizes: Sequence[int], names: Sequence[str]) -> None:
        """``names``: the Hugging Face module of each slice (``model.layers.0.self_attn.q_proj``)."""
        super().__init__()
        self.ctx = ctx
        self.names = tuple(names)
        s, r = ctx.max_loras, ctx.max_rank
        starts = [0]
        for n in slice_sizes:
            starts.append(starts[-1] + n)
        self.slice_starts = tuple(starts)
        self.register_buffer("a", torch.zeros(s, len(slice_sizes) * r, in_features), persistent=False)
        self.register_buffer("b", torch.zeros(s, starts[-1], r), persistent=False)

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """y += each row's adapter applied to x, in place (y [T, N], x [T, K])."""
        self.ctx.kernel(y, x.reshape(-1, x.shape[-1]), self.a, self.b, self.ctx.slot_ids, self.slice_starts)

    def write(self, slot: int, pairs: Sequence[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Slot ``slot`` takes one (A [r, K], scaled B [n_i, r]) pair per slice, None for a
        slice the adapter leaves alone; what it held before is zeroed."""
        r_max = self.ctx.max_rank
        self.a[slot].zero_()
        self.b[slot].zero_()
        for i, pair in enumerate(pairs):
            if pair is None:
                continue
            a, b = pair
            r = a.shape[0]
            self.a[slot, i * r_max : i * r_max + r].copy_(a)
            self.b[slot, self.slice_starts[i] : self.slice_starts[i + 1], :r].copy_(b)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
