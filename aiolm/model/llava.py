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

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from aiolm.checkpoint.vision import LlavaConfig
from aiolm.model.layers.context import BuildContext
from aiolm.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from aiolm.model.layers.vision import ACTIVATIONS, CLIPVisionTower
from aiolm.model.llama import LlamaForCausalLM

# checkpoint prefixes -> ours; the first that matches wins (transformers 5's, then older)
_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)
# the tower's embedding tensors -> our parameter names
_EMBEDDINGS = {
    "embeddings.patch_embedding.weight": "patch_embedding",
    "embeddings.class_embedding": "class_embedding",
    "embeddings.position_embedding.weight": "position_embedding",
}
_FUSED_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}


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

        def text() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = _rename(name)
                if name.startswith(("vision_tower.", "multi_modal_projector.")):
                    mine.append((name, tensor))
                else:
                    yield name, tensor

        super().load_weights(text())
        seen = {self._load_vision(name, tensor) for name, tensor in mine} - {None}
        want = {n for n, _ in self.vision_tower.named_parameters(prefix="vision_tower")}
        want |= {n for n, _ in self.multi_modal_projector.named_parameters(prefix="multi_modal_projector")}
        missing = sorted(want - {s.split("#")[0] for s in seen if s is not None})
        if missing:
            raise KeyError(f"checkpoint is missing {len(missing)} vision weights, e.g. {missing[:3]}")

    def _load_vision(self, name: str, tensor: torch.Tensor) -> str | None:
        """Load one tower or projector tensor; returns our parameter's name (None: unused)."""
        modules = dict(self.named_modules())
        if name.startswith("multi_modal_projector."):
            mod_path, _, pname = name.rpartition(".")
            modules[mod_path].load_shard(pname, tensor, 0)
            return name
        key = name.removeprefix("vision_tower.")
        if key in _EMBEDDINGS:
            param = getattr(self.vision_tower, _EMBEDDINGS[key])
            param.data.copy_(tensor[...].reshape(param.shape))
            return f"vision_tower.{_EMBEDDINGS[key]}"
        if key.startswith("pre_layrnorm."):
            getattr(self.vision_tower.pre_layrnorm, key.split(".")[-1]).data.copy_(tensor[...])
            return f"vision_tower.{key}"
        if not key.startswith("encoder.layers."):
            return None  # post_layernorm, position_ids: past the feature layer or buffers
        idx, _, rest = key.removeprefix("encoder.layers.").partition(".")
        if int(idx) >= len(self.vision_tower.layers):
            return None
        layer = self.vision_tower.layers[int(idx)]
        part, _, pname = rest.rpartition(".")
        leaf = part.rsplit(".", 1)[-1]
        if leaf in _FUSED_QKV:
            layer.qkv_proj.load_shard(pname, tensor, _FUSED_QKV[leaf])
            return f"vision_tower.layers.{idx}.qkv_proj.{pname}#{_FUSED_QKV[leaf]}"
        target = {"self_attn.out_proj": layer.out_proj, "mlp.fc1": layer.fc1, "mlp.fc2": layer.fc2}.get(part)
        if target is not None:
            target.load_shard(pname, tensor, 0)
        else:
            getattr(getattr(layer, part), pname).data.copy_(tensor[...])
        return f"vision_tower.layers.{idx}.{part.replace('self_attn.', '').replace('mlp.', '')}.{pname}"


def _rename(name: str) -> str:
    for old, new in _PREFIXES:
        if name.startswith(old):
            return new + name.removeprefix(old)
    return name
