"""Hugging Face architecture -> model family: the table the loader and the builder share.

A family is a model module under aiolm/model/ that the builder imports by name, and a
line in MODELS. A family whose config spells or adds fields beyond what every decoder has
(``ModelConfig.from_hf``) also names its mapping here (``checkpoint/<family>.py``:
``config_from_hf(cfg, architecture, source)``), torch-free, so the engine process can
read the config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiolm.checkpoint import bert, gemma3, llama, moe, vision
from aiolm.checkpoint.config import ModelConfig
from aiolm.checkpoint.quantization import read_quantization
from aiolm.errors import ModelLoadError


@dataclass(frozen=True)
class ModelFamily:
    name: str  # ModelConfig.architecture
    module: str  # aiolm.model.<module>: the module of its model class (imported by the builder only)
    model_class: str
    model_type: str  # config.json's model_type, for configs that list no architectures
    config_from_hf: Callable[[dict[str, Any], str, str], ModelConfig] | None = None  # None: the common fields


# Hugging Face architecture -> the family that runs it
MODELS: dict[str, ModelFamily] = {
    "LlamaForCausalLM": ModelFamily("llama", "llama", "LlamaForCausalLM", "llama", llama.config_from_hf),
    "MistralForCausalLM": ModelFamily("mistral", "llama", "LlamaForCausalLM", "mistral", llama.config_from_hf),
    "Qwen2ForCausalLM": ModelFamily("qwen2", "llama", "LlamaForCausalLM", "qwen2", llama.config_from_hf),
    "Qwen3ForCausalLM": ModelFamily("qwen3", "llama", "LlamaForCausalLM", "qwen3", llama.config_from_hf),
    "Gemma3ForCausalLM": ModelFamily("gemma3", "gemma3", "Gemma3ForCausalLM", "gemma3_text", gemma3.config_from_hf),
    "Qwen3MoeForCausalLM": ModelFamily("qwen3_moe", "moe", "MoEForCausalLM", "qwen3_moe", moe.config_from_hf),
    "Qwen2MoeForCausalLM": ModelFamily("qwen2_moe", "moe", "MoEForCausalLM", "qwen2_moe", moe.config_from_hf),
    "MixtralForCausalLM": ModelFamily("mixtral", "moe", "MoEForCausalLM", "mixtral", moe.config_from_hf),
    # vision-language: a language model above with a vision tower and projector beside it
    "LlavaForConditionalGeneration": ModelFamily(
        "llava", "llava", "LlavaForConditionalGeneration", "llava", vision.llava_config_from_hf
    ),
    "Gemma3ForConditionalGeneration": ModelFamily(
        "gemma3_vision",
        "gemma3_vision",
        "Gemma3ForConditionalGeneration",
        "gemma3",
        vision.gemma3_vision_config_from_hf,
    ),
    # encoders (BertConfig.encoder_only): embeddings and sequence classifiers, no generation
    "BertModel": ModelFamily("bert", "bert", "BertModel", "bert", bert.config_from_hf),
    "BertForSequenceClassification": ModelFamily(
        "bert_classifier", "bert", "BertForSequenceClassification", "bert", bert.config_from_hf
    ),
    "XLMRobertaModel": ModelFamily("xlm_roberta", "bert", "BertModel", "xlm-roberta", bert.config_from_hf),
    "XLMRobertaForSequenceClassification": ModelFamily(
        "xlm_roberta_classifier", "bert", "BertForSequenceClassification", "xlm-roberta", bert.config_from_hf
    ),
}


# Where a family's transformers config class defaults a field otherwise than the readers do
# (config/ModelConfig.from_hf: RoPE base 10000, eps 1e-6, 2048 positions, as many KV heads as
# heads): a config.json without the field means the class's value, as transformers reads it.
_CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "mistral": {"max_position_embeddings": 131072, "num_key_value_heads": 8, "sliding_window": 4096},
    "qwen2": {"max_position_embeddings": 32768},
    "qwen3": {"max_position_embeddings": 32768},
    "qwen2_moe": {"max_position_embeddings": 32768, "num_key_value_heads": 16},
    "qwen3_moe": {"max_position_embeddings": 32768, "num_key_value_heads": 4},
    "mixtral": {"max_position_embeddings": 131072, "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 1e6},
}


def family_of(architecture: str) -> ModelFamily:
    """The family whose ModelConfig.architecture is ``architecture``."""
    family = next((f for f in MODELS.values() if f.name == architecture), None)
    if family is None:
        raise ModelLoadError(f"no implementation for architecture {architecture!r}")
    return family


# Heads of their own on a family's model: loaded as the family's causal LM they would fail on
# their own weights (an encoder's ForMaskedLM / ForPreTraining checkpoint is its bare model plus
# heads that are left out, and serves as an embedder)
_OTHER_HEADS = (
    "ForSequenceClassification",
    "ForTokenClassification",
    "ForQuestionAnswering",
    "ForMultipleChoice",
)


def read_config(cfg: dict[str, Any], source: str = "config.json", quant_source: str | None = None) -> ModelConfig:
    """The ModelConfig of a Hugging Face config.json, by the family of its architecture
    (``quant_source``: the file its quantization_config came from, where not ``source``)."""
    archs = cfg.get("architectures") or []
    heads = [a for a in archs if isinstance(a, str) and a.endswith(_OTHER_HEADS)]
    if heads and not any(a in MODELS for a in archs):
        # a head of its own (a Qwen3 classifier, a token classifier): the model_type's causal LM
        # would load its weights but that head's, and fail on it
        raise ModelLoadError(
            f"{source}: architecture {heads[0]!r} is not supported; supported: {', '.join(sorted(MODELS))}"
        )
    arch = next((a for a in archs if a in MODELS), None) or next(
        (a for a, f in MODELS.items() if f.model_type == cfg.get("model_type")), None
    )
    if arch is None:
        raise ModelLoadError(
            f"{source}: unknown architecture {archs or cfg.get('model_type')!r}; supported: {', '.join(sorted(MODELS))}"
        )
    family = MODELS[arch]
    cfg = {**_CLASS_DEFAULTS.get(family.name, {}), **cfg}
    if family.config_from_hf is None:
        config = ModelConfig.from_hf(cfg, source, architecture=family.name)
    else:
        config = family.config_from_hf(cfg, family.name, source)
    quant = read_quantization(cfg, quant_source or source)
    if quant is not None and config.encoder_only:
        raise ModelLoadError(f"{source}: quantized encoder-only models are not supported")
    return dataclasses.replace(config, quantization=quant) if quant is not None else config
