"""``min_tokens``: a row's stop ids are forbidden until it has generated that many tokens."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from aiolm.sample.logits_processors.interface import BatchRows, LogitsProcessor
from aiolm.sample.tensors import long_tensor


class MinTokens(LogitsProcessor):
    """Flat (row, stop token, limit) triples and each row's output length.

    A triple is active while its row's output is shorter than the limit. Rows
    already past their limit at build time are left out: output only grows.
    """

    name = "min_tokens"

    def __init__(
        self, rows: torch.Tensor, tokens: torch.Tensor, limits: torch.Tensor, output_lens: torch.Tensor
    ) -> None:
        self.rows, self.tokens, self.limits = rows, tokens, limits
        self.output_lens = output_lens  # long [num_rows]

    @classmethod
    def build(cls, rows: BatchRows) -> MinTokens | None:
        r: list[int] = []
        toks: list[int] = []
        limits: list[int] = []
        outputs = rows.output_token_ids
        for i, p in enumerate(rows.params):
            if len(outputs[i]) >= p.min_tokens:
                continue
            for tok in sorted(p.stop_ids()):
                if 0 <= tok < rows.vocab_size:
                    r.append(i)
                    toks.append(tok)
                    limits.append(p.min_tokens)
        if not r:
            return None
        dev = rows.device
        return cls(
            long_tensor(r, dev),
            long_tensor(toks, dev),
            long_tensor(limits, dev),
            long_tensor([len(o) for o in outputs], dev),
        )

    def advance(self, new_token_ids: Sequence[Sequence[int]]) -> None:
        self.output_lens += long_tensor([len(t) for t in new_token_ids], self.output_lens.device)

    def apply(self, logits: torch.Tensor) -> None:
        active = self.output_lens[self.rows] < self.limits
        # Adding -inf or 0 avoids a data-dependent boolean index (a device sync on GPU).
        delta = torch.zeros(self.rows.shape, dtype=logits.dtype, device=logits.device).masked_fill_(
            active, float("-inf")
        )
        logits.index_put_((self.rows, self.tokens), delta, accumulate=True)
