"""``thinking_token_budget``: past that many thinking tokens, the end-of-thinking token is forced.

A row's thinking starts at its first output token, or, where the model chooses whether
to think (``thinking_markers``' start token is set), after that start token when it is
the first one written; a first token of anything else means the model answers without
thinking and the row is left alone. The thinking ends where the output holds the end
token. A row whose thinking has ``thinking_token_budget`` tokens and no end is allowed
only the end token, so the answer follows within the ``max_tokens`` the client set, as
vLLM's budget does. The state is a few integers per row kept on the host: which rows
are forced this step is known before the logits are, so nothing is read back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from aiolm.sample.logits_processors.interface import BatchRows, LogitsProcessor
from aiolm.sample.tensors import long_tensor


class _Row:
    """One row's thinking: ``count`` tokens so far, ``None`` once over (or never begun)."""

    def __init__(self, budget: int, end: int, opens: int | None) -> None:
        self.budget, self.end, self.opens = budget, end, opens
        self.undecided = opens is not None
        self.count: int | None = 0

    def feed(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            if self.count is None:
                return
            if self.undecided:
                self.undecided = False
                if t != self.opens:
                    self.count = None  # it answers at once
                continue
            self.count = None if t == self.end else self.count + 1

    @property
    def forced(self) -> bool:
        return not self.undecided and self.count is not None and self.count >= self.budget


class ThinkingBudget(LogitsProcessor):
    name = "thinking_budget"

    def __init__(self, rows: dict[int, _Row], vocab_size: int, device: torch.device) -> None:
        self.rows = rows  # batch row -> its thinking, for the rows with a budget
        self.vocab_size = vocab_size
        self.device = device

    @classmethod
    def build(cls, rows: BatchRows) -> ThinkingBudget | None:
        state: dict[int, _Row] = {}
        for i, p in enumerate(rows.params):
            if p.thinking_token_budget is None or p.thinking_markers is None:
                continue
            end, opens = p.thinking_markers
            if not 0 <= end < rows.vocab_size:
                continue  # a marker the model cannot write: nothing to force
            row = _Row(p.thinking_token_budget, end, opens)
            row.feed(rows.output_token_ids[i])
            if row.count is not None:
                state[i] = row
        return cls(state, rows.vocab_size, rows.device) if state else None

    def advance(self, new_token_ids: Sequence[Sequence[int]]) -> None:
        for i, row in list(self.rows.items()):
            row.feed(new_token_ids[i])
            if row.count is None:
                del self.rows[i]

    def apply(self, logits: torch.Tensor) -> None:
        forced = [(i, row.end) for i, row in self.rows.items() if row.forced]
        if not forced:
            return
        idx = long_tensor([i for i, _ in forced], self.device)
        ends = long_tensor([e for _, e in forced], self.device)
        logits[idx] = float("-inf")
        logits[idx, ends] = 0.0  # the one finite logit: greedy and random rows alike take it
