"""Batched sampler: one row of logits per request in, one token per request out.

Order follows vLLM v1 (reference §3.11) so results mean the same thing:

1. If any row asked for logprobs, take them from the *raw* model distribution
   (``log_softmax`` of the logits as given, before bias, penalties or
   temperature). This is vLLM's default ``raw_logprobs`` mode: the numbers
   describe the model, not the sampling transform.
2. Logit processors on float32 logits: ``logit_bias``, ``min_tokens`` (stop ids
   masked while too few tokens were generated), then penalties (repetition,
   frequency, presence). Penalties come before temperature so their strength
   does not scale with it.
3. Greedy rows (temperature ~ 0, or top_k == 1) take the argmax, exact and
   independent of the other rows. Random rows apply temperature, top-k, top-p,
   min-p and draw one token.

Choices made for CPU speed (the reference targets GPUs):

- The draw is an inverse-CDF lookup with one uniform number per row, instead of
  an exponential race that needs a random number per vocabulary entry (~10x
  slower over 49k tokens). A seeded row takes exactly one number from its own
  generator per step, so its tokens do not depend on the rest of the batch.
- Rows with top-k or top-p sample among their top candidates (a partial
  top-k: 256, then 4096), not a full sort, which is ~30x slower; only a row
  whose top-p nucleus is wider than that sorts its whole row.
- Penalties touch only the tokens each row has seen, through per-row token
  tables, never a dense [rows, vocab] count table.
- Full-size temporaries are avoided where it is easy: fresh 50 MB tensors cost
  page faults that can exceed the arithmetic done on them.
- The argmax of float32 CPU rows is aiolm's kernel (ext/cpu/argmax.cpp, the
  same indices as ``torch.argmax``): torch's reads ~4 GB/s over the vocabulary.

All per-batch state lives in :class:`SamplingMetadata`, built once per batch
composition and advanced cheaply after each step; :class:`Sampler` is stateless.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from aiolm.core.outputs import LogprobsLists
from aiolm.kernels import cpu as cpu_kernels
from aiolm.params import SamplingParams

_NEG_INF = float("-inf")
# Candidates searched for a top-p nucleus before falling back to a full sort.
# On CPU, over 49k logits: top-256 ~ 3x a softmax, top-4096 ~ 10x, a full sort ~ 60x.
_TOP_P_CANDIDATES = 256
_WIDE_CANDIDATES = 4096


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A per-request generator, seeded once when the request joins the batch."""
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(seed)
    return gen


def _long(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.long, device=device)


