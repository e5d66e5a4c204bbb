"""Batched sampler: one row of logits per request in, one token per request out.

The order follows vLLM v1's sampler, so results mean the same thing:

1. If any row asked for logprobs, take them from the *raw* model distribution
   (``log_softmax`` of the logits as given, before any processor or
   temperature). This is vLLM's default ``raw_logprobs`` mode: the numbers
   describe the model, not the sampling transform.
2. The logits processors some row uses (``logits_processors/``: bias,
   min_tokens, penalties, ...), in registry order, on float32 logits. They come
   before temperature so a penalty's strength does not scale with it. The
   sampler knows them only through the contract in
   ``logits_processors/interface.py``.
3. Greedy rows (temperature ~ 0, or top_k == 1) take the argmax, exact and
   independent of the other rows. Random rows apply temperature, then min-p,
   top-k and top-p over what min-p kept, and draw one token.

Choices made for CPU speed (vLLM's sampler targets GPUs):

- The draw is an inverse-CDF lookup with one uniform number per row, instead of
  an exponential race that needs a random number per vocabulary entry (far
  slower over a large vocabulary). A seeded row takes exactly one number from its own
  generator per step, so its tokens do not depend on the rest of the batch as long as its
  logits do not: a batch of another size may sum the float32 logits in another order, and
  a draw that lands that close to the edge between two tokens' probability can move.
- Rows with top-k or top-p sample among their top candidates (a partial
  top-k, 256 or the largest top-k), not a full sort, which costs many times more; a
  row whose top-p nucleus is wider than 256 sorts its whole row and draws in index order.
- Full-size temporaries are avoided where it is easy: a fresh batch-by-vocabulary
  tensor costs page faults that can exceed the arithmetic done on it.
- The argmax is :func:`aiolm.kernels.sampling_ops.argmax_rows`, which uses
  aiolm's kernel where it applies (the same indices as ``torch.argmax``).
- On the CPU the random rows draw in one op, :func:`aiolm.kernels.sampling_ops.sample_rows`,
  the function the model's whole-step call draws with: the same distribution as the torch
  path here (which serves other devices), with the same uniform number per row.

All per-batch state lives in :class:`SamplingMetadata`, built once per batch
composition and advanced cheaply after each step; :class:`Sampler` is stateless.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from aiolm.core.step import LogprobsLists
from aiolm.kernels.sampling_ops import argmax_rows, sample_rows
from aiolm.params import SamplingParams
from aiolm.sample import logits_processors
from aiolm.sample.logits_processors import BatchRows, LogitsProcessor
from aiolm.sample.tensors import float_column, long_tensor

_NEG_INF = float("-inf")
# Candidates searched for a top-p nucleus: a nucleus within them draws in order of
# likelihood, a wider one over the vocabulary in index order (a full sort), as
# aiolm::sample_rows does (ext/cpu/sample.h).
_TOP_P_CANDIDATES = 256


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A per-request generator, seeded once when the request joins the batch."""
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(seed)
    return gen


# --- per-batch state ---------------------------------------------------------------------


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
            temperature=None
            if all(p.temperature == 1.0 for p in params)
            else float_column([p.temperature for p in params], device),
            top_k=None
            if all(k(p) == vocab_size for p in params)
            else long_tensor([k(p) for p in params], device).unsqueeze(1),
            top_p=None if all(p.top_p >= 1.0 for p in params) else float_column([p.top_p for p in params], device),
            min_p=None if all(p.min_p == 0.0 for p in params) else float_column([p.min_p for p in params], device),
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
    cand_width: int  # candidates drawn among (covers every top_k)
    plain_pos: torch.Tensor | None  # positions without either; None: none
    knob_rows: torch.Tensor  # float64 [n, 4]: temperature, top_k (0: none), top_p, min_p (sampling_ops)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        rows: list[int],
        generators: Sequence[torch.Generator | None],
        vocab_size: int,
        device: torch.device,
    ) -> RandomRows:
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
        cand_pos = long_tensor(cand, device) if cand else None
        return cls(
            rows=None if len(rows) == len(params) else long_tensor(rows, device),
            row_list=rows,
            generators=[generators[i] for i in rows],
            knobs=knobs,
            cand_pos=cand_pos,
            cand_knobs=None if cand_pos is None else knobs.select(cand_pos),
            cand_width=first,
            plain_pos=long_tensor(plain, device) if plain else None,
            knob_rows=knob_rows(ps, vocab_size, device),
        )


