"""Mixture-of-experts decoders (Qwen3-MoE, Qwen2-MoE, Mixtral): Llama-family attention, and
in the sparse layers a router and a layer of experts in place of the MLP.

The families differ only in what checkpoint/moe.py reads: which layers are sparse, whether
the top-k weights are renormalised, QK-norm, QKV bias, and Qwen2-MoE's shared expert
behind a sigmoid gate. Mixtral's checkpoint names (``block_sparse_moe``, ``w1``/``w3``/``w2``)
are read as the Qwen ones.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from aiolm.checkpoint.moe import MoEConfig
from aiolm.errors import ModelLoadError
from aiolm.model.layers.context import BuildContext
from aiolm.model.layers.fused_moe import EXPERT_PARTS, FusedMoE, Router
from aiolm.model.llama import MLP, LlamaForCausalLM

_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight$")
_QWEN_NAMES = "model.layers.{i}.mlp.experts.{e}.{proj}.weight"
_MIXTRAL_NAMES = "model.layers.{i}.block_sparse_moe.experts.{e}.{proj}.weight"
_PROJ = {  # by "Mixtral's names": our part -> the checkpoint's projection
    False: {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
    True: {"gate": "w1", "up": "w3", "down": "w2"},
}


class SparseMoeBlock(nn.Module):
    """Router, experts, and (Qwen2-MoE) the shared expert every token also takes."""

    def __init__(self, cfg: MoEConfig, ctx: BuildContext, prefix: str) -> None:
        super().__init__()
        self.gate = Router(cfg.num_experts, cfg.hidden_size, cfg.top_k, cfg.norm_topk_prob)
        self.experts = FusedMoE(
            ctx, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, prefix=f"{prefix}.experts"
        )
        self.shared_expert: MLP | None = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(
                cfg, ctx, prefix=f"{prefix}.shared_expert", intermediate=cfg.shared_expert_intermediate_size
            )
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        y = self.experts(x, weights, ids).to(x.dtype)
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y


class MoEForCausalLM(LlamaForCausalLM):
    config: MoEConfig

    def make_mlp(self, cfg: Any, ctx: BuildContext, layer: int, prefix: str) -> nn.Module | None:
        return SparseMoeBlock(cfg, ctx, prefix) if cfg.is_sparse(layer) else None

    def moe_layers(self) -> list[FusedMoE]:
        return [m for m in self.modules() if isinstance(m, FusedMoE)]

    def take_expert_counts(self) -> torch.Tensor:
        """Tokens routed to each expert of each sparse layer since the last call: int64
        [sparse layers, experts]."""
        layers = self.moe_layers()
        if not layers:
            return torch.zeros(0, 0, dtype=torch.int64)
        return torch.stack([m.take_expert_counts() for m in layers])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The dense tensors as a Llama's; each expert's projections into its layer's
        experts (this rank's part), every expected one checked present."""
        got: set[tuple[int, int, str]] = set()
        layers = self.layers

        def dense() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                hf = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's names
                m = _EXPERT.match(hf)
                if m is None:
                    yield hf, tensor
                    continue
                i, e, proj = int(m.group(1)), int(m.group(2)), m.group(3)
                if i < len(layers) and i not in self.local_layers:
                    continue  # another pipeline stage's
                mlp = layers[i].mlp if i < len(layers) else None
                if not isinstance(mlp, SparseMoeBlock) or proj not in EXPERT_PARTS:
                    raise ModelLoadError(f"weight {name!r} does not belong to any {self.config.architecture} parameter")
                mlp.experts.load_expert(name, e, EXPERT_PARTS[proj], tensor)
                got.add((i, e, EXPERT_PARTS[proj]))

        super().load_weights(dense())
        mixtral = self.config.architecture == "mixtral"
        names = _MIXTRAL_NAMES if mixtral else _QWEN_NAMES
        missing = [
            names.format(i=i, e=e, proj=proj)
            for i in self.local_layers
            if isinstance((layer := layers[i]).mlp, SparseMoeBlock)
            for e in range(layer.mlp.experts.num_experts)
            for part, proj in _PROJ[mixtral].items()
            if (i, e, part) not in got
        ]
        if missing:
            raise ModelLoadError(f"checkpoint is missing {len(missing)} expert weights, e.g. {missing[:3]}")

    def expected_mlp_weights(self, layer: int, prefix: str) -> set[str]:
        mlp = self.layers[layer].mlp
        if not isinstance(mlp, SparseMoeBlock):
            return super().expected_mlp_weights(layer, prefix)
        want = {f"{prefix}.gate.weight#0"}
        if mlp.shared_expert is not None:
            want |= super().expected_mlp_weights(layer, f"{prefix}.shared_expert")
            want.add(f"{prefix}.shared_expert_gate.weight#0")
        return want
