"""A layer of experts and its router, split over tensor-parallel ranks one of two ways.

Without expert parallelism every rank holds every expert with its intermediate features
sliced, as a column-parallel gate/up and a row-parallel down would be. With it
(``--enable-expert-parallel``) each rank holds E/N whole experts and runs only the
routed tokens' pairs that land on them. Either way every rank sees the same x and the
same routing, its output is a partial sum, and one all-reduce combines the ranks.

The weights and the one call that runs the routed experts belong to the layer's experts
method (aiolm/quant/base.py ``ExpertsMethod``), which the build context's quant config
chooses, as a linear layer's method is chosen.
"""

from __future__ import annotations

import torch
from torch import nn

from aiolm.errors import ModelLoadError
from aiolm.model.layers.context import BuildContext
from aiolm.quant.base import ExpertsMethod, ExpertsSpec

# The checkpoint's names for an expert's three projections (Qwen's, Mixtral's) -> the part each fills
EXPERT_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


class Router(nn.Module):
    """Top-k routing as transformers does it for these families: logits in float32, a
    softmax over all experts, the k largest, divided by their sum where ``renormalize``."""

    def __init__(self, num_experts: int, hidden: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden), requires_grad=False)
        self.top_k, self.renormalize = top_k, renormalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 weights [T, k], int64 expert ids [T, k])."""
        logits = nn.functional.linear(x.float(), self.weight.float())
        probs = torch.softmax(logits, dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids


class FusedMoE(nn.Module):
    """E experts of SiLU-gated MLPs (hidden -> intermediate -> hidden), this rank's part."""

    def __init__(self, ctx: BuildContext, num_experts: int, hidden: int, intermediate: int, prefix: str = "") -> None:
        super().__init__()
        tp = ctx.tp_group
        self.tp, self.prefix = tp, prefix
        self.num_experts = num_experts
        self.expert_parallel = ctx.expert_parallel and tp.world_size > 1
        if self.expert_parallel:
            if num_experts % tp.world_size:
                raise ValueError(
                    f"--enable-expert-parallel: {num_experts} experts cannot be split evenly over {tp.world_size} ranks"
                )
            self.local_experts, self.local_intermediate = num_experts // tp.world_size, intermediate
        else:
            if intermediate % tp.world_size:
                raise ValueError(
                    f"expert intermediate size {intermediate} not divisible by tensor parallel size {tp.world_size}"
                )
            self.local_experts, self.local_intermediate = num_experts, intermediate // tp.world_size
        self.expert_start = tp.rank * self.local_experts if self.expert_parallel else 0
        self.hidden, self.intermediate = hidden, intermediate
        self.quant_method: ExpertsMethod = ctx.quant.experts_method(ExpertsSpec(prefix, num_experts, self.expert_start))
        self.quant_method.create_weights(self, self.local_experts, hidden, self.local_intermediate)
        # Tokens routed to each expert since the last read (all ranks route alike, so each
        # counts every expert): what a load balancer places experts by
        self.register_buffer("expert_counts", torch.zeros(num_experts, dtype=torch.int64), persistent=False)

    def is_local(self, expert: int) -> bool:
        return self.expert_start <= expert < self.expert_start + self.local_experts

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """float32 [T, H], all ranks' experts summed."""
        flat = topk_ids.reshape(-1)
        self.expert_counts.scatter_add_(0, flat, torch.ones_like(flat))  # no host sync: CUDA graphs capture it
        if self.expert_parallel:
            local = topk_ids - self.expert_start
            topk_ids = torch.where((local >= 0) & (local < self.local_experts), local, -1)
        return self.tp.all_reduce(self.quant_method.apply(self, x, topk_weights, topk_ids))

    def load_expert(self, name: str, expert: int, part: str, loaded: torch.Tensor) -> bool:
        """Copy this rank's part of checkpoint tensor ``name`` (expert ``expert``'s gate, up or
        down projection); False where the expert lives on another rank."""
        if not 0 <= expert < self.num_experts:
            raise ModelLoadError(f"{name}: expert {expert} of a layer of {self.num_experts} experts")
        want = (self.hidden, self.intermediate) if part == "down" else (self.intermediate, self.hidden)
        if tuple(loaded.shape) != want:
            raise ModelLoadError(f"{name}: shape {tuple(loaded.shape)}, expected {want}")
        if not self.is_local(expert):
            return False
        e, n = expert - self.expert_start, self.local_intermediate
        r = 0 if self.expert_parallel else self.tp.rank
        if part == "down":
            self.w2.data[e].copy_(loaded[:, r * n : (r + 1) * n])
        else:
            at = 0 if part == "gate" else n
            self.w13.data[e, at : at + n].copy_(loaded[r * n : (r + 1) * n])
        return True

    def take_expert_counts(self) -> torch.Tensor:
        """The per-expert token counts since the last call, and a fresh start."""
        counts = self.expert_counts.cpu().clone()  # .cpu() of a CPU tensor is the tensor itself
        self.expert_counts.zero_()
        return counts
