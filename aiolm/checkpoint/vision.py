"""Vision-language configs -> ModelConfig subclasses (the models: model/llava.py).

A vision-language checkpoint is a language model with a vision tower and a projector
beside it. Its ``ModelConfig`` fields describe the language model (the KV cache, the
scheduler and the sampler see only that); ``VisionConfig`` describes the tower, and the
subclass names how the tower's output reaches the text: which token stands for an
image's embeddings, which tower layer feeds the projector, and the projector's shape.
Torch-free: the engine process reads it to find the image token.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from aiolm.checkpoint import gemma3, llama
from aiolm.checkpoint.config import ModelConfig
from aiolm.errors import ModelLoadError

# the towers' activations, as transformers names them (model/layers/vision.py implements them)
VISION_ACTIVATIONS = ("quick_gelu", "gelu", "gelu_pytorch_tanh")
PROJECTOR_ACTIVATIONS = ("gelu", "gelu_pytorch_tanh", "relu", "silu")
# text_config.model_type -> the decoder family that reads it (checkpoint/llama.py)
_TEXT_FAMILIES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}

# transformers writes a nested config as its difference from the class's defaults (LLaVA-1.5's
# text_config holds six fields), so those defaults are read under what the file gives: these
# are the classes' (rope and head_dim defaults are the readers' own, the same as theirs).
_NESTED_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-6,
    ),
    "mistral": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-6,
        sliding_window=4096,
    ),
    "qwen2": dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
        num_attention_heads=32, max_position_embeddings=32768, rms_norm_eps=1e-6,
    ),
    "gemma3_text": dict(
        vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=131072, rms_norm_eps=1e-6,
    ),
    "clip_vision_model": dict(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
        image_size=224, patch_size=32,
    ),
    "siglip_vision_model": dict(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
        image_size=224, patch_size=16,
    ),
}  # fmt: skip
# LlavaConfig's tower where config.json has no vision_config: CLIP ViT-L/14 at 336 pixels.
_LLAVA_TOWER = dict(
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=24,
    num_attention_heads=16,
    image_size=336,
    patch_size=14,
)


def _nested(cfg: dict[str, Any], key: str, model_type: str) -> dict[str, Any]:
    """``cfg[key]`` with its class's defaults under it, as transformers reads a nested config."""
    sub = dict(cfg.get(key) or {})
    return {**_NESTED_DEFAULTS.get(sub.get("model_type", model_type), {}), **sub}


@dataclass(frozen=True)
class VisionConfig:
    """A ViT tower (CLIP's): patch embedding, absolute positions, pre-norm layers."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str, eps: float = 1e-5, act: str = "quick_gelu") -> VisionConfig:
        """``eps`` and ``act``: the tower family's defaults (CLIP's; SigLIP's differ)."""

        def need(key: str) -> Any:
            if key not in cfg:
                raise ModelLoadError(f"{source}: vision_config is missing {key!r}")
            return cfg[key]

        out = cls(
            hidden_size=int(need("hidden_size")),
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=int(need("num_attention_heads")),
            image_size=int(need("image_size")),
            patch_size=int(need("patch_size")),
            num_channels=int(cfg.get("num_channels", 3)),
            layer_norm_eps=float(cfg.get("layer_norm_eps", eps)),
            hidden_act=str(cfg.get("hidden_act", act)),
        )
        if out.hidden_act not in VISION_ACTIVATIONS:
            raise ModelLoadError(
                f"{source}: vision hidden_act {out.hidden_act!r} is not supported; "
                f"supported: {', '.join(VISION_ACTIVATIONS)}"
            )
        if out.hidden_size % out.num_heads:
            raise ModelLoadError(f"{source}: vision hidden_size is not a multiple of num_attention_heads")
        return out


@dataclass(frozen=True)
class LlavaConfig(ModelConfig):
    """A LLaVA checkpoint: the language model's fields, the tower, and how they meet."""

    vision: VisionConfig | None = None
    text_architecture: str = "llama"  # the decoder family of text_config
    image_token_id: int = -1  # the placeholder the processor repeats once per image embedding
    feature_layer: int = -2  # hidden_states index of the tower fed to the projector
    keep_cls: bool = False  # vision_feature_select_strategy "full": the CLS row is an image token too
    projector_act: str = "gelu"
    projector_bias: bool = True

    @property
    def tower_layers(self) -> int:
        """How many of the tower's layers run: hidden_states[i] is the output of layer i
        (0: the embeddings), so layers past the feature layer are never needed."""
        assert self.vision is not None
        n = self.vision.num_layers
        return self.feature_layer if self.feature_layer >= 0 else n + 1 + self.feature_layer

    @property
    def image_tokens(self) -> int:
        """Placeholder tokens (and embeddings) per image."""
        assert self.vision is not None
        return self.vision.num_patches + (1 if self.keep_cls else 0)


