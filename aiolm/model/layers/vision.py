"""A ViT vision tower (CLIP's) over a batch of images, as transformers computes it.

Patches are embedded by a strided convolution (as a matmul over unfolded patches), a
class row and absolute position embeddings are added, then pre-norm encoder layers run
bidirectional attention within each image through the attention backend's
``forward_encoder`` (each image is one "sequence" of the flat batch). The linear layers
are the tensor-parallel layers the decoders use, so the platform's matmuls and a
tensor-parallel split apply here as there; norms and embeddings are replicated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from aiolm.attention.metadata import AttentionMetadata
from aiolm.checkpoint.vision import VisionConfig
from aiolm.model.layers.context import BuildContext
from aiolm.model.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from aiolm.model.layers.norm import LayerNorm
from aiolm.model.layers.weights import copy_weight


class VisionEncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig, ctx: BuildContext, prefix: str) -> None:
        # Adapters target the language model only, as vLLM's do: a tower layer with LoRA slots
        # ran with the text step's adapter rows, and failed on more image rows than they hold.
        ctx = dataclasses.replace(ctx, lora=None)
        super().__init__()
        tp = ctx.tp_group.world_size
        if cfg.num_heads % tp:
            raise ValueError(f"vision num_attention_heads {cfg.num_heads} not divisible by tensor parallel size {tp}")
        self.num_heads = cfg.num_heads // tp
        self.head_dim = cfg.hidden_size // cfg.num_heads
        h = cfg.hidden_size
        self.layer_norm1 = LayerNorm(h, cfg.layer_norm_eps)
        self.qkv_proj = QKVParallelLinear(
            ctx,
            h,
            self.head_dim,
            cfg.num_heads,
            cfg.num_heads,
            bias=True,
            names=tuple(f"{prefix}.self_attn.{x}_proj" for x in "qkv"),
            output_to_kernel=True,  # no RoPE: q, k, v go straight to the attention
        )
        self.out_proj = RowParallelLinear(ctx, h, h, bias=True, names=(f"{prefix}.self_attn.out_proj",))
        self.layer_norm2 = LayerNorm(h, cfg.layer_norm_eps)
        self.fc1 = ColumnParallelLinear(ctx, h, [cfg.intermediate_size], bias=True, names=(f"{prefix}.mlp.fc1",))
        self.fc2 = RowParallelLinear(ctx, cfg.intermediate_size, h, bias=True, names=(f"{prefix}.mlp.fc2",))
        self.act = cfg.hidden_act  # a name of layers/activation.py, checked by checkpoint/vision.py
        self.attn = ctx.attention_backend(self.num_heads, self.num_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t, size = x.shape[0], self.num_heads * self.head_dim
        q, k, v = self.qkv_proj(self.layer_norm1(x)).split([size, size, size], dim=-1)
        shape = (t, self.num_heads, self.head_dim)
        a = self.attn.forward_encoder(q.reshape(shape), k.reshape(shape), v.reshape(shape), meta)
        # a matmul's output may come in a lower precision: the residual stream stays in
        # x's dtype (the adds promote)
        x = x + self.out_proj(a)
        return x + self.fc2(self.fc1(self.layer_norm2(x), activation=self.act))


class CLIPVisionTower(nn.Module):
    """CLIP's vision transformer up to layer ``num_layers`` (hidden_states[num_layers] in
    transformers' terms): [images, 1 + patches, hidden], the class row first."""

    def __init__(self, cfg: VisionConfig, ctx: BuildContext, num_layers: int, prefix: str) -> None:
        super().__init__()
        self.cfg = cfg
        h, p = cfg.hidden_size, cfg.patch_size
        self.patch_embedding = nn.Parameter(torch.zeros(h, cfg.num_channels, p, p), requires_grad=False)
        self.class_embedding = nn.Parameter(torch.zeros(h), requires_grad=False)
        self.position_embedding = nn.Parameter(torch.zeros(cfg.num_patches + 1, h), requires_grad=False)
        self.pre_layrnorm = LayerNorm(h, cfg.layer_norm_eps)
        self.layers = nn.ModuleList(
            VisionEncoderLayer(cfg, ctx, f"{prefix}.encoder.layers.{i}") for i in range(num_layers)
        )

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        n, _, size, width = pixel_values.shape
        cfg = self.cfg
        if size != cfg.image_size or width != cfg.image_size:
            raise ValueError(f"images of {size}x{width} pixels; this tower takes {cfg.image_size}x{cfg.image_size}")
        w = self.patch_embedding
        patches = F.conv2d(pixel_values.to(w.dtype), w, stride=cfg.patch_size).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_embedding.expand(n, 1, -1), patches], dim=1) + self.position_embedding
        x = self.pre_layrnorm(x)
        rows = x.shape[1]
        flat = x.reshape(n * rows, -1)
        meta = _images_meta(n, rows, flat.device)
        for layer in self.layers:
            flat = layer(flat, meta)
        return flat.reshape(n, rows, -1)


