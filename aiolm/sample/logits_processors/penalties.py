"""Repetition, frequency and presence penalties over per-row token tables."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import torch

from aiolm.params import SamplingParams
from aiolm.sample.logits_processors.interface import BatchRows, LogitsProcessor
from aiolm.sample.tensors import float_column, long_tensor


class Penalties(LogitsProcessor):
    """Repetition/frequency/presence state as per-row token tables, not [rows, vocab].

    ``hist`` [N, W] holds each repetition-penalised row's prompt and output
    tokens; ``out`` holds each frequency/presence-penalised row's output tokens,
    one column per occurrence. Repeated tokens need no dedup: the repetition
    and presence updates are written with ``scatter_`` from one ``gather``
    taken before the write, so duplicate columns write the same number, and
    the frequency update adds one ``-frequency`` per occurrence. Spare columns
    repeat the row's first token (a duplicate); a row with no tokens yet has a
    neutral factor so its spare columns change nothing. Row-wise gather/scatter
    on these tables is much cheaper on CPU than flat advanced indexing, and
    nothing here walks the tokens in Python.
    """

    name = "penalties"

    @classmethod
    def build(cls, rows: BatchRows) -> Penalties | None:
        if all(p.repetition_penalty == 1.0 and not p.frequency_penalty and not p.presence_penalty for p in rows.params):
            return None
        return cls(rows.params, rows.output_token_ids, rows.prompt_token_ids, rows.vocab_size, rows.device)

    @classmethod
    def needs_prompt(cls, params: SamplingParams) -> bool:
        """The repetition penalty also counts the prompt's tokens as seen."""
        return params.repetition_penalty != 1.0

    def __init__(
        self,
        params: Sequence[SamplingParams],
        outputs: Sequence[Sequence[int]],
        prompts: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device,
    ) -> None:
        n = len(params)
        self.vocab_size = vocab_size
        self.device = device
        self._rep = [p.repetition_penalty for p in params]
        self._pres = [p.presence_penalty for p in params]
        freq = [p.frequency_penalty for p in params]
        self._use_hist = [r != 1.0 for r in self._rep]
        self._use_out = [bool(f or pr) for f, pr in zip(freq, self._pres)]
        self.frequency = float_column(freq, device) if any(freq) else None
        hist = [self._in_vocab(itertools.chain(prompts[i], outputs[i])) if self._use_hist[i] else [] for i in range(n)]
        out = [self._in_vocab(outputs[i]) if self._use_out[i] else [] for i in range(n)]
        self._hist_len = [len(h) for h in hist]
        self._out_len = [len(o) for o in out]
        # Factors are neutral until a row has a token, so its padding is a no-op.
        self.rep_factor = (
            float_column([r if h else 1.0 for r, h in zip(self._rep, hist)], device) if any(self._use_hist) else None
        )
        self.presence = (
            float_column([pr if o else 0.0 for pr, o in zip(self._pres, out)], device) if any(self._pres) else None
        )
        self.hist_idx = _padded(hist, device)
        self.out_idx = _padded(out, device)
        # 1 per real occurrence, 0 for padding: what the frequency penalty counts.
        self.out_weight = (
            self.out_idx.new_tensor(self._out_len).unsqueeze(1) > torch.arange(self.out_idx.shape[1], device=device)
        ).float()

    def _in_vocab(self, tokens: Iterable[int]) -> list[int]:
        """Ids outside the vocabulary are dropped (they can only come from a bad prompt)."""
        lst = list(tokens)
        if lst and (min(lst) < 0 or max(lst) >= self.vocab_size):
            lst = [t for t in lst if 0 <= t < self.vocab_size]
        return lst

    def advance(self, new_token_ids: Sequence[Sequence[int]]) -> None:
        """Append tokens generated since the last step (one list per row)."""
        hist_w: list[tuple[int, int, int]] = []  # (row, column, token)
        out_w: list[tuple[int, int, int]] = []
        hist_first: list[tuple[int, int]] = []  # (row, token): the row's first token
        out_first: list[tuple[int, int]] = []
        for i, toks in enumerate(new_token_ids):
            for t in toks:
                if not 0 <= t < self.vocab_size:
                    continue
                if self._use_hist[i]:
                    if self._hist_len[i] == 0:
                        hist_first.append((i, t))
                    hist_w.append((i, self._hist_len[i], t))
                    self._hist_len[i] += 1
                if self._use_out[i]:
                    if self._out_len[i] == 0:
                        out_first.append((i, t))
                    out_w.append((i, self._out_len[i], t))
                    self._out_len[i] += 1
        if hist_w:
            self.hist_idx = _grow(self.hist_idx, max(self._hist_len), hist_first)
            _write(self.hist_idx, hist_w)
            if hist_first:
                assert self.rep_factor is not None
                rows = [r for r, _ in hist_first]
                self.rep_factor[long_tensor(rows, self.device)] = float_column(
                    [self._rep[r] for r in rows], self.device
                )
        if out_w:
            self.out_idx = _grow(self.out_idx, max(self._out_len), out_first)
            _write(self.out_idx, out_w)
            width = self.out_idx.shape[1]
            if self.out_weight.shape[1] < width:
                pad = self.out_weight.new_zeros(self.out_weight.shape[0], width - self.out_weight.shape[1])
                self.out_weight = torch.cat([self.out_weight, pad], dim=1)
            rows, cols, _ = zip(*out_w)
            self.out_weight[long_tensor(rows, self.device), long_tensor(cols, self.device)] = 1.0
            if out_first and self.presence is not None:
                first = [r for r, _ in out_first]
                self.presence[long_tensor(first, self.device)] = float_column(
                    [self._pres[r] for r in first], self.device
                )

    def apply(self, logits: torch.Tensor) -> None:
        """Penalise ``logits`` in place: repetition first, then presence and frequency."""
        if self.rep_factor is not None and self.hist_idx.shape[1]:
            v = logits.gather(1, self.hist_idx)
            r = self.rep_factor
            logits.scatter_(1, self.hist_idx, torch.where(v > 0, v / r, v * r))
        if not self.out_idx.shape[1]:
            return
        if self.presence is not None:
            logits.scatter_(1, self.out_idx, logits.gather(1, self.out_idx) - self.presence)
        if self.frequency is not None:
            logits.scatter_add_(1, self.out_idx, self.out_weight * -self.frequency)


