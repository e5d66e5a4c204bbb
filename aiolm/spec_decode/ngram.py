"""Prompt-lookup (n-gram) drafts: continue the sequence the way it continued before.

Copy-heavy generation (quoting, editing code, repeating a list) reproduces runs
of the prompt or of its own output. If the last ``n`` tokens occurred earlier,
the tokens that followed that occurrence are a cheap guess at what comes next;
the target model verifies the guess in one forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramProposer:
    """Finds the longest suffix match (``min_n``..``max_n`` tokens) within the last
    ``window`` tokens and proposes up to ``k`` tokens that followed it.

    Pure Python on the scheduler's token list: ``list.index`` finds each earlier
    occurrence of the last token in C, and only those are extended backwards in
    Python, so a step costs one scan of the window plus a few comparisons per
    occurrence (docs/benchmarks/log.md, "Speculative decoding, n-gram", has its cost
    per step). Ties between equally long matches go to the most recent one: a
    sequence that has started repeating itself is best predicted by its latest
    repetition.
    """

    def __init__(self, k: int, min_n: int, max_n: int, window: int = 2048) -> None:
        if not 1 <= min_n <= max_n or k < 1 or window <= max_n:
            raise ValueError(f"bad n-gram proposer settings: k={k} min_n={min_n} max_n={max_n} window={window}")
        self.k, self.min_n, self.max_n, self.window = k, min_n, max_n, window

    def propose(self, tokens: Sequence[int], k: int | None = None) -> list[int]:
        """Up to ``k`` (default: the configured k) draft tokens, or [] without a match."""
        k = self.k if k is None else k
        n_tok = len(tokens)
        if k <= 0 or n_tok <= self.min_n:
            return []
        lo = max(0, n_tok - self.window)
        last = n_tok - 1
        tail = tokens[last]
        max_n, min_n = self.max_n, self.min_n
        index = tokens.index  # type: ignore[attr-defined]
        best_n, best_p = 0, -1
        # An occurrence at p needs min_n - 1 tokens before it inside the window.
        p = lo + min_n - 1
        while True:
            try:
                p = index(tail, p, last)
            except ValueError:
                break
            m = 1
            while m < max_n and p - m >= lo and tokens[p - m] == tokens[last - m]:
                m += 1
            if m >= min_n and m >= best_n:
                best_n, best_p = m, p
            p += 1
        if best_p < 0:
            return []
        return list(tokens[best_p + 1 : best_p + 1 + k])
