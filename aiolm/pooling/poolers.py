"""Hidden states -> one vector per pooling request, in the worker.

A prompt may be computed over several steps (chunked prefill of a decoder): each
request keeps a running state (the sum of its hidden states, its first and latest
token's) that is complete when the step holding its last prompt token ends; then the
vector is cut to ``dimensions``, normalised, or handed to the model's classifier.
Everything is float32, whatever the activations' dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from aiolm.pooling.config import PoolingConfig
from aiolm.pooling.params import PoolingParams


class PoolingState:
    """One request's pooling so far."""

    __slots__ = ("params", "total", "count", "first", "last")

    def __init__(self, params: PoolingParams) -> None:
        self.params = params
        self.total: torch.Tensor | None = None
        self.count = 0
        self.first: torch.Tensor | None = None
        self.last: torch.Tensor | None = None

    def add(self, hidden: torch.Tensor, start: int, kind: str) -> None:
        """``hidden``: the states of prompt positions ``start ..`` computed this step."""
        if kind == "mean":
            part = hidden.float().sum(0)
            self.total = part if self.total is None else self.total + part
            self.count += hidden.shape[0]
        elif kind == "cls":
            if start == 0:
                self.first = hidden[0].float()
        else:
            self.last = hidden[-1].float()

    def pooled(self, kind: str) -> torch.Tensor:
        if kind == "mean":
            assert self.total is not None
            return self.total / self.count
        out = self.first if kind == "cls" else self.last
        assert out is not None, "the request's pooled token was never computed"
        return out


class Pooler:
    """The model's pooling (aiolm/pooling/config.py) applied to finished requests."""

    def __init__(self, config: PoolingConfig, classify: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        if config.is_classifier and classify is None:
            raise ValueError("this model's config names a classifier, but the model has no classification head")
        self.config = config
        self.classify = classify

    def finish(self, states: list[PoolingState]) -> list[list[float]]:
        """The vectors of requests whose prompt is complete, in one batch."""
        kind = self.config.pooling_type
        pooled = torch.stack([s.pooled(kind) for s in states])
        if self.config.is_classifier:
            assert self.classify is not None
            return self.classify(pooled).float().tolist()
        out = []
        for row, s in zip(pooled, states):
            p = s.params
            if p.dimensions is not None:
                row = row[: p.dimensions]
            if self.config.normalize if p.normalize is None else p.normalize:
                row = F.normalize(row, dim=0)
            out.append(row.tolist())
        return out