def _padded(lists: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """[len(lists), max len] long tensor; each row padded with its first token (0 if empty)."""
    width = max((len(lst) for lst in lists), default=0)
    rows = [list(lst) + [lst[0] if lst else 0] * (width - len(lst)) for lst in lists]
    return torch.tensor(rows, dtype=torch.long, device=device).reshape(len(lists), width)


def _grow(table: torch.Tensor, width: int, first: list[tuple[int, int]]) -> torch.Tensor:
    """``table`` widened (by doubling) to ``width``; rows in ``first`` refilled with their token.

    New columns repeat each row's column 0, keeping every spare column a duplicate.
    """
    if table.shape[1] < width:
        extra = max(width, 2 * table.shape[1], 16) - table.shape[1]
        block = table[:, :1].expand(-1, extra) if table.shape[1] else table.new_zeros(table.shape[0], extra)
        table = torch.cat([table, block], dim=1)
    if first:
        rows, toks = zip(*first)
        table[long_tensor(rows, table.device)] = long_tensor(toks, table.device).unsqueeze(1)
    return table


def _write(table: torch.Tensor, entries: list[tuple[int, int, int]]) -> None:
    rows, cols, vals = zip(*entries)
    dev = table.device
    table[long_tensor(rows, dev), long_tensor(cols, dev)] = long_tensor(vals, dev)
