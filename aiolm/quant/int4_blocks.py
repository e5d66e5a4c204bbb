"""A 4-bit checkpoint's (GPTQ, AWQ, compressed-tensors W4A16) codes kept as blocks for the CPU's
small steps, beside the float32 weights dequantized from them.

The same arrangement as a GGUF file's blocks (aiolm/quant/gguf_blocks.py, whose methods and
fused decode step this reuses): the loader gives every layer its dense weight, s * (q - z),
which the inner method packs for prompts and large batches; steps of a few rows read the
codes instead, 4 bits a weight with a float32 scale and min per block of 32 (d = s, m = -s * z,
both exact), through aiolm::gguf_linear. Their answers are the dense weights' up to the order
of the sums.

A group of the checkpoint spans whole blocks of 32 (group sizes are multiples of 32). With
activation order (GPTQ ``desc_act``, compressed-tensors ``actorder: group``) a group's input
features are scattered: the blocks hold them sorted by group, and x is gathered into that
order first (``PermutedBlocks``), which the fused decode step does not do, so such layers run
their modules.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from aiolm.checkpoint.quantization import WeightQuant
from aiolm.quant.base import ExpertsSpec, QuantConfig
from aiolm.quant.checkpoint_formats import CheckpointReader, Int4Codes, input_order
from aiolm.quant.gguf_blocks import MAX_ROWS, GGUFBlocksConfig, GGUFExperts, GGUFWeight

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PermutedBlocks:
    """Blocks over the input features in the order ``perm``: x[:, perm] times them."""

    weight: GGUFWeight
    perm: torch.Tensor  # int64 [K]

    @property
    def n(self) -> int:
        return self.weight.n

    @property
    def int8_rows(self) -> int:
        return self.weight.int8_rows

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.weight.linear(x.index_select(-1, self.perm), bias)

    def linear_int8(self, x: torch.Tensor, bias: torch.Tensor | None = None, isa: int = -1) -> torch.Tensor:
        return self.weight.linear_int8(x.index_select(-1, self.perm), bias, isa)


def codes_as_blocks(parts: list[Int4Codes]) -> GGUFWeight | PermutedBlocks | None:
    """The fused layer whose tensors are ``parts`` (stacked along the outputs) as blocks; None
    where its groups do not fall on whole blocks of 32 or its tensors order their inputs apart."""
    perm = input_order(parts)
    if perm is None:
        return None
    k = perm.numel()
    block_group = parts[0].group[perm].view(-1, 32)
    if not bool((block_group == block_group[:, :1]).all()):
        return None  # a block of 32 would span two groups
    g = block_group[:, 0]
    codes = torch.cat([p.codes for p in parts])[:, perm]
    d = torch.cat([p.scale[:, g] for p in parts])
    m = -torch.cat([p.scale[:, g] * p.zero[:, g] for p in parts])
    weight = GGUFWeight.from_codes(codes, d, m)
    identity = bool((perm == torch.arange(k)).all())
    return weight if identity else PermutedBlocks(weight, perm)


class Int4BlocksConfig(GGUFBlocksConfig):
    """The 4-bit codes of the checkpoint at ``path`` (a folder of ``quant``'s format) beside
    ``inner``'s methods, which take the steps above the blocks' limits."""

    name = "int4_blocks"

    def __init__(
        self,
        path: Path,
        model_config: Any,
        inner: QuantConfig,
        quant: WeightQuant,
        matmul_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(path, model_config, inner, matmul_dtype)
        self.reader = CheckpointReader(path, quant)

    def blocks(self, names: list[str]) -> GGUFWeight | PermutedBlocks | None:  # type: ignore[override]
        parts = [self.reader.int4(n.removesuffix(".weight")) for n in names]
        if any(p is None for p in parts):
            return None
        got = codes_as_blocks(parts)  # type: ignore[arg-type]
        self.layers += got is not None
        return got

    def expert_blocks(self, spec: ExpertsSpec, local_experts: int) -> GGUFExperts | None:
        return None  # a quantized checkpoint's experts run dequantized

    def release(self) -> None:
        self.reader.release()
        log.info(
            "%d layers also keep the checkpoint's 4-bit codes for steps of up to %d rows; "
            "%d decoder layers run such steps as one call",
            self.layers,
            MAX_ROWS,
            self.fused,
        )
        self.inner.release()
