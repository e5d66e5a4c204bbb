"""Gemma 3 with its vision tower (``Gemma3ForConditionalGeneration``): a SigLIP tower and a
projector beside gemma3.py's decoder.

``embed_images`` runs the tower, average-pools each image's patch grid down to
``mm_tokens_per_image`` rows, normalises them (Gemma's RMSNorm, times 1 + w) and projects
them into the text model's hidden size: one embedding per image soft token. They replace
those tokens' embeddings after the text embeddings' sqrt(hidden) scaling, as transformers
places them. The soft tokens of one image attend to each other both ways: ``forward``
marks each image's rows in the metadata and the attention layers redo those rows
(attention/image_spans.py); the scheduler keeps an image's soft tokens in one step.

Checkpoint names are read as for LLaVA (``text_weights`` in model/layers/vision.py):
transformers 5's ``model.language_model.*``, ``model.vision_tower.vision_model.*``,
``model.multi_modal_projector.*``, or the older top-level ``language_model.model.*`` and
``vision_tower.*`` forms.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from aiolm.attention.metadata import AttentionMetadata
from aiolm.checkpoint.vision import Gemma3VisionConfig
from aiolm.model.gemma3 import Gemma3ForCausalLM
from aiolm.model.layers.context import BuildContext
from aiolm.model.layers.vision import SiglipVisionTower, load_tower_weight, missing_tower_weights, text_weights
from aiolm.model.layers.weights import copy_weight


class Gemma3Projector(nn.Module):
    def __init__(self, cfg: Gemma3VisionConfig) -> None:
        super().__init__()
        assert cfg.vision is not None
        v = cfg.vision
        self.grid = v.image_size // v.patch_size
        self.kernel = self.grid // round(cfg.image_tokens**0.5)
        self.eps = v.layer_norm_eps
        self.mm_soft_emb_norm = nn.Parameter(torch.zeros(v.hidden_size), requires_grad=False)
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(v.hidden_size, cfg.hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[images, patches, vision hidden] -> [images, image_tokens, text hidden]."""
        n, _, h = x.shape
        grid = x.transpose(1, 2).reshape(n, h, self.grid, self.grid)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        f = pooled.float()
        normed = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.mm_soft_emb_norm.float())
        return torch.matmul(normed.to(x.dtype), self.mm_input_projection_weight).to(x.dtype)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    config: Gemma3VisionConfig

    def __init__(self, cfg: Gemma3VisionConfig, ctx: BuildContext, max_positions: int | None = None) -> None:
        super().__init__(cfg, ctx, max_positions)
        assert cfg.vision is not None
        self.vision_tower = SiglipVisionTower(cfg.vision, ctx, "vision_tower")
        self.multi_modal_projector = Gemma3Projector(cfg)

    @torch.inference_mode()
    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, channels, height, width] -> [images, image_tokens, hidden]."""
        out = self.multi_modal_projector(self.vision_tower(pixel_values))
        return out.to(self.embed_tokens.weight.dtype)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """gemma3.py's forward, each image's rows marked to attend to each other both ways."""
        if mm_embeds is not None:
            meta = dataclasses.replace(meta, image_spans=_spans(mm_embeds[0].tolist(), meta.query_start_loc.tolist()))
        return super().forward(input_ids, positions, kv_caches, meta, mm_embeds)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The text model's tensors through gemma3.py's loading; the tower's and the
        projector's here."""
        mine: list[tuple[str, torch.Tensor]] = []
        super().load_weights(text_weights(weights, mine))
        seen: set[str] = set()
        for name, tensor in mine:
            if name.startswith("multi_modal_projector."):
                leaf = name.removeprefix("multi_modal_projector.").removesuffix(".weight")
                param = getattr(self.multi_modal_projector, leaf, None)
                if param is None:
                    raise KeyError(f"weight {name!r} does not belong to Gemma 3's projector")
                copy_weight(param.data, tensor[...], name)
                seen.add(leaf)
            else:
                got = load_tower_weight(self.vision_tower, name.removeprefix("vision_tower."), tensor)
                if got is not None:
                    seen.add(got)
        missing = missing_tower_weights(self.vision_tower, seen)
        missing += [n for n, _ in self.multi_modal_projector.named_parameters() if n not in seen]
        if missing:
            raise KeyError(f"checkpoint is missing {len(missing)} vision weights, e.g. {missing[:3]}")

    def _check_complete(self, seen: set[str]) -> None:
        """The text model's parameters only: the tower's are checked by load_weights."""
        text = {f"{n}#0" for n, _ in self.named_parameters() if n.startswith(("vision_tower.", "multi_modal_"))}
        super()._check_complete(seen | text)


def _spans(rows: list[int], starts: list[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive ``rows`` within one request (each image's soft tokens; two images
    are never adjacent: their end and start markers sit between them), with its index."""
    spans: list[tuple[int, int, int]] = []
    seq = 0
    i = 0
    while i < len(rows):
        while starts[seq + 1] <= rows[i]:
            seq += 1
        j = i
        while j + 1 < len(rows) and rows[j + 1] == rows[j] + 1 and rows[j + 1] < starts[seq + 1]:
            j += 1
        spans.append((rows[i], rows[j] + 1, seq))
        i = j + 1
    return spans