def llava_config_from_hf(cfg: dict[str, Any], architecture: str, source: str = "config.json") -> LlavaConfig:
    """``LlavaForConditionalGeneration``: a CLIP tower, a two-layer projector and a Llama,
    Mistral or Qwen2 language model, read as transformers reads them."""
    text = _nested(cfg, "text_config", "llama")
    text_type = text.get("model_type", "llama")
    family = _TEXT_FAMILIES.get(text_type)
    if family is None:
        raise ModelLoadError(
            f"{source}: LLaVA with a {text_type!r} language model is not supported; "
            f"supported: {', '.join(_TEXT_FAMILIES)}"
        )
    vision = _nested(cfg, "vision_config", "clip_vision_model") if cfg.get("vision_config") else dict(_LLAVA_TOWER)
    if vision.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise ModelLoadError(
            f"{source}: LLaVA with a {vision.get('model_type')!r} vision tower is not supported; "
            "supported: clip_vision_model"
        )
    layer = cfg.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise ModelLoadError(f"{source}: vision_feature_layer {layer!r} (several layers) is not supported")
    strategy = cfg.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ModelLoadError(f"{source}: vision_feature_select_strategy {strategy!r} is not supported")
    act = cfg.get("projector_hidden_act", "gelu")
    if act not in PROJECTOR_ACTIVATIONS:
        raise ModelLoadError(
            f"{source}: projector_hidden_act {act!r} is not supported; supported: {', '.join(PROJECTOR_ACTIVATIONS)}"
        )
    image_token = cfg.get("image_token_id", cfg.get("image_token_index"))
    if not isinstance(image_token, int):
        raise ModelLoadError(f"{source}: missing image_token_id")
    if "tie_word_embeddings" in cfg and "tie_word_embeddings" not in text:
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    base = llama.config_from_hf(text, family, f"{source} text_config")
    tower = VisionConfig.from_hf(vision, f"{source} vision_config")
    n = tower.num_layers
    if not -n - 1 <= layer <= n:
        raise ModelLoadError(f"{source}: vision_feature_layer {layer} is outside the tower's {n} layers")
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    fields["architecture"] = architecture
    return LlavaConfig(
        **fields,
        vision=tower,
        text_architecture=family,
        image_token_id=image_token,
        feature_layer=layer,
        keep_cls=strategy == "full",
        projector_act=act,
        projector_bias=bool(cfg.get("multimodal_projector_bias", True)),
    )


@dataclass(frozen=True)
class Gemma3VisionConfig(gemma3.Gemma3Config):
    """Gemma 3 with its SigLIP tower: the text model's fields, the tower, and the projector's
    pooling of the tower's patch grid down to ``image_tokens`` embeddings per image. Its
    image tokens attend to each other both ways, so an image's placeholders run in one step
    (the scheduler keeps them whole)."""

    bidirectional_images: ClassVar[bool] = True

    vision: VisionConfig | None = None
    image_token_id: int = -1
    image_tokens: int = 256  # mm_tokens_per_image: a square that divides the patch grid


def gemma3_vision_config_from_hf(
    cfg: dict[str, Any], architecture: str, source: str = "config.json"
) -> Gemma3VisionConfig:
    """``Gemma3ForConditionalGeneration``: Gemma 3's text config and a SigLIP tower."""
    text = _nested(cfg, "text_config", "gemma3_text")
    if "tie_word_embeddings" in cfg and "tie_word_embeddings" not in text:
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    vision = _nested(cfg, "vision_config", "siglip_vision_model")
    if vision.get("model_type", "siglip_vision_model") != "siglip_vision_model":
        raise ModelLoadError(f"{source}: Gemma 3 with a {vision.get('model_type')!r} vision tower is not supported")
    tower = VisionConfig.from_hf(vision, f"{source} vision_config", eps=1e-6, act="gelu_pytorch_tanh")
    tokens = int(cfg.get("mm_tokens_per_image", 256))
    side, grid = round(tokens**0.5), tower.image_size // tower.patch_size
    if side * side != tokens or grid % side:
        raise ModelLoadError(
            f"{source}: mm_tokens_per_image {tokens} is not a square whose side divides the {grid}x{grid} patch grid"
        )
    image_token = cfg.get("image_token_id", cfg.get("image_token_index"))
    if not isinstance(image_token, int):
        raise ModelLoadError(f"{source}: missing image_token_index")
    base = gemma3.config_from_hf(text, "gemma3", f"{source} text_config")
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    fields["architecture"] = architecture
    return Gemma3VisionConfig(**fields, vision=tower, image_token_id=image_token, image_tokens=tokens)
