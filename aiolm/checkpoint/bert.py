"""BERT and XLM-RoBERTa encoder configs -> BertConfig (the model is model/bert.py).

Encoders share ModelConfig's sizes (heads, layers, vocabulary, positions) and add what
a post-LayerNorm encoder reads: the LayerNorm epsilon, the token-type vocabulary, the
activation, the number of labels of a sequence classifier, and where absolute positions
start (XLM-RoBERTa counts them from ``pad_token_id + 1``). Torch-free: the engine reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from aiolm.checkpoint.config import ModelConfig
from aiolm.errors import ModelLoadError

# the activations model/bert.py implements: BERT's "gelu" is the exact (erf) one
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")

# ModelConfig.architecture of each encoder family (checkpoint/families.py)
ENCODERS = {
    "bert": ("bert", 0),  # (weight prefix of a *ForSequenceClassification, position offset base)
    "bert_classifier": ("bert", 0),
    "xlm_roberta": ("roberta", 1),
    "xlm_roberta_classifier": ("roberta", 1),
}


@dataclass(frozen=True)
class BertConfig(ModelConfig):
    encoder_only: ClassVar[bool] = True

    layer_norm_eps: float = 1e-12
    type_vocab_size: int = 2
    hidden_act: str = "gelu"
    num_labels: int = 0  # a sequence classifier's outputs; 0 for a plain encoder
    # position p of a sequence reads row p + offset of the position table, which has
    # max_position_embeddings + offset rows
    position_offset: int = 0
    weight_prefix: str = "bert"  # what a classifier's checkpoint puts before the encoder's names

    @property
    def is_classifier(self) -> bool:
        return self.num_labels > 0

    @property
    def roberta_head(self) -> bool:
        """XLM-RoBERTa classifies through classifier.dense + out_proj, BERT through its pooler."""
        return self.weight_prefix == "roberta"


def config_from_hf(cfg: dict[str, Any], architecture: str, source: str = "config.json") -> BertConfig:
    """A BERT or XLM-RoBERTa config as transformers reads it (its defaults where a field is
    absent). ``max_position_embeddings`` becomes the tokens a sequence may hold: the
    config's count less the rows XLM-RoBERTa skips."""
    prefix, offset_base = ENCODERS[architecture]
    act = cfg.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise ModelLoadError(f"{source}: hidden_act {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    kind = cfg.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise ModelLoadError(f"{source}: position_embedding_type {kind!r} is not supported; supported: absolute")
    if cfg.get("is_decoder") or cfg.get("add_cross_attention"):
        raise ModelLoadError(f"{source}: a BERT decoder (is_decoder, add_cross_attention) is not supported")
    offset = (int(cfg.get("pad_token_id", 1)) + 1) if offset_base else 0
    num_labels = 0
    if architecture.endswith("_classifier"):
        id2label = cfg.get("id2label") or {}
        num_labels = int(cfg.get("num_labels", len(id2label) or 2))
        if num_labels < 1:
            raise ModelLoadError(f"{source}: num_labels must be at least 1, got {num_labels}")
    eps = float(cfg.get("layer_norm_eps", 1e-12))  # BertConfig's and XLMRobertaConfig's
    max_pos = int(cfg.get("max_position_embeddings", 512))
    return BertConfig.from_hf(
        cfg,
        source,
        architecture=architecture,
        rms_norm_eps=eps,
        layer_norm_eps=eps,
        max_position_embeddings=max_pos - offset,  # the tokens a sequence may hold
        tie_word_embeddings=False,  # no LM head: the word embedding is only read
        attention_bias=True,
        rope_scaling=None,
        type_vocab_size=int(cfg.get("type_vocab_size", 2)),
        hidden_act=act,
        num_labels=num_labels,
        position_offset=offset,
        weight_prefix=prefix,
    )