class SiglipVisionTower(nn.Module):
    """SigLIP's vision transformer (no class row, no pre-norm; a biased patch embedding and
    the final LayerNorm): [images, patches, hidden], its ``last_hidden_state``."""

    def __init__(self, cfg: VisionConfig, ctx: BuildContext, prefix: str) -> None:
        super().__init__()
        self.cfg = cfg
        h, p = cfg.hidden_size, cfg.patch_size
        self.patch_embedding = nn.Parameter(torch.zeros(h, cfg.num_channels, p, p), requires_grad=False)
        self.patch_bias = nn.Parameter(torch.zeros(h), requires_grad=False)
        self.position_embedding = nn.Parameter(torch.zeros(cfg.num_patches, h), requires_grad=False)
        self.layers = nn.ModuleList(
            VisionEncoderLayer(cfg, ctx, f"{prefix}.encoder.layers.{i}") for i in range(cfg.num_layers)
        )
        self.post_layernorm = LayerNorm(h, cfg.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        n, _, size, width = pixel_values.shape
        cfg = self.cfg
        if size != cfg.image_size or width != cfg.image_size:
            raise ValueError(f"images of {size}x{width} pixels; this tower takes {cfg.image_size}x{cfg.image_size}")
        w = self.patch_embedding
        x = F.conv2d(pixel_values.to(w.dtype), w, self.patch_bias, stride=cfg.patch_size).flatten(2).transpose(1, 2)
        x = x + self.position_embedding
        rows = x.shape[1]
        flat = x.reshape(n * rows, -1)
        meta = _images_meta(n, rows, flat.device)
        for layer in self.layers:
            flat = layer(flat, meta)
        return self.post_layernorm(flat).reshape(n, rows, -1)


def load_tower_weight(tower: nn.Module, key: str, tensor: torch.Tensor) -> str | None:
    """One checkpoint tensor of a CLIP or SigLIP tower (its name past the tower's prefix,
    e.g. ``encoder.layers.0.self_attn.q_proj.weight``) into ``tower``; returns our parameter's
    name, or None for a tensor the tower does not use (layers past the feature layer, a
    position-ids buffer, CLIP's unused final norm)."""
    simple = {
        "embeddings.patch_embedding.weight": "patch_embedding",
        "embeddings.patch_embedding.bias": "patch_bias",
        "embeddings.class_embedding": "class_embedding",
        "embeddings.position_embedding.weight": "position_embedding",
    }
    if key in simple:
        param = getattr(tower, simple[key], None)
        if param is None:
            return None
        param.data.copy_(tensor[...].reshape(param.shape))
        return simple[key]
    norm, _, pname = key.rpartition(".")
    if norm in ("pre_layrnorm", "post_layernorm"):
        module = getattr(tower, norm, None)
        if module is None:
            return None
        copy_weight(getattr(module, pname).data, tensor[...], key)
        return key
    if not key.startswith("encoder.layers."):
        return None
    idx, _, rest = key.removeprefix("encoder.layers.").partition(".")
    if int(idx) >= len(tower.layers):
        return None
    layer = tower.layers[int(idx)]
    part, _, pname = rest.rpartition(".")
    leaf = part.rsplit(".", 1)[-1]
    if leaf in _FUSED_QKV:
        layer.qkv_proj.load_shard(pname, tensor, _FUSED_QKV[leaf])
        return f"layers.{idx}.qkv_proj.{pname}#{_FUSED_QKV[leaf]}"
    target = {"self_attn.out_proj": layer.out_proj, "mlp.fc1": layer.fc1, "mlp.fc2": layer.fc2}.get(part)
    if target is not None:
        target.load_shard(pname, tensor, 0)
    else:
        copy_weight(getattr(getattr(layer, part), pname).data, tensor[...], key)
    return f"layers.{idx}.{part.replace('self_attn.', '').replace('mlp.', '')}.{pname}"


def missing_tower_weights(tower: nn.Module, seen: set[str]) -> list[str]:
    """The tower's parameters that ``load_tower_weight`` never filled."""
    got = {s.split("#")[0] for s in seen}
    return sorted(n for n, _ in tower.named_parameters() if n not in got)


_FUSED_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}

# checkpoint prefixes -> ours; the first that matches wins (transformers 5's, then older)
_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)


def text_weights(
    weights: Iterable[tuple[str, torch.Tensor]], vision: list[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """A vision-language checkpoint's language-model tensors under a decoder's names, for its
    loading; the tower's and the projector's (``vision_tower.*``, ``multi_modal_projector.*``)
    are put in ``vision`` instead. Both layouts load: transformers 5's ``model.language_model.*``
    and ``model.vision_tower.vision_model.*``, and the older top-level names."""
    for name, tensor in weights:
        for old, new in _PREFIXES:
            if name.startswith(old):
                name = new + name.removeprefix(old)
                break
        if name.startswith(("vision_tower.", "multi_modal_projector.")):
            vision.append((name, tensor))
        else:
            yield name, tensor


def _images_meta(n: int, rows: int, device: torch.device) -> AttentionMetadata:
    """Metadata for ``n`` images of ``rows`` tokens each as encoder sequences: no KV cache,
    so no blocks and no slots."""
    lens = torch.full((n,), rows, dtype=torch.long, device=device)
    return AttentionMetadata(
        num_tokens=n * rows,
        query_start_loc=torch.arange(0, (n + 1) * rows, rows, dtype=torch.long, device=device),
        seq_lens=lens,
        block_table=torch.zeros(n, 1, dtype=torch.long, device=device),
        slot_mapping=torch.empty(0, dtype=torch.long, device=device),
        query_lens_cpu=[rows] * n,
        seq_lens_cpu=[rows] * n,
        block_size=16,
    )