def _col(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.float32, device=device).unsqueeze(1)


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1) of float32 logits [rows, vocab]."""
    if cpu_kernels.ready(x) and x.dim() == 2 and x.shape[1] > 0 and x.stride(1) == 1:
        return torch.ops.aiolm.argmax_rows(x)
    return x.argmax(dim=-1)


# --- per-batch state ---------------------------------------------------------------------

class Penalties:
    """Repetition/frequency/presence state as per-row token tables, not [rows, vocab].

    ``hist`` [N, W] holds each repetition-penalised row's prompt and output
    tokens; ``out`` holds each frequency/presence-penalised row's output tokens,
    one column per occurrence. Repeated tokens need no dedup: the repetition
    and presence updates are written with ``scatter_`` from one ``gather``
    taken before the write, so duplicate columns write the same number, and
    the frequency update adds one ``-frequency`` per occurrence. Spare columns
    repeat the row's first token (a duplicate); a row with no tokens yet has a
    neutral factor so its spare columns change nothing. Row-wise gather/scatter
    on these tables is ~10x cheaper on CPU than flat advanced indexing, and
    nothing here walks the tokens in Python.
    """

    def __init__(self, params: Sequence[SamplingParams], outputs: Sequence[Sequence[int]],
                 prompts: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> None:
        n = len(params)
        self.vocab_size = vocab_size
        self.device = device
        self._rep = [p.repetition_penalty for p in params]
        self._pres = [p.presence_penalty for p in params]
        freq = [p.frequency_penalty for p in params]
        self._use_hist = [r != 1.0 for r in self._rep]
        self._use_out = [bool(f or pr) for f, pr in zip(freq, self._pres)]
        self.frequency = _col(freq, device) if any(freq) else None
        hist = [self._in_vocab(itertools.chain(prompts[i], outputs[i])) if self._use_hist[i] else []
                for i in range(n)]
        out = [self._in_vocab(outputs[i]) if self._use_out[i] else [] for i in range(n)]
        self._hist_len = [len(h) for h in hist]
        self._out_len = [len(o) for o in out]
        # Factors are neutral until a row has a token, so its padding is a no-op.
        self.rep_factor = (_col([r if h else 1.0 for r, h in zip(self._rep, hist)], device)
                           if any(self._use_hist) else None)
        self.presence = (_col([pr if o else 0.0 for pr, o in zip(self._pres, out)], device)
                         if any(self._pres) else None)
        self.hist_idx = _padded(hist, device)
        self.out_idx = _padded(out, device)
        # 1 per real occurrence, 0 for padding: what the frequency penalty counts.
        self.out_weight = (self.out_idx.new_tensor(self._out_len).unsqueeze(1)
                           > torch.arange(self.out_idx.shape[1], device=device)).float()

    def _in_vocab(self, tokens: Iterable[int]) -> list[int]:
        """Ids outside the vocabulary are dropped (they can only come from a bad prompt)."""
        lst = list(tokens)
        if lst and (min(lst) < 0 or max(lst) >= self.vocab_size):
            lst = [t for t in lst if 0 <= t < self.vocab_size]
        return lst

    @classmethod
    def build(cls, params: Sequence[SamplingParams], outputs: Sequence[Sequence[int]],
              prompts: Sequence[Sequence[int]], vocab_size: int,
              device: torch.device) -> Penalties | None:
        """None when no row uses a penalty, so the sampler skips the pass entirely."""
        if all(p.repetition_penalty == 1.0 and not p.frequency_penalty and not p.presence_penalty
               for p in params):
            return None
        return cls(params, outputs, prompts, vocab_size, device)

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
                self.rep_factor[_long(rows, self.device)] = _col([self._rep[r] for r in rows], self.device)
        if out_w:
            self.out_idx = _grow(self.out_idx, max(self._out_len), out_first)
            _write(self.out_idx, out_w)
            width = self.out_idx.shape[1]
            if self.out_weight.shape[1] < width:
                pad = self.out_weight.new_zeros(self.out_weight.shape[0], width - self.out_weight.shape[1])
                self.out_weight = torch.cat([self.out_weight, pad], dim=1)
            rows, cols, _ = zip(*out_w)
            self.out_weight[_long(rows, self.device), _long(cols, self.device)] = 1.0
            if out_first and self.presence is not None:
                first = [r for r, _ in out_first]
                self.presence[_long(first, self.device)] = _col([self._pres[r] for r in first],
                                                                self.device)

    def apply(self, x: torch.Tensor) -> None:
        """Penalise ``x`` in place: repetition first, then presence and frequency."""
        if self.rep_factor is not None and self.hist_idx.shape[1]:
            v = x.gather(1, self.hist_idx)
            r = self.rep_factor
            x.scatter_(1, self.hist_idx, torch.where(v > 0, v / r, v * r))
        if not self.out_idx.shape[1]:
            return
        if self.presence is not None:
            x.scatter_(1, self.out_idx, x.gather(1, self.out_idx) - self.presence)
        if self.frequency is not None:
            x.scatter_add_(1, self.out_idx, self.out_weight * -self.frequency)


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
        block = (table[:, :1].expand(-1, extra) if table.shape[1]
                 else table.new_zeros(table.shape[0], extra))
        table = torch.cat([table, block], dim=1)
    if first:
        rows, toks = zip(*first)
        table[_long(rows, table.device)] = _long(toks, table.device).unsqueeze(1)
    return table


def _write(table: torch.Tensor, entries: list[tuple[int, int, int]]) -> None:
    rows, cols, vals = zip(*entries)
    dev = table.device
    table[_long(rows, dev), _long(cols, dev)] = _long(vals, dev)


@dataclass
class Knobs:
    """Per-row sampling settings for a set of random rows, as [n, 1] columns.

    A field is None when no row in the set uses it; otherwise rows that do not
    use it hold the neutral value (temperature 1, top_k vocab_size, top_p 1, min_p 0).
    """

    temperature: torch.Tensor | None
    top_k: torch.Tensor | None  # long
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None

    @classmethod
    def build(cls, params: Sequence[SamplingParams], vocab_size: int, device: torch.device) -> Knobs:
        def k(p: SamplingParams) -> int:
            return p.top_k if 0 < p.top_k < vocab_size else vocab_size

        return cls(
            temperature=None if all(p.temperature == 1.0 for p in params)
            else _col([p.temperature for p in params], device),
            top_k=None if all(k(p) == vocab_size for p in params)
            else _long([k(p) for p in params], device).unsqueeze(1),
            top_p=None if all(p.top_p >= 1.0 for p in params)
            else _col([p.top_p for p in params], device),
            min_p=None if all(p.min_p == 0.0 for p in params)
            else _col([p.min_p for p in params], device),
        )

    def select(self, idx: torch.Tensor) -> Knobs:
        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[idx]

        return Knobs(pick(self.temperature), pick(self.top_k), pick(self.top_p), pick(self.min_p))


@dataclass
class RandomRows:
    """The non-greedy rows, split into those that filter by top-k/top-p and plain ones."""

    rows: torch.Tensor | None  # batch rows that sample (None: all rows)
    row_list: list[int]
    generators: list[torch.Generator | None]  # per random row; None: shared default
    knobs: Knobs  # aligned to row_list
    cand_pos: torch.Tensor | None  # positions (in row_list) with top-k or top-p; None: none
    cand_knobs: Knobs | None
    cand_widths: list[int]  # candidate counts to try in turn (first covers every top_k)
    plain_pos: torch.Tensor | None  # positions without either; None: none

    @classmethod
    def build(cls, params: Sequence[SamplingParams], rows: list[int],
              generators: Sequence[torch.Generator | None], vocab_size: int,
              device: torch.device) -> RandomRows:
        ps = [params[i] for i in rows]

        def has_k(p: SamplingParams) -> bool:
            return 0 < p.top_k < vocab_size

        cand = [j for j, p in enumerate(ps) if has_k(p) or p.top_p < 1.0]
        plain = [j for j, p in enumerate(ps) if not (has_k(p) or p.top_p < 1.0)]
        width = max((ps[j].top_k for j in cand if has_k(ps[j])), default=0)
        if any(not has_k(ps[j]) for j in cand):
            width = max(width, _TOP_P_CANDIDATES)
        first = min(width, vocab_size)
        knobs = Knobs.build(ps, vocab_size, device)
        cand_pos = _long(cand, device) if cand else None
        return cls(
            rows=None if len(rows) == len(params) else _long(rows, device),
            row_list=rows,
            generators=[generators[i] for i in rows],
            knobs=knobs,
            cand_pos=cand_pos,
            cand_knobs=None if cand_pos is None else knobs.select(cand_pos),
            cand_widths=[first] + ([_WIDE_CANDIDATES] if first < _WIDE_CANDIDATES < vocab_size else []),
            plain_pos=_long(plain, device) if plain else None,
        )


@dataclass
class SamplingMetadata:
    """Everything the sampler needs for one batch composition, as ready-made tensors.

    Build with :meth:`build` when the batch's rows change; call :meth:`advance`
    with each step's new tokens so penalties and ``min_tokens`` stay current
    without a rebuild.
    """

    num_reqs: int
    vocab_size: int
    device: torch.device
    all_greedy: bool
    any_greedy: bool  # some rows take the argmax (all of them when all_greedy)
    random: RandomRows | None
    default_generator: torch.Generator | None
    # logit_bias as flat (row, token, bias) triples.
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    # min_tokens as flat (row, stop token, min_tokens) triples, active while len(output) < limit.
    min_tokens: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    output_lens: torch.Tensor  # long [N]
    penalties: Penalties | None
    num_logprobs: list[int | None]  # per row: None, or N top logprobs besides the sampled one
    logprob_rows: torch.Tensor | None  # rows that asked (None: all rows, when any asked)
    logprob_row_list: list[int]
    max_num_logprobs: int

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        output_token_ids: Sequence[Sequence[int]],
        prompt_token_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device | str = "cpu",
        generators: Sequence[torch.Generator | None] | None = None,
        default_generator: torch.Generator | None = None,
    ) -> SamplingMetadata:
        """Turn per-request params and token histories into batch tensors.

        ``generators[i]`` is row i's own generator (requests with a seed; see
        :func:`make_generator`) or None to draw from ``default_generator``
        (torch's global generator when that is None too). Token ids outside
        ``[0, vocab_size)`` in ``logit_bias`` or stop ids are ignored: the API
        edge is where they should be rejected.
        """
        n = len(params)
        if len(output_token_ids) != n or len(prompt_token_ids) != n:
            raise ValueError("params, output_token_ids and prompt_token_ids differ in length")
        if generators is None:
            generators = [None] * n
        elif len(generators) != n:
            raise ValueError("generators must have one entry per row")
        dev = torch.device(device)
        greedy = [p.greedy or p.top_k == 1 for p in params]
        random_list = [i for i in range(n) if not greedy[i]]
        num_logprobs = [p.logprobs for p in params]
        lp_rows = [i for i in range(n) if num_logprobs[i] is not None]
        return cls(
            num_reqs=n,
            vocab_size=vocab_size,
            device=dev,
            all_greedy=not random_list,
            any_greedy=any(greedy),
            random=RandomRows.build(params, random_list, generators, vocab_size, dev)
            if random_list else None,
            default_generator=default_generator,
            bias=_build_bias(params, vocab_size, dev),
            min_tokens=_build_min_tokens(params, output_token_ids, vocab_size, dev),
            output_lens=_long([len(o) for o in output_token_ids], dev),
            penalties=Penalties.build(params, output_token_ids, prompt_token_ids, vocab_size, dev),
            num_logprobs=num_logprobs,
            logprob_rows=_long(lp_rows, dev) if lp_rows and len(lp_rows) < n else None,
            logprob_row_list=lp_rows,
            max_num_logprobs=max((num_logprobs[i] or 0 for i in lp_rows), default=0),
        )

    def advance(self, new_token_ids: Sequence[Sequence[int]]) -> None:
        """Record tokens appended to each row (empty list: none) since the last step."""
        if len(new_token_ids) != self.num_reqs:
            raise ValueError("new_token_ids must have one entry per row")
        lens = [len(t) for t in new_token_ids]
        if not any(lens):
            return
        self.output_lens += _long(lens, self.device)
        if self.penalties is not None:
            self.penalties.advance(new_token_ids)


def _build_bias(params: Sequence[SamplingParams], vocab_size: int,
                dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    toks: list[int] = []
    vals: list[float] = []
    for i, p in enumerate(params):
        for tok, val in (p.logit_bias or {}).items():
            if 0 <= tok < vocab_size and val != 0.0:
                rows.append(i)
                toks.append(tok)
                vals.append(val)
    if not rows:
        return None
    return _long(rows, dev), _long(toks, dev), _col(vals, dev).squeeze(1)


def _build_min_tokens(params: Sequence[SamplingParams], outputs: Sequence[Sequence[int]],
                      vocab_size: int, dev: torch.device
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    toks: list[int] = []
    limits: list[int] = []
    for i, p in enumerate(params):
        if len(outputs[i]) >= p.min_tokens:
            continue  # output only grows: this row can never become active again
        for tok in sorted(p.stop_ids()):
            if 0 <= tok < vocab_size:
                rows.append(i)
                toks.append(tok)
                limits.append(p.min_tokens)
    if not rows:
        return None
    return _long(rows, dev), _long(toks, dev), _long(limits, dev)


# --- sampling ----------------------------------------------------------------------------

@dataclass
class SamplerOutput:
    """Sampled token per row and, when any row asked, logprobs aligned to rows.

    ``logprobs`` has one entry per batch row; rows that did not ask have empty
    lists and rank 0. Each asking row lists the sampled token first, then its
    top-N raw logprobs (the sampled token may appear again among those).
    """

    sampled: torch.Tensor  # long [num_reqs]
    logprobs: LogprobsLists | None

    def row_logprobs(self, row: int) -> LogprobsLists | None:
        """Row ``row``'s logprobs as a one-token LogprobsLists, or None if it did not ask."""
        lp = self.logprobs
        if lp is None or not lp.token_ids[row]:
            return None
        return LogprobsLists([lp.token_ids[row]], [lp.logprobs[row]], [lp.ranks[row]])


class Sampler:
    """Stateless: all batch state is in the SamplingMetadata passed to each call."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata,
                 skip_rng_rows: Sequence[int] = ()) -> SamplerOutput:
        """Pick one token per row of ``logits`` ([num_reqs, vocab], any float dtype).

        ``skip_rng_rows`` lists rows whose token will be thrown away (a chunked
        prefill that is not finished): their own generators are left untouched,
        so a seeded request's tokens do not depend on how its prompt was chunked.
        The input tensor is never modified.
        """
        m = metadata
        if logits.dim() != 2 or logits.shape[0] != m.num_reqs or logits.shape[1] != m.vocab_size:
            raise ValueError(f"logits shape {tuple(logits.shape)} does not match metadata "
                             f"({m.num_reqs}, {m.vocab_size})")
        plain_greedy = (m.all_greedy and m.bias is None and m.min_tokens is None
                        and m.penalties is None)
        # One float32 tensor serves the raw logprobs and the processors; it is a
        # copy whenever something will write to it. Upcasting is exact, so argmax
        # is unchanged, and fp32 argmax is ~3x faster than bf16 on CPU.
        x = logits.float() if plain_greedy else logits.to(torch.float32, copy=True)
        raw_logprobs = None
        if m.logprob_row_list:
            src = x if m.logprob_rows is None else x.index_select(0, m.logprob_rows)
            raw_logprobs = torch.log_softmax(src, dim=-1)

        if plain_greedy:
            sampled = _argmax(x)
        else:
            _apply_bias(x, m)
            _apply_min_tokens(x, m)
            if m.penalties is not None:
                m.penalties.apply(x)
            sampled = _sample(x, m, set(skip_rng_rows))

        lp = None if raw_logprobs is None else _gather_logprobs(raw_logprobs, sampled, m)
        return SamplerOutput(sampled=sampled, logprobs=lp)


def _apply_bias(x: torch.Tensor, m: SamplingMetadata) -> None:
    if m.bias is not None:
        rows, toks, vals = m.bias
        x.index_put_((rows, toks), vals, accumulate=True)


def _apply_min_tokens(x: torch.Tensor, m: SamplingMetadata) -> None:
    if m.min_tokens is None:
        return
    rows, toks, limits = m.min_tokens
    active = m.output_lens[rows] < limits
    # Adding -inf or 0 avoids a data-dependent boolean index (a device sync on GPU).
    delta = torch.zeros(rows.shape, dtype=x.dtype, device=x.device).masked_fill_(active, _NEG_INF)
    x.index_put_((rows, toks), delta, accumulate=True)


def _sample(x: torch.Tensor, m: SamplingMetadata, skip: set[int]) -> torch.Tensor:
    """Greedy rows: argmax of the processed logits. Random rows: filtered draw."""
    if m.all_greedy:
        return _argmax(x)
    rnd = m.random
    assert rnd is not None
    greedy = _argmax(x) if m.any_greedy else None
    uniforms = _draw_uniforms(rnd, m.default_generator, skip, x.device)
    # index_select: ~2x faster than x[rows] for whole rows on CPU.
    xr = x if rnd.rows is None else x.index_select(0, rnd.rows)
    drawn = _sample_random(xr, rnd, uniforms)
    if greedy is None:
        return drawn
    greedy[rnd.rows] = drawn
    return greedy


def _sample_random(xr: torch.Tensor, rnd: RandomRows, u: torch.Tensor) -> torch.Tensor:
    """Draw for every random row; ``xr`` is owned and may be modified.

    Rows with top-k/top-p try each candidate width in turn; rows whose nucleus
    is wider than the last one, and plain rows, sample over the full vocabulary.
    """
    if rnd.cand_pos is None:
        return _sample_full(xr, rnd.knobs, u)
    assert rnd.cand_knobs is not None
    pos: torch.Tensor | None = rnd.cand_pos
    kn = rnd.cand_knobs
    out: torch.Tensor | None = None
    for width in rnd.cand_widths:
        assert pos is not None
        whole = out is None and rnd.plain_pos is None  # pos is every random row
        tok, fits = _sample_candidates(xr if whole else xr.index_select(0, pos), kn, width, u[pos])
        missing = (~fits).nonzero().squeeze(1)
        if whole and not missing.numel():
            return tok
        if out is None:
            out = torch.empty(xr.shape[0], dtype=torch.long, device=xr.device)
        out[pos] = tok  # rows that did not fit are overwritten below
        if not missing.numel():
            pos = None
            break
        pos, kn = pos[missing], kn.select(missing)
    assert out is not None
    full = [t for t in (rnd.plain_pos, pos) if t is not None]
    if full:
        rows = torch.cat(full)
        out[rows] = _sample_full(xr.index_select(0, rows), rnd.knobs.select(rows), u[rows])
    return out


def _sample_candidates(x: torch.Tensor, kn: Knobs, width: int,
                       u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample rows with top-k/top-p among their ``width`` most likely tokens.

    Returns the tokens and, per row, whether the candidates held the whole
    kept set; rows where they did not (a top-p nucleus wider than ``width``)
    must be redone by :func:`_sample_full`. Top-k keeps exactly k tokens (ties
    at the k-th value are broken by position).
    """
    vocab = x.shape[1]
    vals, idx = x.topk(width, dim=-1)
    if kn.temperature is not None:
        vals = vals / kn.temperature
    has_k = torch.zeros(x.shape[0], 1, dtype=torch.bool, device=x.device)
    if kn.top_k is not None:
        vals.masked_fill_(torch.arange(width, device=x.device) >= kn.top_k, _NEG_INF)
        has_k = kn.top_k < vocab
    probs = torch.softmax(vals, dim=-1)  # exact for top-k rows: all their mass is here
    no_k = (~has_k).squeeze(1).nonzero().squeeze(1)
    if no_k.numel():
        # Top-p-only rows: candidate probabilities relative to the full vocabulary.
        top = vals[no_k]
        temp = None if kn.temperature is None else kn.temperature[no_k]
        z = _softmax_normaliser(x, no_k, top[:, :1], temp)
        probs[no_k] = (top - top[:, :1]).exp_().div_(z)
    fits = has_k
    if kn.top_p is not None:
        top_p = kn.top_p
        cum = probs.cumsum(dim=-1)
        fits = has_k | (top_p >= 1.0) | (cum[:, -1:] >= top_p)
        drop = ((cum - probs) >= top_p) & (top_p < 1.0)  # mass before already reaches top_p
        drop[:, 0] = False
        probs.masked_fill_(drop, 0.0)
    if kn.min_p is not None:
        probs.masked_fill_(probs < probs[:, :1] * kn.min_p, 0.0)  # column 0 is the max
    choice = _inverse_cdf(probs, u)
    return idx.gather(1, choice.unsqueeze(1)).squeeze(1), fits.squeeze(1)


def _softmax_normaliser(x: torch.Tensor, rows: torch.Tensor, row_max: torch.Tensor,
                        temperature: torch.Tensor | None, chunk: int = 16) -> torch.Tensor:
    """sum(exp(x[row] / t - max)) for each row in ``rows``, as a [k, 1] column.

    Goes through one small reused buffer, chunk by chunk: ``x`` must stay intact
    (a wider pass may redo some rows) and a full-size temporary would cost more
    in page faults than the exponentials do.
    """
    z = torch.empty(rows.numel(), 1, dtype=x.dtype, device=x.device)
    buf = torch.empty(min(chunk, rows.numel()), x.shape[1], dtype=x.dtype, device=x.device)
    for start in range(0, rows.numel(), chunk):
        end = min(start + chunk, rows.numel())
        b = buf[: end - start]
        torch.index_select(x, 0, rows[start:end], out=b)
        if temperature is not None:
            b.div_(temperature[start:end])
        b.sub_(row_max[start:end]).exp_()
        torch.sum(b, dim=-1, keepdim=True, out=z[start:end])
    return z


def _sample_full(x: torch.Tensor, kn: Knobs, u: torch.Tensor) -> torch.Tensor:
    """Sample over the whole vocabulary. Top-k rows never get here.

    Works in place on ``x`` (owned): large fresh allocations are costly on CPU
    (page faults), and the draw does not need normalised probabilities.
    """
    if kn.temperature is not None:
        x.div_(kn.temperature)
    probs = x.sub_(x.amax(dim=-1, keepdim=True)).exp_()  # unnormalised; each row's max is 1
    if kn.top_p is not None:
        rows = (kn.top_p < 1.0).squeeze(1).nonzero().squeeze(1)
        if rows.numel():
            sub = probs.index_select(0, rows)
            sub.div_(sub.sum(dim=-1, keepdim=True))
            sorted_p, sorted_idx = sub.sort(dim=-1, descending=True)
            cum = sorted_p.cumsum(dim=-1)
            drop = (cum - sorted_p) >= kn.top_p[rows]
            drop[:, 0] = False
            remove = torch.zeros_like(drop).scatter_(1, sorted_idx, drop)
            probs.index_copy_(0, rows, sub.masked_fill_(remove, 0.0))
    if kn.min_p is not None:
        # Relative to each row's max (1 here, or unchanged by the top-p rescale).
        probs.masked_fill_(probs < probs.amax(dim=-1, keepdim=True) * kn.min_p, 0.0)
    return _inverse_cdf(probs, u)


def _draw_uniforms(rnd: RandomRows, default: torch.Generator | None, skip: set[int],
                   device: torch.device) -> torch.Tensor:
    """One U[0,1) float64 per random row, from that row's own generator when it has one."""
    n = len(rnd.row_list)
    gen_dev = default.device if default is not None else device
    unseeded = [j for j, g in enumerate(rnd.generators) if g is None]
    if len(unseeded) == n:
        return torch.rand(n, dtype=torch.float64, generator=default, device=gen_dev).to(device)
    u = torch.full((n,), 0.5, dtype=torch.float64, device=device)  # 0.5: skipped rows
    if unseeded:
        vals = torch.rand(len(unseeded), dtype=torch.float64, generator=default, device=gen_dev)
        u[_long(unseeded, device)] = vals.to(device)
    pos: list[int] = []
    draws: list[torch.Tensor] = []
    for j, (row, gen) in enumerate(zip(rnd.row_list, rnd.generators)):
        if gen is not None and row not in skip:
            pos.append(j)
            draws.append(torch.rand(1, dtype=torch.float64, generator=gen, device=gen.device).to(device))
    if pos:
        u[_long(pos, device)] = torch.cat(draws)
    return u


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative mass exceeds u * total (probs unnormalised).

    Zero-probability entries are never chosen: their cumulative value equals the
    previous entry's, so the previous one is found first. ``probs`` is consumed.
    """
    cdf = probs.cumsum_(dim=-1)
    total = cdf[:, -1:]
    target = (uniforms.unsqueeze(1) * total.double()).float()
    # u < 1, but rounding could reach the total; stay strictly below it.
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return idx.clamp_(max=probs.shape[1] - 1)


def _gather_logprobs(raw: torch.Tensor, sampled: torch.Tensor, m: SamplingMetadata) -> LogprobsLists:
    """Sampled token's raw logprob and rank, then each row's top-N, aligned to batch rows."""
    tok = sampled if m.logprob_rows is None else sampled[m.logprob_rows]
    tok_lp = raw.gather(1, tok.unsqueeze(1))
    # Summing bytes of the bool mask is ~2x cheaper on CPU than summing the bools.
    ranks = ((raw > tok_lp).view(torch.uint8).sum(dim=-1, dtype=torch.int32) + 1).tolist()
    tok_list = tok.tolist()
    tok_lp_list = tok_lp.squeeze(1).tolist()
    top_ids_l: list[list[int]] = []
    top_lp_l: list[list[float]] = []
    if m.max_num_logprobs > 0:
        top_lp, top_ids = raw.topk(m.max_num_logprobs, dim=-1)
        top_lp_l, top_ids_l = top_lp.tolist(), top_ids.tolist()
    token_ids: list[list[int]] = [[] for _ in range(m.num_reqs)]
    logprobs: list[list[float]] = [[] for _ in range(m.num_reqs)]
    out_ranks = [0] * m.num_reqs
    for j, row in enumerate(m.logprob_row_list):
        k = m.num_logprobs[row] or 0
        token_ids[row] = [tok_list[j]] + (top_ids_l[j][:k] if k else [])
        logprobs[row] = [tok_lp_list[j]] + (top_lp_l[j][:k] if k else [])
        out_ranks[row] = ranks[j]
    return LogprobsLists(token_ids=token_ids, logprobs=logprobs, ranks=out_ranks)
