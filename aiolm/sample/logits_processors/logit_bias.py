"""``logit_bias``: a fixed amount added to chosen tokens of a row, every step."""

from __future__ import annotations

import torch

from aiolm.sample.logits_processors.interface import BatchRows, LogitsProcessor
from aiolm.sample.tensors import float_column, long_tensor


class LogitBias(LogitsProcessor):
    """Flat (row, token, bias) triples: one indexed add covers the whole batch.

    Token ids outside ``[0, vocab_size)`` are ignored: the API edge is where
    they should be rejected.
    """

    name = "logit_bias"

    def __init__(self, rows: torch.Tensor, tokens: torch.Tensor, values: torch.Tensor) -> None:
        self.rows, self.tokens, self.values = rows, tokens, values

    @classmethod
    def build(cls, rows: BatchRows) -> LogitBias | None:
        r: list[int] = []
        toks: list[int] = []
        vals: list[float] = []
        for i, p in enumerate(rows.params):
            for tok, val in (p.logit_bias or {}).items():
                if 0 <= tok < rows.vocab_size and val != 0.0:
                    r.append(i)
                    toks.append(tok)
                    vals.append(val)
        if not r:
            return None
        dev = rows.device
        return cls(long_tensor(r, dev), long_tensor(toks, dev), float_column(vals, dev).squeeze(1))

    def apply(self, logits: torch.Tensor) -> None:
        logits.index_put_((self.rows, self.tokens), self.values, accumulate=True)
