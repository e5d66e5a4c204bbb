"""``structured_outputs``: a row may only pick tokens its grammar allows next.

Each constrained request has an xgrammar matcher that has accepted exactly the
row's output tokens. Build does not replay a whole output per rebuild (rows
join and leave every few steps under continuous batching): the matcher lives
in a per-process table keyed by the row's SamplingParams object, which the
persistent batch holds for the request's lifetime (a resumed request arrives
with a new one and starts over), and build only feeds it the tokens it has not
seen. When the grammar is complete only the row's stop tokens stay allowed, so
the request ends with finish_reason "stop" through the ordinary stop-token path.

Filling the bitmask is host work per row (the matcher walks its own state),
done by xgrammar for all rows at once on as many threads as torch uses. The
bitmask has a row per batch row, and only constrained rows are filled and
masked, so unconstrained rows cost nothing and no logits are gathered or
scattered. The mask is applied where the logits are
(``aiolm.kernels.sampling_ops.apply_token_bitmask_``), with nothing read back.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from aiolm.kernels.sampling_ops import apply_token_bitmask_
from aiolm.params import SamplingParams
from aiolm.sample.logits_processors.interface import BatchRows, LogitsProcessor
from aiolm.structured.backend import Compiler
from aiolm.structured.backend import xgrammar_module as _xgr

log = logging.getLogger(__name__)


class _RowMatcher:
    """A matcher and how many output tokens it has seen. With ``after`` (a reasoning
    model's end-of-thinking tokens) the grammar starts once the output holds them: until
    then tokens pass it by and the row is not masked."""

    def __init__(self, params: SamplingParams, vocab_size: int) -> None:
        spec = params.structured_outputs
        assert spec is not None
        compiled = Compiler.compile(spec, vocab_size)
        stops = sorted(params.stop_ids()) or None  # None: the tokenizer's own EOS
        self.matcher = _xgr().GrammarMatcher(compiled, override_stop_tokens=stops)
        self.stop_tokens = list(self.matcher.stop_token_ids)
        self.accepted = 0
        self.after = list(spec.after)
        self.started = not self.after
        self.recent: list[int] = []  # the last len(after) tokens while not started
        # the first token decides: the thinking's opening marker, or the grammar's first token
        self.opens = list(spec.opens[:1]) if self.after else []
        self.undecided = bool(self.opens)

    def fill_stop_only(self, bitmask: torch.Tensor, row: int) -> None:
        """Past its stop token (a row that ignores EOS keeps going) the grammar has nothing
        left to allow but its stop tokens; xgrammar refuses to fill a terminated matcher."""
        bitmask[row] = 0
        for t in self.stop_tokens:
            allow(bitmask, row, t)

    def catch_up(self, output: Sequence[int]) -> None:
        for t in output[self.accepted :]:
            self.accept(t)

    def accept(self, token: int) -> None:
        self.accepted += 1
        if self.undecided:
            self.undecided = False
            if int(token) == self.opens[0]:
                return  # it thinks: the grammar waits for the end marker
            self.started = True  # it does not: the grammar takes this token on
        if not self.started:
            self.recent = [*self.recent, int(token)][-len(self.after) :]
            self.started = self.recent == self.after
            return
        # A refused token (one after the stop token, or a forced pick when min_tokens banned
        # every allowed one) leaves the matcher where it was; the row is ending either way.
        if not self.matcher.is_terminated():
            self.matcher.accept_token(int(token))


def allow(bitmask: torch.Tensor, row: int, token: int) -> None:
    """Set ``token``'s bit in ``row`` of an xgrammar bitmask (int32 words, two's complement)."""
    word, bit = divmod(token, 32)
    bitmask[row, word] |= (1 << bit) - (1 << 32 if bit == 31 else 0)


_matchers: dict[int, tuple[weakref.ref, _RowMatcher]] = {}
_filler: list[Any] = []


def _batch_filler() -> Any:
    if not _filler:
        _filler.append(_xgr().BatchGrammarMatcher(max_threads=max(1, torch.get_num_threads())))
    return _filler[0]


def _matcher_for(params: SamplingParams, output: Sequence[int], vocab_size: int) -> _RowMatcher:
    key = id(params)
    entry = _matchers.get(key)
    if entry is None or entry[0]() is not params or entry[1].accepted > len(output):
        m = _RowMatcher(params, vocab_size)
        _matchers[key] = (weakref.ref(params), m)
        weakref.finalize(params, _matchers.pop, key, None)
        entry = _matchers[key]
    entry[1].catch_up(output)
    return entry[1]


class Grammar(LogitsProcessor):
    """Masks each constrained row's logits with its matcher's next-token bitmask."""

    name = "grammar"

    def __init__(self, rows: list[int], matchers: list[_RowMatcher], num_rows: int, vocab_size: int) -> None:
        self.rows = rows
        self.matchers = matchers
        self.bitmask = _xgr().allocate_token_bitmask(num_rows, vocab_size)  # host, int32, a row per batch row
        self.masked_rows = None if len(rows) == num_rows else rows  # None: every row

    @classmethod
    def build(cls, rows: BatchRows) -> Grammar | None:
        idx: list[int] = []
        matchers: list[_RowMatcher] = []
        for i, (p, out) in enumerate(zip(rows.params, rows.output_token_ids)):
            if p.structured_outputs is None:
                continue
            try:
                m = _matcher_for(p, out, rows.vocab_size)
            except Exception:  # the engine compiled this text already: cannot happen, must not kill the step
                log.exception(
                    "structured outputs: the worker could not compile a grammar the engine accepted; "
                    "row %d runs unconstrained",
                    i,
                )
                continue
            idx.append(i)
            matchers.append(m)
        if not idx:
            return None
        return cls(idx, matchers, len(rows), rows.vocab_size)

    def advance(self, new_token_ids: Sequence[Sequence[int]]) -> None:
        for j, i in enumerate(self.rows):
            for t in new_token_ids[i]:
                self.matchers[j].accept(t)

    def apply(self, logits: torch.Tensor) -> None:
        self.fill()
        self.mask(logits)

    def fill(self) -> None:
        """The next-token bitmask of every constrained row (host work)."""
        live_rows: list[int] = []
        live: list[_RowMatcher] = []
        for i, m in zip(self.rows, self.matchers):
            if not m.started and not m.undecided:
                self.bitmask[i] = -1  # every bit set: the row is free while the model thinks
            elif m.started and m.matcher.is_terminated():
                m.fill_stop_only(self.bitmask, i)
            else:  # the grammar's next tokens (undecided: its first, and the thinking's opening marker)
                live_rows.append(i)
                live.append(m)
        if not live:
            return
        # xgrammar fills the rows on its own threads, as many as torch computes with
        _batch_filler().batch_fill_next_token_bitmask([m.matcher for m in live], self.bitmask, indices=live_rows)
        empty = (~self.bitmask[live_rows].any(dim=1)).tolist()  # one pass for the batch
        for i, m, none in zip(live_rows, live, empty):
            if m.undecided:
                allow(self.bitmask, i, m.opens[0])
            elif none:
                # No token can go on (the grammar's text has no spelling in this vocabulary): the
                # row ends at its stop tokens, where a draw from an all-masked row took token 0.
                log.warning("structured outputs: no token of the vocabulary continues the grammar; the row ends")
                m.fill_stop_only(self.bitmask, i)

    def mask(self, logits: torch.Tensor) -> None:
        """-inf on the tokens the filled bitmask forbids, constrained rows only. A row another
        processor's ban leaves with nothing (min_tokens on the stop tokens a finished grammar
        allows, allowed_token_ids apart from the grammar's) ends at its stop tokens, where a
        draw from an all-masked row took token 0."""
        apply_token_bitmask_(logits, self.bitmask, self.masked_rows)
        rows = torch.tensor(self.rows, device=logits.device)
        dead = torch.isneginf(logits.index_select(0, rows)).all(dim=1).nonzero().flatten().tolist()
        for k in dead:
            logits[self.rows[k], self.matchers[k].stop_tokens] = 0.0
