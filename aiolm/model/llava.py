"""LLaVA (``LlavaForConditionalGeneration``): a CLIP vision tower and a two-layer projector
beside a Llama-family language model.

The language model is llama.py's, unchanged: an image reaches it as embeddings that take
the place of its placeholder tokens' (``forward``'s ``mm_embeds``, which the model runner
fills from its encoder cache). ``embed_images`` runs the tower up to the configured feature
layer, drops the class row unless the config keeps it, and projects each patch row into
the language model's hidden size: one embedding per placeholder token.

Checkpoint names: transformers 5 writes ``model.language_model.*``,
``model.vision_tower.vision_model.*``, ``model.multi_modal_projector.*`` and ``lm_head.*``;
older folders ``language_model.model.*``, ``language_model.lm_head.*``, ``vision_tower.*``
and ``multi_modal_projector.*``. Both load.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from aiolm.checkpoint.vision import LlavaConfig
from aiolm.model.layers.activation import ACTIVATIONS
from aiolm.model.layers.context import BuildContext
from aiolm.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from aiolm.model.layers.vision import CLIPVisionTower, load_tower_weight, missing_tower_weights, text_weights
from aiolm.model.llama import LlamaForCausalLM


class LlavaProjector(nn.Module):
    def __init__(self, cfg: LlavaConfig, ctx: BuildContext) -> None:
        super().__init__()
        assert cfg.vision is not None
        bias = cfg.projector_bias
        self.linear_1 = ColumnParallelLinear(
            ctx, cfg.vision.hidden_size, [cfg.hidden_size], bias=bias, names=("multi_modal_projector.linear_1",)
        )
        self.linear_2 = RowParallelLinear(
            ctx, cfg.hidden_size, cfg.hidden_size, bias=bias, names=("multi_modal_projector.linear_2",)
        )
        self.act = ACTIVATIONS[cfg.projector_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(LlamaForCausalLM):
    config: LlavaConfig

    def __init__(self, cfg: LlavaConfig, ctx: BuildContext, max_positions: int | None = None) -> None:
        super().__init__(cfg, ctx, max_positions)
        assert cfg.vision is not None
        self.vision_tower = CLIPVisionTower(cfg.vision, ctx, cfg.tower_layers, "vision_tower")
        self.multi_modal_projector = LlavaProjector(cfg, ctx)

    @torch.inference_mode()
    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, channels, height, width] -> [images, image_tokens, hidden]: each
        image's embeddings, one per placeholder token, in the language model's dtype."""
        features = self.vision_tower(pixel_values)
        if not self.config.keep_cls:
            features = features[:, 1:]
        n, rows, width = features.shape
        out = self.multi_modal_projector(features.reshape(n * rows, width))
        return out.reshape(n, rows, -1).to(self.embed_tokens.weight.dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The language model's tensors through llama.py's loading; the tower's and the
        projector's here (tower layers past the feature layer are skipped)."""
        mine: list[tuple[str, torch.Tensor]] = []
        super().load_weights(text_weights(weights, mine))
        seen: set[str] = set()
        projector = dict(self.multi_modal_projector.named_modules())
        for name, tensor in mine:
            if name.startswith("multi_modal_projector."):
                mod_path, _, pname = name.removeprefix("multi_modal_projector.").rpartition(".")
                projector[mod_path].load_shard(pname, tensor, 0)
                seen.add(name)
            else:
                got = load_tower_weight(self.vision_tower, name.removeprefix("vision_tower."), tensor)
                if got is not None:
                    seen.add(got)
        missing = missing_tower_weights(self.vision_tower, seen)
        missing += [
            f"multi_modal_projector.{n}"
            for n, _ in self.multi_modal_projector.named_parameters()
            if f"multi_modal_projector.{n}" not in seen
        ]
        if missing:
            raise KeyError(f"checkpoint is missing {len(missing)} vision weights, e.g. {missing[:3]}")
