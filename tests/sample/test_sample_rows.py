"""aiolm::sample_rows (ext/cpu/sample.h) against the sampler's torch path: for the same
logits, knobs and uniform numbers, the same tokens, except where a uniform falls within
rounding of a boundary between two tokens (the two sum in different orders)."""

from __future__ import annotations

import pytest
import torch

from aiolm.kernels import sampling_ops
from aiolm.params import SamplingParams
from aiolm.sample.sampler import RandomRows, _sample_random, knob_rows

VOCAB = 49152  # the embedded model's


def torch_tokens(logits: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    rnd = RandomRows.build(params, list(range(len(params))), [None] * len(params), logits.shape[1], torch.device("cpu"))
    return _sample_random(logits.clone(), rnd, u)


def _vllm_kept(probs: torch.Tensor, ranked: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The tokens a row may draw, in vLLM's order: min-p, then top-k, then top-p over what is
    left, renormalised (vllm/v1/sample/sampler.py)."""
    keep = torch.ones_like(probs, dtype=torch.bool)
    if p.min_p > 0:
        keep &= probs >= probs.max() * p.min_p
    if 0 < p.top_k < probs.numel():
        keep[ranked[p.top_k :]] = False
    if p.top_p < 1:
        sp = torch.where(keep, probs, 0.0)[ranked]
        sp = sp / sp.sum()
        keep[ranked[1:][(torch.cumsum(sp, 0) - sp)[1:] >= p.top_p]] = False
    return keep


def near_a_boundary(logits: torch.Tensor, p: SamplingParams, u: float, got: int, want: int) -> bool:
    """Whether u lies within 1e-5 of the cumulative mass (float64, in the draw's order) where
    the two tokens meet: a difference of rounding, not of distribution. Top-k rows and top-p
    nuclei of up to 256 tokens draw in order of likelihood, the rest in index order."""
    x = logits.double() / p.temperature
    probs = torch.softmax(x, -1)
    ranked = torch.argsort(-x, stable=True)
    keep = _vllm_kept(probs, ranked, p)
    by_rank = 0 < p.top_k < x.numel() or (p.top_p < 1 and int(keep.sum()) <= 256)  # the nucleus's size
    order = ranked if by_rank else torch.arange(x.numel())
    cdf = torch.cumsum(torch.where(keep, probs, 0.0)[order], 0)
    cdf /= cdf[-1].clone()
    pos = {int(t): i for i, t in enumerate(order.tolist())}
    edge = cdf[min(pos[got], pos[want])].item()
    return abs(u - edge) < 1e-5


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, min_p=0.05),
        SamplingParams(temperature=0.8, top_k=40),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.8),
        SamplingParams(temperature=0.6, top_p=0.9),  # a nucleus within the first candidates
        SamplingParams(temperature=1.5, top_p=0.95),  # a wide nucleus: the wider passes
        SamplingParams(temperature=1.0, top_k=20, top_p=0.9, min_p=0.1),
    ],
    ids=["plain", "min_p", "top_k", "top_k_top_p", "top_p", "wide_top_p", "all"],
)
def test_the_op_draws_the_torch_paths_tokens(params):
    g = torch.Generator().manual_seed(7)
    rows = 64
    logits = torch.randn(rows, VOCAB, generator=g) * 3  # peaked enough for narrow nuclei
    u = torch.rand(rows, dtype=torch.float64, generator=g)
    ps = [params] * rows
    got = sampling_ops.sample_rows(logits, u, knob_rows(ps, VOCAB, torch.device("cpu")))
    assert got is not None and got.dtype == torch.int64
    want = torch_tokens(logits, ps, u)
    differ = (got != want).nonzero().flatten().tolist()
    assert all(near_a_boundary(logits[r], params, u[r].item(), int(got[r]), int(want[r])) for r in differ), differ
    assert len(differ) <= 3  # of 64 rows: a wide nucleus has a boundary every ~5e-5 of mass


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(min_p=0.5, top_p=0.6),
        SamplingParams(min_p=0.3, top_p=0.6, temperature=0.9),
        SamplingParams(top_k=20, top_p=0.8, min_p=0.1),
        SamplingParams(top_k=3, top_p=0.7, min_p=0.5),
    ],
    ids=lambda p: f"k{p.top_k}-p{p.top_p}-m{p.min_p}",
)
def test_min_p_comes_before_top_k_and_top_p_as_in_vllm(params):
    """Where min-p and top-p both cut, the nucleus is of what min-p kept: with probabilities
    0.5, 0.3, 0.2, min_p 0.5 and top_p 0.6, vLLM keeps the first token alone (min-p leaves 0.625
    and 0.375); min-p last drew the second 37.5% of the time. Both paths draw only tokens vLLM
    keeps, and every one of them over 2,000 evenly spaced draws."""
    g = torch.Generator().manual_seed(3)
    base = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    rows = [torch.cat([base, torch.full((VOCAB - 3,), -30.0)]), torch.randn(VOCAB, generator=g) * 3]
    for logits in rows:
        x = logits.double() / params.temperature
        kept = set(
            _vllm_kept(torch.softmax(x, -1), torch.argsort(-x, stable=True), params).nonzero().flatten().tolist()
        )
        n = 2000
        u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
        batch = logits.unsqueeze(0).expand(n, -1).contiguous()
        ps = [params] * n
        op = sampling_ops.sample_rows(batch, u, knob_rows(ps, VOCAB, torch.device("cpu")))
        assert op is not None
        for got in (op, torch_tokens(batch, ps, u)):
            assert set(got.tolist()) == kept


def test_greedy_rows_masked_tokens_ties_and_small_rows():
    x = torch.tensor(
        [
            [0.0, 5.0, 5.0, 1.0, float("-inf")],  # greedy: the first of the maxima
            [0.0, 5.0, 5.0, 1.0, float("-inf")],  # top_k=1 by knobs: as greedy, the lower index
            [float("-inf"), 2.0, float("-inf"), 2.0, float("nan")],  # only 1 and 3 can come
            [float("-inf")] * 5,  # nothing to draw from: 0, as the argmax gives
            [3.0, 3.0, 3.0, 3.0, 3.0],  # top_k=2 of equal values: indices 0 and 1
        ]
    )
    knobs = torch.tensor(
        [[0, 0, 1, 0], [1.0, 1, 1, 0], [1.0, 0, 1, 0], [1.0, 0, 1, 0], [1.0, 2, 1, 0]], dtype=torch.float64
    )
    seen: list[set[int]] = [set() for _ in range(5)]
    for u in torch.linspace(0, 1 - 1e-12, 101, dtype=torch.float64).tolist():
        tok = sampling_ops.sample_rows(x, torch.full((5,), u, dtype=torch.float64), knobs)
        for r, t in enumerate(tok.tolist()):
            seen[r].add(t)
    assert seen == [{1}, {1}, {1, 3}, {0}, {0, 1}]


def test_wide_top_k_and_knobs_outside_the_params_range():
    """A top-k wider than the first candidates (its own selection path) keeps exactly the k
    best; a min_p over 1 (which SamplingParams refuses, but the op may be called with) drops
    every token, and the row takes its argmax rather than reading past the row."""
    x = torch.arange(1000, dtype=torch.float32).flip(0).unsqueeze(0) / 100  # token 0 best
    knobs = torch.tensor([[1.0, 300, 1, 0]], dtype=torch.float64)
    got = {
        int(sampling_ops.sample_rows(x, torch.tensor([u], dtype=torch.float64), knobs)[0])
        for u in torch.linspace(0, 1 - 1e-9, 400, dtype=torch.float64).tolist()
    }
    assert max(got) == 299 and min(got) == 0
    over = torch.tensor([[1.0, 0, 1, 1.5]], dtype=torch.float64)
    assert int(sampling_ops.sample_rows(x, torch.tensor([0.7], dtype=torch.float64), over)[0]) == 0


def test_u_splits_the_mass_in_order():
    """Plain rows take the vocabulary in index order: u below the first token's mass gives it,
    above the others' gives the last, and the tail past a block of 16 is reached."""
    x = torch.full((1, 37), float("-inf"))
    x[0, 0] = 0.0
    x[0, 36] = 0.0  # two tokens of equal mass, the second in a padded last block
    knobs = torch.tensor([[1.0, 0, 1, 0]], dtype=torch.float64)
    got = [
        int(sampling_ops.sample_rows(x, torch.tensor([u], dtype=torch.float64), knobs)[0])
        for u in (0.0, 0.49, 0.51, 0.999999)
    ]
    assert got == [0, 0, 36, 36]
