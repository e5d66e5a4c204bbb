"""``allowed_token_ids``: a row may only pick from its own list of tokens."""

from __future__ import annotations

import torch

from aiolm.sample.logits_processors.interface import BatchRows, LogitsProcessor
from aiolm.sample.tensors import long_tensor


class AllowedTokenIds(LogitsProcessor):
    """A boolean [k, vocab] mask of the forbidden tokens of the k constrained rows.

    Ids outside ``[0, vocab_size)`` are ignored, like logit_bias's; a row whose
    list holds none inside is left unconstrained rather than left with no token
    at all (the API edge is where such a list should be rejected).
    """

    name = "allowed_token_ids"

    def __init__(self, rows: torch.Tensor | None, forbidden: torch.Tensor) -> None:
        self.rows = rows  # None: every row is constrained
        self.forbidden = forbidden

    @classmethod
    def build(cls, rows: BatchRows) -> AllowedTokenIds | None:
        constrained: list[int] = []
        allowed: list[list[int]] = []
        for i, p in enumerate(rows.params):
            ids = [t for t in (p.allowed_token_ids or ()) if 0 <= t < rows.vocab_size]
            if ids:
                constrained.append(i)
                allowed.append(ids)
        if not constrained:
            return None
        dev = rows.device
        forbidden = torch.ones(len(constrained), rows.vocab_size, dtype=torch.bool, device=dev)
        for j, ids in enumerate(allowed):
            forbidden[j, long_tensor(ids, dev)] = False
        every = len(constrained) == len(rows)
        return cls(None if every else long_tensor(constrained, dev), forbidden)

    def apply(self, logits: torch.Tensor) -> None:
        if self.rows is None:
            logits.masked_fill_(self.forbidden, float("-inf"))
            return
        sub = logits.index_select(0, self.rows).masked_fill_(self.forbidden, float("-inf"))
        logits.index_copy_(0, self.rows, sub)
