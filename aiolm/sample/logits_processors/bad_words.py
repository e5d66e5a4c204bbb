"""``bad_words_token_ids``: token sequences a row must never complete."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from aiolm.sample.logits_processors.interface import BatchRows, LogitsProcessor
from aiolm.sample.tensors import long_tensor


class BadWords(LogitsProcessor):
    """One-token words are forbidden always; a longer word's last token is forbidden
    while the row's output ends with the rest of it.

    Each row keeps the tail of its output that its longest word can match, as a
    host-side list, so deciding what to forbid reads nothing back from the
    device. A word holding an id outside the vocabulary can never be completed
    and is dropped.
    """

    name = "bad_words"

    def __init__(
        self,
        always: tuple[torch.Tensor, torch.Tensor] | None,
        prefixed: dict[int, list[tuple[tuple[int, ...], int]]],
        tails: dict[int, list[int]],
        keep: dict[int, int],
        device: torch.device,
    ) -> None:
        self.always = always  # (rows, tokens) forbidden every step
        self.prefixed = prefixed  # row -> [(prefix, last token)]
        self.tails = tails  # row -> its last output tokens, at most keep[row] of them
        self.keep = keep  # row -> the length of its longest prefix
        self.device = device

    @classmethod
    def build(cls, rows: BatchRows) -> BadWords | None:
        always_r: list[int] = []
        always_t: list[int] = []
        prefixed: dict[int, list[tuple[tuple[int, ...], int]]] = {}
        for i, p in enumerate(rows.params):
            for word in p.bad_words_token_ids or ():
                if not all(0 <= t < rows.vocab_size for t in word):
                    continue
                if len(word) == 1:
                    always_r.append(i)
                    always_t.append(word[0])
                else:
                    prefixed.setdefault(i, []).append((tuple(word[:-1]), word[-1]))
        if not always_r and not prefixed:
            return None
        keep = {i: max(len(prefix) for prefix, _ in words) for i, words in prefixed.items()}
        tails = {i: list(rows.output_token_ids[i][-k:]) for i, k in keep.items()}
        dev = rows.device
        always = (long_tensor(always_r, dev), long_tensor(always_t, dev)) if always_r else None
        return cls(always, prefixed, tails, keep, dev)

    def advance(self, new_token_ids: Sequence[Sequence[int]]) -> None:
        for i, tail in self.tails.items():
            toks = new_token_ids[i]
            if toks:
                tail.extend(toks)
                del tail[: -self.keep[i]]

    def apply(self, logits: torch.Tensor) -> None:
        if self.always is not None:
            logits.index_put_(self.always, logits.new_tensor(float("-inf")))
        rows: list[int] = []
        toks: list[int] = []
        for i, words in self.prefixed.items():
            tail = self.tails[i]
            for prefix, last in words:
                if len(tail) >= len(prefix) and tuple(tail[len(tail) - len(prefix) :]) == prefix:
                    rows.append(i)
                    toks.append(last)
        if rows:
            idx = (long_tensor(rows, self.device), long_tensor(toks, self.device))
            logits.index_put_(idx, logits.new_tensor(float("-inf")))
