"""The logits processors, in the order the sampler applies them.

Adding one: a module here with a :class:`LogitsProcessor` subclass (the
contract is in ``interface.py``) and its class in :data:`REGISTRY`. Where two
processors do not commute the order is the definition: ``logit_bias`` comes
before the penalties because the repetition penalty scales the biased logit
(as in vLLM). The ones that forbid a token set it to -inf, which nothing after
them undoes. All of them run before temperature, so a penalty's strength does
not scale with it.
"""

from __future__ import annotations

from collections.abc import Sequence

from aiolm.params import SamplingParams
from aiolm.sample.logits_processors.allowed_token_ids import AllowedTokenIds
from aiolm.sample.logits_processors.bad_words import BadWords
from aiolm.sample.logits_processors.grammar import Grammar
from aiolm.sample.logits_processors.interface import BatchRows, LogitsProcessor
from aiolm.sample.logits_processors.logit_bias import LogitBias
from aiolm.sample.logits_processors.min_tokens import MinTokens
from aiolm.sample.logits_processors.penalties import Penalties
from aiolm.sample.logits_processors.thinking_budget import ThinkingBudget

REGISTRY: list[type[LogitsProcessor]] = [
    AllowedTokenIds,
    BadWords,
    LogitBias,
    MinTokens,
    Penalties,
    ThinkingBudget,  # after the bans: a forced end-of-thinking token is the one left
    Grammar,  # last: only a hard mask, so the order does not matter; the grammar sees the others' bans
]

__all__ = ["REGISTRY", "BatchRows", "LogitsProcessor", "build_active", "needs_prompt"]


def build_active(rows: BatchRows, registry: Sequence[type[LogitsProcessor]] | None = None) -> list[LogitsProcessor]:
    """The processors some row uses, in registry order (``registry``: :data:`REGISTRY`)."""
    active = []
    for cls in REGISTRY if registry is None else registry:
        proc = cls.build(rows)
        if proc is not None:
            active.append(proc)
    return active


def needs_prompt(params: SamplingParams, registry: Sequence[type[LogitsProcessor]] | None = None) -> bool:
    """Whether any processor needs this row's prompt tokens (else the runner skips copying them)."""
    return any(cls.needs_prompt(params) for cls in (REGISTRY if registry is None else registry))
