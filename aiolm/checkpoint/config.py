"""The architecture facts the model code needs, read from a Hugging Face config.

One small frozen dataclass instead of passing transformers' config objects around,
so workers, tests and the loader agree on exactly which fields matter. ``ModelConfig``
holds what every decoder has (sizes, norms, RoPE, per-layer sliding windows); a family
whose layers need more subclasses it in its own module (``checkpoint/gemma3.py``). Which
family reads which Hugging Face architecture is the table in ``checkpoint/families.py``.
Nothing here imports torch: the engine process reads configs too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from aiolm.checkpoint.quantization import WeightQuant
from aiolm.errors import ModelLoadError


@dataclass(frozen=True)
class ModelConfig:
    # Bidirectional attention over each whole prompt in one step, no KV cache, no prefix
    # caching, no generation (an encoder such as BERT, checkpoint/bert.py); the engine reads it
    encoder_only: ClassVar[bool] = False

    architecture: str  # the registry's name for it: llama, mistral, qwen2, qwen3, gemma3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2: bias on q/k/v projections
    qk_norm: bool  # Qwen3, Gemma 3: RMSNorm on each head of q and k before RoPE
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # per layer: how many keys back a query sees (itself included), None for all of them;
    # empty when no layer has a window
    sliding_windows: tuple[int | None, ...] = ()
    # how the checkpoint stores its linear weights (GPTQ, AWQ, ...); None: dense
    quantization: WeightQuant | None = None

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window, None if it attends to the whole sequence."""
        return self.sliding_windows[layer] if self.sliding_windows else None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str = "config.json", *, architecture: str, **family: Any) -> Self:
        """The fields every decoder has, as Llama-style configs spell them; a family module
        passes ``family`` values for the fields it spells or defaults differently, and for
        its subclass's own fields."""

        def need(key: str) -> Any:
            if key not in cfg:
                raise ModelLoadError(f"{source}: missing field {key!r}")
            return cfg[key]

        def size(key: str, default: Any = None) -> int:
            """A positive integer field (``default`` when absent or null, if given)."""
            value = cfg.get(key) if default is not None else need(key)
            value = default if value is None else value
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelLoadError(f"{source}: {key} must be a positive integer, got {value!r}")
            return value

        def number(key: str, default: float) -> float:
            value = cfg.get(key, default)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf"):
                raise ModelLoadError(f"{source}: {key} must be a positive number, got {value!r}")
            return float(value)

        hidden = size("hidden_size")
        heads = size("num_attention_heads")
        kv_heads = size("num_key_value_heads", heads)
        if heads % kv_heads:
            raise ModelLoadError(f"{source}: {heads} attention heads do not split into {kv_heads} KV-head groups")
        rope_params = cfg.get("rope_parameters") or {}
        # transformers 5 keeps rope_parameters' own rope_theta over a top-level one
        theta = rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not theta > 0:
            raise ModelLoadError(f"{source}: rope_theta must be a positive number, got {theta!r}")
        scaling = cfg.get("rope_scaling") or (
            rope_params if rope_params.get("rope_type", "default") != "default" else None
        )
        check_rope_scaling(scaling, source)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        fields: dict[str, Any] = dict(
            architecture=architecture,
            vocab_size=size("vocab_size"),
            hidden_size=hidden,
            intermediate_size=size("intermediate_size"),
            num_layers=size("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=size("head_dim", max(1, hidden // heads)),
            rms_norm_eps=number("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=size("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            qk_norm=False,
            rope_scaling=filled_rope_scaling(scaling, size("max_position_embeddings", 2048)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
        fields.update(family)
        windows = tuple(fields.get("sliding_windows") or ())
        if windows and len(windows) != fields["num_layers"]:
            raise ModelLoadError(f"{source}: {len(windows)} layer types for {fields['num_layers']} layers")
        for w in windows:
            if w is not None and (not isinstance(w, int) or w < 1):
                raise ModelLoadError(f"{source}: sliding_window must be a positive integer, got {w!r}")
        fields["sliding_windows"] = windows if any(w is not None for w in windows) else ()
        return cls(**fields)


# The RoPE scalings aiolm/model/layers/rotary.py computes; any other would run as plain RoPE
# and answer wrong past the first positions.
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_ROPE_NEEDS = {"linear": ("factor",), "llama3": ("factor", "original_max_position_embeddings"), "yarn": ("factor",)}


def check_rope_scaling(scaling: Any, source: str) -> None:
    """A ModelLoadError naming what a config's rope scaling lacks or asks that is not computed."""
    if not scaling:
        return
    if not isinstance(scaling, dict):
        raise ModelLoadError(f"{source}: rope_scaling must be an object, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        supported = ", ".join(ROPE_TYPES)
        raise ModelLoadError(f"{source}: rope_scaling type {kind!r} is not supported; supported: {supported}")
    for key in _ROPE_NEEDS.get(kind, ()):
        v = scaling.get(key)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
            raise ModelLoadError(f"{source}: rope_scaling ({kind}) needs a positive {key}, got {v!r}")


def filled_rope_scaling(scaling: dict[str, Any] | None, positions: int) -> dict[str, Any] | None:
    """A copy of ``scaling``; YaRN's trained length defaults to the positions, as transformers reads it."""
    if not scaling:
        return None
    filled = dict(scaling)
    if filled.get("rope_type", filled.get("type")) == "yarn":
        filled.setdefault("original_max_position_embeddings", positions)
    return filled


def check_silu_mlp(cfg: dict[str, Any], source: str, key: str = "hidden_act") -> None:
    """A family whose MLP (or experts) is SiLU-gated runs no other activation: a config that
    names another must be refused, not run as SiLU (transformers runs the one it names)."""
    act = cfg.get(key, "silu")
    if act not in ("silu", "swish"):
        raise ModelLoadError(f"{source}: {key} {act!r} is not supported for this architecture (its MLP is SiLU-gated)")