def knob_rows(params: Sequence[SamplingParams], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Per row (temperature, top_k, top_p, min_p) as float64 [rows, 4], as
    :func:`aiolm.kernels.sampling_ops.sample_rows` takes them: a greedy row gets temperature 0
    (its argmax), a top_k that keeps the whole vocabulary 0."""
    return torch.tensor(
        [
            (
                0.0 if p.greedy or p.top_k == 1 else p.temperature,
                p.top_k if 0 < p.top_k < vocab_size else 0,
                min(p.top_p, 1.0),
                p.min_p,
            )
            for p in params
        ],
        dtype=torch.float64,
        device=device,
    ).reshape(len(params), 4)


@dataclass
class SamplingMetadata:
    """Everything the sampler needs for one batch composition, as ready-made tensors.

    Build with :meth:`build` when the batch's rows change; call :meth:`advance`
    with each step's new tokens so the processors' state stays current without
    a rebuild. An active processor is also reachable by its name
    (``m.penalties``, ``m.min_tokens``): None when it is registered but no row
    uses it.
    """

    num_reqs: int
    vocab_size: int
    device: torch.device
    all_greedy: bool
    any_greedy: bool  # some rows take the argmax (all of them when all_greedy)
    random: RandomRows | None
    default_generator: torch.Generator | None
    # The processors some row uses, in registry order (see logits_processors/interface.py).
    processors: list[LogitsProcessor]
    processor_names: frozenset[str]  # names of every registered processor, active or not
    num_logprobs: list[int | None]  # per row: None, or N top logprobs besides the sampled one
    logprob_rows: torch.Tensor | None  # rows that asked (None: all rows, when any asked)
    logprob_row_list: list[int]
    max_num_logprobs: int
    named_logprob_ids: list[list[int] | None] | None  # per row (logprob_token_ids); None: no row has any
    knobs: torch.Tensor  # every row's, as knob_rows gives them (greedy rows: temperature 0)
    # (rows to scan, each pair's place among them, pair rows, pair tokens): the stop tokens of
    # the rows whose bans may leave them nothing to draw
    stop_pairs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

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
        registry: Sequence[type[LogitsProcessor]] | None = None,
    ) -> SamplingMetadata:
        """Turn per-request params and token histories into batch tensors.

        ``generators[i]`` is row i's own generator (requests with a seed; see
        :func:`make_generator`) or None to draw from ``default_generator``
        (torch's global generator when that is None too). Token ids outside
        ``[0, vocab_size)`` in ``logit_bias`` or stop ids are ignored: the API
        edge is where they should be rejected. ``registry`` replaces
        ``logits_processors.REGISTRY`` (read at each build) for this batch.
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
        named = [p.logprob_token_ids for p in params]
        lp_rows = [i for i in range(n) if num_logprobs[i] is not None]
        if registry is None:
            registry = logits_processors.REGISTRY
        processors = logits_processors.build_active(
            BatchRows(params, output_token_ids, prompt_token_ids, vocab_size, dev), registry
        )
        return cls(
            num_reqs=n,
            vocab_size=vocab_size,
            device=dev,
            all_greedy=not random_list,
            any_greedy=any(greedy),
            random=RandomRows.build(params, random_list, generators, vocab_size, dev) if random_list else None,
            default_generator=default_generator,
            processors=processors,
            processor_names=frozenset(kind.name for kind in registry),
            num_logprobs=num_logprobs,
            logprob_rows=long_tensor(lp_rows, dev) if lp_rows and len(lp_rows) < n else None,
            logprob_row_list=lp_rows,
            max_num_logprobs=max((num_logprobs[i] or 0 for i in lp_rows), default=0),
            named_logprob_ids=named if any(named) else None,
            knobs=knob_rows(params, vocab_size, dev),
            stop_pairs=(
                _stop_pairs(params, output_token_ids, vocab_size, dev) if _BANS & {p.name for p in processors} else None
            ),
        )

    def draws(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's uniform number (float64 [rows]; 0 for greedy rows) and knobs, for a call
        that samples the rows itself (the model's whole-step call, with the row sampler of
        ``sample_rows``): the numbers the sampler would draw for this step, from the same
        generators in the same order, so a seeded request's tokens do not depend on which ran.
        Take them once a step, in place of the sampler."""
        u = torch.zeros(self.num_reqs, dtype=torch.float64, device=self.device)
        rnd = self.random
        if rnd is not None:
            drawn = _draw_uniforms(rnd, self.default_generator, set(), self.device)
            if rnd.rows is None:
                u = drawn
            else:
                u[rnd.rows] = drawn
        return u, self.knobs

    def advance(self, new_token_ids: Sequence[Sequence[int]]) -> None:
        """Record tokens appended to each row (empty list: none) since the last step."""
        if len(new_token_ids) != self.num_reqs:
            raise ValueError("new_token_ids must have one entry per row")
        lens = [len(t) for t in new_token_ids]
        if not any(lens):
            return
        for proc in self.processors:
            proc.advance(new_token_ids)

    def __getattr__(self, name: str) -> LogitsProcessor | None:
        # Only reached when normal lookup fails: the active processor called ``name``,
        # None for a registered but inactive one, and AttributeError for anything else.
        names = self.__dict__.get("processor_names", frozenset())
        if name not in names:
            raise AttributeError(f"{type(self).__name__!r} has no attribute {name!r}")
        return next((p for p in self.__dict__["processors"] if p.name == name), None)


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
        return lp.slice(row, row + 1)


class Sampler:
    """Stateless: all batch state is in the SamplingMetadata passed to each call."""

    def __call__(
        self, logits: torch.Tensor, metadata: SamplingMetadata, skip_rng_rows: Sequence[int] = ()
    ) -> SamplerOutput:
        """Pick one token per row of ``logits`` ([num_reqs, vocab], any float dtype).

        ``skip_rng_rows`` lists rows whose token will be thrown away (a chunked
        prefill that is not finished): their own generators are left untouched,
        so a seeded request's tokens do not depend on how its prompt was chunked.
        The input tensor is never modified.
        """
        m = metadata
        if logits.dim() != 2 or logits.shape[0] != m.num_reqs or logits.shape[1] != m.vocab_size:
            raise ValueError(
                f"logits shape {tuple(logits.shape)} does not match metadata ({m.num_reqs}, {m.vocab_size})"
            )
        plain_greedy = m.all_greedy and not m.processors
        # One float32 tensor serves the raw logprobs and the processors; it is a
        # copy whenever something will write to it. Upcasting is exact, so argmax
        # is unchanged, and a float32 argmax is cheaper than a bfloat16 one on CPU.
        x = logits.float() if plain_greedy else logits.to(torch.float32, copy=True)
        raw_logprobs = None
        if m.logprob_row_list:
            src = x if m.logprob_rows is None else x.index_select(0, m.logprob_rows)
            raw_logprobs = torch.log_softmax(src, dim=-1)

        if plain_greedy:
            sampled = argmax_rows(x)
        else:
            for proc in m.processors:
                proc.apply(x)
            if m.stop_pairs is not None:
                _end_rows_left_with_nothing(x, m.stop_pairs)
            sampled = _sample(x, m, set(skip_rng_rows))

        lp = None if raw_logprobs is None else _gather_logprobs(raw_logprobs, sampled, m)
        return SamplerOutput(sampled=sampled, logprobs=lp)


# The processors whose bans can together forbid every token of a row: allowed_token_ids with
# a multi-token bad word that covers the last allowed one, or min_tokens on what is left. (The
# grammar ends its own rows.)
_BANS = frozenset({"allowed_token_ids", "bad_words", "min_tokens"})


def _stop_pairs(
    params: Sequence[SamplingParams], outputs: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The rows a ban may empty (allowed ids, bad words, min_tokens still to reach), with their
    stop tokens; None where there are none (most batches: the scan then costs nothing)."""
    scan = [
        i
        for i, p in enumerate(params)
        if p.allowed_token_ids or p.bad_words_token_ids or len(outputs[i]) < p.min_tokens
    ]
    pairs = [(k, i, t) for k, i in enumerate(scan) for t in sorted(params[i].stop_ids()) if 0 <= t < vocab_size]
    if not pairs:
        return None
    return (
        long_tensor(scan, device),
        long_tensor([k for k, _, _ in pairs], device),
        long_tensor([i for _, i, _ in pairs], device),
        long_tensor([t for _, _, t in pairs], device),
    )


def _end_rows_left_with_nothing(
    x: torch.Tensor, stop_pairs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
) -> None:
    """A row whose every token is forbidden takes its stop tokens, and so ends: a draw from it
    took token 0 (on Llama 3, "!"), which the row's own bans forbid. Nothing is read back."""
    scan, place, rows, tokens = stop_pairs
    dead = torch.isneginf(x.index_select(0, scan)).all(dim=1).index_select(0, place)
    x.index_put_((rows, tokens), torch.where(dead, 0.0, x[rows, tokens]))


def _sample(x: torch.Tensor, m: SamplingMetadata, skip: set[int]) -> torch.Tensor:
    """Greedy rows: argmax of the processed logits. Random rows: filtered draw."""
    if m.all_greedy:
        return argmax_rows(x)
    rnd = m.random
    assert rnd is not None
    greedy = argmax_rows(x) if m.any_greedy else None
    uniforms = _draw_uniforms(rnd, m.default_generator, skip, x.device)
    # index_select copies whole rows faster than x[rows] on CPU.
    xr = x if rnd.rows is None else x.index_select(0, rnd.rows)
    drawn = sample_rows(xr, uniforms, rnd.knob_rows)
    if drawn is None:
        drawn = _sample_random(xr, rnd, uniforms)
    if greedy is None:
        return drawn
    greedy[rnd.rows] = drawn
    return greedy


def _sample_random(xr: torch.Tensor, rnd: RandomRows, u: torch.Tensor) -> torch.Tensor:
    """Draw for every random row; ``xr`` is owned and may be modified.

    Rows with top-k/top-p draw among their candidates; rows whose nucleus is wider than
    the first candidates, and plain rows, sample over the full vocabulary.
    """
    if rnd.cand_pos is None:
        return _sample_full(xr, rnd.knobs, u)
    assert rnd.cand_knobs is not None
    pos = rnd.cand_pos
    whole = rnd.plain_pos is None  # pos is every random row
    tok, fits = _sample_candidates(xr if whole else xr.index_select(0, pos), rnd.cand_knobs, rnd.cand_width, u[pos])
    missing = (~fits).nonzero().squeeze(1)
    if whole and not missing.numel():
        return tok
    out = torch.empty(xr.shape[0], dtype=torch.long, device=xr.device)
    out[pos] = tok  # rows that did not fit are overwritten below
    full = [t for t in (rnd.plain_pos, pos[missing] if missing.numel() else None) if t is not None]
    if full:
        rows = torch.cat(full)
        out[rows] = _sample_full(xr.index_select(0, rows), rnd.knobs.select(rows), u[rows])
    return out


def _sample_candidates(x: torch.Tensor, kn: Knobs, width: int, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample rows with top-k/top-p among their ``width`` most likely tokens.

    Returns the tokens and, per row, whether the candidates held the whole
    kept set; rows where they did not (a top-p nucleus wider than
    ``_TOP_P_CANDIDATES``) must be redone by :func:`_sample_full`. Top-k keeps exactly k tokens (ties
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
    if kn.min_p is not None:  # first, as vLLM: relative to the most likely token, which stays
        probs.masked_fill_(probs < probs[:, :1] * kn.min_p, 0.0)
        probs.div_(probs.sum(dim=-1, keepdim=True))
    no_k = (~has_k).squeeze(1).nonzero().squeeze(1)
    if no_k.numel():
        # Top-p-only rows: candidate probabilities relative to the full vocabulary (what min-p
        # keeps of it).
        top = vals[no_k]
        temp = None if kn.temperature is None else kn.temperature[no_k]
        floor = None if kn.min_p is None else kn.min_p[no_k]
        z = _softmax_normaliser(x, no_k, top[:, :1], temp, floor)
        e = (top - top[:, :1]).exp_()
        if floor is not None:
            e.masked_fill_(e < floor, 0.0)
        probs[no_k] = e.div_(z)
    fits = has_k
    if kn.top_p is not None:
        top_p = kn.top_p
        cum = probs.cumsum(dim=-1)
        drop = ((cum - probs) >= top_p) & (top_p < 1.0)  # mass before already reaches top_p
        drop[:, 0] = False
        # a nucleus ends within the first _TOP_P_CANDIDATES, or the row draws in index order
        # over the vocabulary (_sample_full), as aiolm::sample_rows does, whatever the width
        narrow = (cum[:, -1:] >= top_p) & ((~drop).sum(dim=-1, keepdim=True) <= _TOP_P_CANDIDATES)
        fits = has_k | (top_p >= 1.0) | narrow
        probs.masked_fill_(drop, 0.0)
    choice = _inverse_cdf(probs, u)
    return idx.gather(1, choice.unsqueeze(1)).squeeze(1), fits.squeeze(1)


def _softmax_normaliser(
    x: torch.Tensor,
    rows: torch.Tensor,
    row_max: torch.Tensor,
    temperature: torch.Tensor | None,
    floor: torch.Tensor | None = None,
    chunk: int = 16,
) -> torch.Tensor:
    """sum(exp(x[row] / t - max)) for each row in ``rows``, as a [k, 1] column; with ``floor``
    (min-p), only of the terms at least that (the most likely token's term is 1).

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
        if floor is not None:
            b.masked_fill_(b < floor[start:end], 0.0)
        torch.sum(b, dim=-1, keepdim=True, out=z[start:end])
    return z


def _sample_full(x: torch.Tensor, kn: Knobs, u: torch.Tensor) -> torch.Tensor:
    """Sample over the whole vocabulary, in index order. Top-k rows never get here; top-p
    rows do where their nucleus is wider than the first candidates.

    Works in place on ``x`` (owned): large fresh allocations are costly on CPU
    (page faults), and the draw does not need normalised probabilities.
    """
    if kn.temperature is not None:
        x.div_(kn.temperature)
    probs = x.sub_(x.amax(dim=-1, keepdim=True)).exp_()  # unnormalised; each row's max is 1
    if kn.min_p is not None:  # first, as vLLM: relative to the most likely token (1 here)
        probs.masked_fill_(probs < kn.min_p, 0.0)
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
    return _inverse_cdf(probs, u)


def _draw_uniforms(
    rnd: RandomRows, default: torch.Generator | None, skip: set[int], device: torch.device
) -> torch.Tensor:
    """One U[0,1) float64 per random row, from that row's own generator when it has one."""
    n = len(rnd.row_list)
    gen_dev = default.device if default is not None else device
    unseeded = [j for j, g in enumerate(rnd.generators) if g is None]
    if len(unseeded) == n:
        return torch.rand(n, dtype=torch.float64, generator=default, device=gen_dev).to(device)
    u = torch.full((n,), 0.5, dtype=torch.float64, device=device)  # 0.5: skipped rows
    if unseeded:
        vals = torch.rand(len(unseeded), dtype=torch.float64, generator=default, device=gen_dev)
        u[long_tensor(unseeded, device)] = vals.to(device)
    pos: list[int] = []
    draws: list[torch.Tensor] = []
    for j, (row, gen) in enumerate(zip(rnd.row_list, rnd.generators)):
        if gen is not None and row not in skip:
            pos.append(j)
            draws.append(torch.rand(1, dtype=torch.float64, generator=gen, device=gen.device).to(device))
    if pos:
        u[long_tensor(pos, device)] = torch.cat(draws)
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
    # vLLM's rank: the tokens at least as likely, itself included (tied tokens share one rank).
    # Summing the bool mask's bytes is cheaper on CPU than summing the bools.
    ranks = (raw >= tok_lp).view(torch.uint8).sum(dim=-1, dtype=torch.int32).tolist()
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
    if m.named_logprob_ids is None:
        return LogprobsLists(token_ids=token_ids, logprobs=logprobs, ranks=out_ranks)
    entry_ranks: list[list[int]] = [[] for _ in range(m.num_reqs)]
    for j, row in enumerate(m.logprob_row_list):
        entry_ranks[row] = [out_ranks[row], *range(1, len(token_ids[row]))]
        named = m.named_logprob_ids[row]
        if named:  # the named tokens' logprobs and ranks, from this row's distribution
            vals = raw[j, torch.tensor(named, dtype=torch.long, device=raw.device)]
            named_ranks = (raw[j].unsqueeze(0) >= vals.unsqueeze(1)).sum(dim=-1).tolist()
            token_ids[row] += named
            logprobs[row] += vals.tolist()
            entry_ranks[row] += named_ranks
    return LogprobsLists(token_ids=token_ids, logprobs=logprobs, ranks=out_ranks, entry_ranks=entry_ranks)
