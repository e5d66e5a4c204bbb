"""What turns the workers' pooled values into the numbers the APIs return: probabilities
of a classifier, a cross-encoder's relevance score, the cosine of two embeddings.
Pure Python on lists (one request's few values), so the engine process needs no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from aiolm.params import ParamError


def softmax(logits: Sequence[float]) -> list[float]:
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = sum(exps)
    return [e / total for e in exps]


def sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def activate(values: Sequence[float], how: str) -> list[float]:
    """``values`` through an activation named as PoolingConfig names them."""
    if how == "softmax":
        return softmax(values)
    if how == "sigmoid":
        return [sigmoid(x) for x in values]
    if how == "tanh":
        return [math.tanh(x) for x in values]
    return [float(x) for x in values]  # identity


def class_probs(logits: Sequence[float], how: str) -> list[float]:
    """A classifier's probabilities as vLLM's /classify gives them: by its problem type
    (PoolingConfig.class_activation; sigmoid for one label, softmax over several when unset)."""
    return activate(logits, how)


def cross_encoder_score(logits: Sequence[float], how: str) -> float:
    """A cross-encoder's relevance of one pair, as sentence-transformers' ``CrossEncoder.predict``
    gives it: its single logit through the folder's activation (PoolingConfig.score_activation)."""
    if len(logits) != 1:
        raise ParamError("model", f"scoring needs a classifier with one label, this one has {len(logits)}")
    return activate(logits, how)[0]


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """Cosine similarity of two embeddings (0 when either is all zeros)."""
    if len(a) != len(b):
        raise ValueError(f"embeddings differ in size: {len(a)} and {len(b)}")
    dot = sum(x * y for x, y in zip(a, b))
    na = math.sqrt(sum(x * x for x in a))
    nb = math.sqrt(sum(y * y for y in b))
    return dot / (na * nb) if na and nb else 0.0


def score_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's pairing of score inputs: 1 to 1, 1 to N, or N to N element by element."""
    left = [text_1] if isinstance(text_1, str) else list(text_1)
    right = [text_2] if isinstance(text_2, str) else list(text_2)
    if not left or not right:
        raise ParamError("text_1" if not left else "text_2", "must not be empty")
    if len(left) == 1:
        left = left * len(right)
    if len(left) != len(right):
        raise ParamError("text_2", f"has {len(right)} texts for {len(left)} in text_1: give one, or as many")
    return list(zip(left, right))
