"""How a model pools: read once from its folder, torch-free (the engine checks requests
against it; the workers pool by it).

A sentence-transformers folder says it in ``modules.json`` (Transformer, Pooling,
Normalize) and ``1_Pooling/config.json``; a folder without them gets vLLM's defaults:
CLS for encoders, the last token for decoders, normalised. A sequence classifier
(``*ForSequenceClassification``) pools by its own head and classifies.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Literal

from aiolm.errors import ModelLoadError

PoolingType = Literal["cls", "mean", "last"]

# sentence-transformers' module classes aiolm runs, by class name (the module path moved
# between releases: models.Pooling before 6.0, sentence_transformer.modules.pooling.Pooling
# after); anything else in modules.json is refused.
_TRANSFORMER, _POOLING, _NORMALIZE = "Transformer", "Pooling", "Normalize"
# Pooling's config: one boolean per mode before 6.0, one ``pooling_mode`` string after.
_ST_MODES: dict[str, PoolingType] = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "last",
}
_ST_MODE_NAMES: dict[str, PoolingType] = {"cls": "cls", "mean": "mean", "lasttoken": "last"}


@dataclass(frozen=True)
class PoolingConfig:
    pooling_type: PoolingType
    normalize: bool
    # Embedding sizes a request's ``dimensions`` may ask for: None = no matryoshka support;
    # an empty tuple = any size up to the hidden size.
    matryoshka_dimensions: tuple[int, ...] | None = None
    num_labels: int = 0  # > 0: a sequence classifier (classify/score), its logits per input
    labels: tuple[str, ...] = ()  # id2label in order, where the config names them
    # sentence_bert_config.json's max_seq_length: the longest input the folder was made for
    # (the default context of a pooling engine, as sentence-transformers truncates to it).
    max_seq_length: int | None = None
    # What turns a classifier's logits into /classify's probs (config.json's problem_type, as
    # transformers trains it) and a cross-encoder's one logit into its score (the activation
    # sentence-transformers' CrossEncoder applies): "softmax", "sigmoid", "tanh" or "identity"
    class_activation: str = "softmax"
    score_activation: str = "sigmoid"
    lower_case: bool = False  # sentence_bert_config.json's do_lower_case: texts lowercased first

    @property
    def is_classifier(self) -> bool:
        return self.num_labels > 0


def read_pooling_config(path: str, hf_config: dict[str, Any], encoder_only: bool) -> PoolingConfig:
    """The pooling of the model folder ``path`` (its config.json already read as ``hf_config``).
    Raises ModelLoadError naming what aiolm cannot run."""
    archs = hf_config.get("architectures") or []
    matryoshka = _matryoshka(hf_config)
    if any(a.endswith("ForSequenceClassification") for a in archs):
        id2label = hf_config.get("id2label") or {}
        num_labels = int(hf_config.get("num_labels", len(id2label) or 2))
        labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(num_labels))
        return PoolingConfig(
            "cls" if encoder_only else "last",
            False,
            None,
            num_labels,
            labels,
            max_seq_length=_max_seq_length(path),
            class_activation=_class_activation(hf_config.get("problem_type"), num_labels),
            score_activation=_score_activation(path, hf_config) if num_labels == 1 else "sigmoid",
            lower_case=_lower_case(path),
        )
    modules_file = os.path.join(path, "modules.json") if os.path.isdir(path) else ""
    if not modules_file or not os.path.isfile(modules_file):
        return PoolingConfig("cls" if encoder_only else "last", True, matryoshka)
    with open(modules_file) as f:
        modules = json.load(f)
    pooling: PoolingType | None = None
    normalize = False
    for m in modules:
        kind = m.get("type", "").rpartition(".")[2]
        if kind == _TRANSFORMER:
            continue
        if kind == _POOLING:
            pooling = _st_pooling(os.path.join(path, m.get("path", ""), "config.json"))
        elif kind == _NORMALIZE:
            normalize = True
        else:
            raise ModelLoadError(
                f"{modules_file}: module {m.get('name', '?')!r} of type {m.get('type')!r} is not supported "
                "(aiolm runs Transformer, Pooling and Normalize modules)"
            )
    if pooling is None:
        pooling = "cls" if encoder_only else "last"
    return PoolingConfig(
        pooling, normalize, matryoshka, max_seq_length=_max_seq_length(path), lower_case=_lower_case(path)
    )


_PROBLEM_ACTIVATIONS = {
    "regression": "identity",
    "multi_label_classification": "sigmoid",
    "single_label_classification": "softmax",
}
# sentence-transformers' CrossEncoder activation, by the class name its config gives
_SCORE_ACTIVATIONS = {"Identity": "identity", "Sigmoid": "sigmoid", "Tanh": "tanh"}


def _class_activation(problem_type: Any, num_labels: int) -> str:
    if problem_type in _PROBLEM_ACTIVATIONS:
        return _PROBLEM_ACTIVATIONS[problem_type]
    return "sigmoid" if num_labels == 1 else "softmax"  # transformers' reading of an unset one


def _score_activation(path: str, hf_config: dict[str, Any]) -> str:
    """The activation a CrossEncoder of this folder applies to its logit (config.json's
    ``sentence_transformers.activation_fn``, or the older ``sbert_ce_default_activation_function``);
    sigmoid where it names none."""
    st = hf_config.get("sentence_transformers")
    named = (
        _json(path, "config_sentence_transformers.json").get("activation_fn")  # sentence-transformers 6
        or (st.get("activation_fn") if isinstance(st, dict) else None)
        or hf_config.get("sbert_ce_default_activation_function")
    )
    if named is None:
        return "sigmoid"
    how = _SCORE_ACTIVATIONS.get(str(named).rpartition(".")[2])
    if how is None:
        raise ModelLoadError(
            f"{path}: the cross-encoder's activation {named!r} is not supported "
            f"(aiolm applies {', '.join(_SCORE_ACTIVATIONS)})"
        )
    return how


def _json(path: str, name: str) -> dict[str, Any]:
    """A JSON object file of the folder; {} where it is missing or is no object."""
    try:
        with open(os.path.join(path, name)) as f:
            value = json.load(f)
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _max_seq_length(path: str) -> int | None:
    """The longest input the folder's model was made for: sentence_bert_config.json's
    max_seq_length, or, where sentence-transformers 6 keeps it, the tokenizer's
    model_max_length (transformers' "no limit" is a number past any context)."""
    value = _json(path, "sentence_bert_config.json").get("max_seq_length")
    if value is None:
        value = _json(path, "tokenizer_config.json").get("model_max_length")
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 < value < 10**9
    return int(value) if ok else None


def _lower_case(path: str) -> bool:
    return _json(path, "sentence_bert_config.json").get("do_lower_case") is True


def _st_pooling(config_file: str) -> PoolingType:
    try:
        with open(config_file) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{config_file}: cannot read the pooling config: {e}") from None
    if isinstance(cfg.get("pooling_mode"), str):
        name = cfg["pooling_mode"]
        if name not in _ST_MODE_NAMES:
            raise ModelLoadError(
                f"{config_file}: pooling {name!r} is not supported (aiolm pools by cls, mean or lasttoken)"
            )
        return _ST_MODE_NAMES[name]
    chosen = [mode for key, mode in _ST_MODES.items() if cfg.get(key)]
    others = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v and k not in _ST_MODES]
    if others or len(chosen) != 1:
        raise ModelLoadError(
            f"{config_file}: pooling {sorted(others) or chosen or 'none'} is not supported "
            "(aiolm pools by exactly one of CLS token, mean of tokens, last token)"
        )
    return chosen[0]


def _matryoshka(hf_config: dict[str, Any]) -> tuple[int, ...] | None:
    """vLLM's spelling: ``matryoshka_dimensions`` lists the sizes, ``is_matryoshka`` allows any."""
    dims = hf_config.get("matryoshka_dimensions")
    if dims:
        return tuple(int(d) for d in dims)
    return () if hf_config.get("is_matryoshka") else None
