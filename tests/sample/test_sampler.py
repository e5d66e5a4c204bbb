"""Sampler behaviour: distributions, exactness of greedy rows, seeds, processors, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from aiolm.params import ParamError, SamplingParams
from aiolm.sample import sampler as sampler_module
from aiolm.sample.sampler import Sampler, SamplingMetadata, make_generator

sampler = Sampler()


@pytest.fixture(autouse=True, params=["native", "torch"])
def draw_path(request, monkeypatch):
    """Every test runs twice: random rows through the CPU op (aiolm::sample_rows), and through
    the torch path the sampler takes where the op does not apply (other devices)."""
    if request.param == "torch":
        monkeypatch.setattr(sampler_module, "sample_rows", lambda *a: None)
    return request.param


def meta(params, outputs=None, prompts=None, vocab=8, generators=None, default_seed=0):
    n = len(params)
    return SamplingMetadata.build(
        params,
        outputs if outputs is not None else [[] for _ in range(n)],
        prompts if prompts is not None else [[] for _ in range(n)],
        vocab,
        "cpu",
        generators,
        default_generator=make_generator(default_seed),
    )


def sample_many(row_logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    """n independent draws from one distribution, as n identical rows of one batch."""
    logits = row_logits.unsqueeze(0).expand(n, -1).contiguous()
    m = meta([params] * n, vocab=logits.shape[1], default_seed=seed)
    return sampler(logits, m).sampled


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    return float(((counts - expected) ** 2 / expected).sum())


# --- greedy -----------------------------------------------------------------------------


def test_greedy_rows_in_mixed_batch_are_exact_argmax():
    torch.manual_seed(1)
    n, vocab = 64, 1000
    logits = torch.randn(n, vocab, dtype=torch.bfloat16) * 4
    params = [
        SamplingParams(temperature=0.0)
        if i % 3 == 0
        else SamplingParams(temperature=1.3, top_p=0.8, top_k=20, min_p=0.05)
        for i in range(n)
    ]
    out = sampler(logits, meta(params, vocab=vocab)).sampled
    greedy = torch.tensor([i % 3 == 0 for i in range(n)])
    assert out.dtype == torch.long
    assert torch.equal(out[greedy], logits.float().argmax(-1)[greedy])
    # The random rows really sampled: not all of them landed on the argmax.
    assert (out[~greedy] != logits.float().argmax(-1)[~greedy]).any()


def test_all_greedy_batch_is_argmax_and_input_untouched():
    torch.manual_seed(2)
    logits = torch.randn(16, 300)
    before = logits.clone()
    out = sampler(logits, meta([SamplingParams(temperature=0.0)] * 16, vocab=300)).sampled
    assert torch.equal(out, before.argmax(-1))
    assert torch.equal(logits, before)


def test_top_k_one_equals_greedy():
    torch.manual_seed(3)
    logits = torch.randn(32, 500) * 3
    params = [SamplingParams(temperature=1.5, top_k=1)] * 32
    assert torch.equal(sampler(logits, meta(params, vocab=500)).sampled, logits.argmax(-1))


# --- distributions ----------------------------------------------------------------------


def test_temperature_sampling_matches_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    temp = 0.7
    samples = sample_many(logits, SamplingParams(temperature=temp), 20000, seed=11)
    probs = torch.softmax(logits.double() / temp, -1)
    # df = 7: 24.3 is the 0.1% critical value.
    assert chi_square(samples, probs) < 24.3


def test_top_k_keeps_only_k_best_with_renormalised_frequencies():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.5, -1.0, 2.0, 0.5, -2.0])
    samples = sample_many(logits, SamplingParams(top_k=3), 20000, seed=12)
    assert set(samples.unique().tolist()) == {1, 3, 5}
    kept = torch.tensor([1, 3, 5])
    probs = torch.zeros(8, dtype=torch.float64)
    probs[kept] = torch.softmax(logits[kept].double(), -1)
    counts = torch.bincount(samples, minlength=8).double()[kept]
    chi = float(((counts - probs[kept] * 20000) ** 2 / (probs[kept] * 20000)).sum())
    assert chi < 13.8  # df = 2, 0.1%


def test_top_p_never_returns_tokens_outside_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.03, 0.02])
    logits = probs.log()
    # Mass before token 2 is 0.8 >= 0.75, so only tokens 0 and 1 stay.
    samples = sample_many(logits, SamplingParams(top_p=0.75), 5000, seed=13)
    assert set(samples.unique().tolist()) == {0, 1}
    frac0 = (samples == 0).double().mean().item()
    assert abs(frac0 - 0.5 / 0.8) < 0.03
    # Temperature first: at 0.5 probs ~ p^2 -> 0.709, 0.255, 0.028, ...; top_p=0.9 keeps {0, 1}.
    hot = sample_many(logits, SamplingParams(temperature=0.5, top_p=0.9), 5000, seed=13)
    assert set(hot.unique().tolist()) == {0, 1}
    frac0 = (hot == 0).double().mean().item()
    assert abs(frac0 - 0.25 / 0.34) < 0.03


@pytest.mark.parametrize(
    "vocab,slope,top_p,lo,hi",
    [
        (1200, 0.001, 0.6, 256, 1200),  # wider than the 256 candidates
        (8000, 0.0005, 0.6, 256, 4096),  # some thousands of tokens
        (8000, 0.0001, 0.7, 4096, 8000),  # most of the vocabulary
    ],
)
def test_wide_top_p_nucleus_stays_exact(vocab, slope, top_p, lo, hi):
    flat = -slope * torch.arange(vocab, dtype=torch.float32)  # strictly decreasing
    p = torch.softmax(flat.double(), -1)
    before = torch.cumsum(p, 0) - p
    cutoff = int((before < top_p).sum())  # tokens [0, cutoff) are the nucleus
    assert lo < cutoff < hi
    peaked = torch.full((vocab,), -30.0)
    peaked[:3] = torch.tensor([0.5, 0.3, 0.2]).log()
    # One batch mixing wide-nucleus rows, narrow ones (first candidates suffice),
    # plain rows without top-p/top-k and top-k rows.
    n = 2000
    logits = torch.stack([flat if i % 4 == 0 else peaked for i in range(n)])
    kinds = [SamplingParams(top_p=top_p), SamplingParams(top_p=0.75), SamplingParams(), SamplingParams(top_k=2)]
    params = [kinds[i % 4] for i in range(n)]
    out = sampler(logits, meta(params, vocab=vocab, default_seed=14)).sampled
    flat_s, peaked_s, plain_s, top2_s = out[0::4], out[1::4], out[2::4], out[3::4]
    assert set(top2_s.unique().tolist()) == {0, 1}
    assert flat_s.max().item() < cutoff
    assert flat_s.max().item() > 0.97 * cutoff  # the tail of the nucleus is reachable
    assert set(peaked_s.unique().tolist()) == {0, 1}
    assert set(plain_s.unique().tolist()) == {0, 1, 2}
    counts = torch.bincount(plain_s, minlength=3).double()[:3]
    expected = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64) * 500
    assert float(((counts - expected) ** 2 / expected).sum()) < 13.8  # df=2


def test_min_p_drops_tokens_below_fraction_of_max():
    probs = torch.tensor([0.5, 0.2, 0.1, 0.06, 0.04, 0.04, 0.03, 0.03])
    samples = sample_many(probs.log(), SamplingParams(min_p=0.1), 8000, seed=15)
    # Threshold 0.05: tokens 0..3 stay, 4..7 never appear.
    assert set(samples.unique().tolist()) == {0, 1, 2, 3}
    kept = probs[:4].double() / probs[:4].sum()
    counts = torch.bincount(samples, minlength=8).double()[:4]
    assert float(((counts - kept * 8000) ** 2 / (kept * 8000)).sum()) < 16.3  # df=3


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    probs = torch.tensor([0.4, 0.2, 0.15, 0.1, 0.1, 0.05])
    # Top-4 renormalised: 0.47, 0.235, 0.176, 0.118; mass before token 2 is 0.706 >= 0.7.
    both = sample_many(probs.log(), SamplingParams(top_k=4, top_p=0.7), 4000, seed=21)
    assert set(both.unique().tolist()) == {0, 1}
    # Top-p alone: mass before token 2 is 0.6 < 0.7, so token 2 stays.
    alone = sample_many(probs.log(), SamplingParams(top_p=0.7), 4000, seed=21)
    assert set(alone.unique().tolist()) == {0, 1, 2}


def test_min_p_with_top_k_and_temperature():
    probs = torch.tensor([0.4, 0.2, 0.15, 0.1, 0.1, 0.05])
    # min_p is relative to the max, so 0.3 * 0.4 = 0.12 keeps tokens 0..2.
    s = sample_many(probs.log(), SamplingParams(top_k=5, min_p=0.3), 4000, seed=22)
    assert set(s.unique().tolist()) == {0, 1, 2}
    # Temperature 2 flattens first: probs ~ sqrt(p); 0.3 * sqrt(0.4) = 0.19 < sqrt(0.05) = 0.22.
    s = sample_many(probs.log(), SamplingParams(temperature=2.0, min_p=0.3), 4000, seed=22)
    assert set(s.unique().tolist()) == set(range(6))


def test_combined_filters_only_return_allowed_tokens_at_scale():
    torch.manual_seed(16)
    n, vocab = 128, 2000
    logits = torch.randn(n, vocab) * 2
    params = [SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02)] * n
    out = sampler(logits, meta(params, vocab=vocab)).sampled
    top40 = logits.topk(40, -1).indices
    assert (top40 == out.unsqueeze(1)).any(-1).all()


# --- seeds ------------------------------------------------------------------------------

FILTERED = SamplingParams(temperature=0.9, top_p=0.95, top_k=100, presence_penalty=0.5, seed=7)
PLAIN = SamplingParams(temperature=1.1, repetition_penalty=1.3, seed=7)
NUCLEUS = SamplingParams(temperature=0.8, top_p=0.9, min_p=0.01, seed=7)


def _run_seeded(
    layout: list[str], target_logits: list[torch.Tensor], noise_seed: int, target: SamplingParams = FILTERED
) -> list[int]:
    """Run steps with the seeded target row at layout.index('T'); return its tokens."""
    vocab = target_logits[0].numel()
    others = {
        "g": SamplingParams(temperature=0.0),
        "u": SamplingParams(temperature=1.0),
        "s": SamplingParams(temperature=1.2, top_p=0.5, seed=99),
    }
    params = [target if c == "T" else others[c] for c in layout]
    gens = [make_generator(p.seed) if p.seed is not None else None for p in params]
    m = meta(params, vocab=vocab, generators=gens, default_seed=noise_seed)
    noise = torch.Generator().manual_seed(noise_seed)
    pos = layout.index("T")
    got = []
    for step_logits in target_logits:
        logits = torch.randn(len(layout), vocab, generator=noise) * 3
        logits[pos] = step_logits
        out = sampler(logits, m).sampled.tolist()
        got.append(out[pos])
        m.advance([[t] for t in out])
    return got


def test_seed_is_reproducible_across_calls_and_batch_compositions():
    torch.manual_seed(17)
    steps = [torch.randn(400) * 2 for _ in range(12)]
    alone = _run_seeded(["T"], steps, noise_seed=1)
    assert alone == _run_seeded(["T"], steps, noise_seed=1)
    assert alone == _run_seeded(["u", "g", "T", "s"], steps, noise_seed=2)
    assert alone == _run_seeded(["s", "s", "u", "u", "g", "T"], steps, noise_seed=3)
    for target in (PLAIN, NUCLEUS):
        ref = _run_seeded(["T"], steps, noise_seed=1, target=target)
        assert ref == _run_seeded(["g", "s", "T", "u"], steps, noise_seed=4, target=target)
    # The seed matters: another seed gives another sequence.
    assert alone != _run_seeded(["T"], steps, noise_seed=1, target=FILTERED.clone(seed=8))


def test_skip_rng_rows_leave_the_generator_untouched():
    torch.manual_seed(18)
    logits = torch.randn(2, 300)
    p = SamplingParams(seed=5)
    g_a = make_generator(5)
    m_a = meta([p, SamplingParams()], vocab=300, generators=[g_a, None])
    sampler(logits, m_a, skip_rng_rows=[0])  # a discarded partial-prefill step
    assert torch.equal(g_a.get_state(), make_generator(5).get_state())
    first_a = sampler(logits, m_a).sampled[0].item()
    m_b = meta([p, SamplingParams()], vocab=300, generators=[make_generator(5), None])
    assert sampler(logits, m_b).sampled[0].item() == first_a


# --- logit processors -------------------------------------------------------------------


def greedy_pick(logits, outputs=None, prompts=None, **kw) -> int:
    p = SamplingParams(temperature=0.0, **kw)
    m = meta([p], outputs=[outputs or []], prompts=[prompts or []], vocab=logits.numel())
    return sampler(logits.unsqueeze(0), m).sampled.item()


def test_frequency_penalty_scales_with_count():
    logits = torch.tensor([3.0, 2.5, 0.0, -1.0])
    # Token 0 generated twice: 3.0 - 2 * f.
    assert greedy_pick(logits, outputs=[0, 0, 3], frequency_penalty=0.2) == 0  # 2.6 > 2.5
    assert greedy_pick(logits, outputs=[0, 0, 3], frequency_penalty=0.3) == 1  # 2.4 < 2.5
    # Prompt tokens do not count for frequency.
    assert greedy_pick(logits, prompts=[0, 0, 0], frequency_penalty=2.0) == 0


def test_presence_penalty_is_flat():
    logits = torch.tensor([3.0, 2.5, 0.0, -1.0])
    assert greedy_pick(logits, outputs=[0, 0, 0], presence_penalty=0.4) == 0  # 2.6
    assert greedy_pick(logits, outputs=[0, 0, 0], presence_penalty=0.6) == 1  # 2.4
    assert greedy_pick(logits, prompts=[0], presence_penalty=2.0) == 0


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    pos = torch.tensor([2.0, 1.5, -3.0])
    assert greedy_pick(pos, prompts=[0], repetition_penalty=1.2) == 0  # 1.667 > 1.5
    assert greedy_pick(pos, prompts=[0], repetition_penalty=1.5) == 1  # 1.333 < 1.5
    assert greedy_pick(pos, outputs=[0], repetition_penalty=1.5) == 1  # output counts too
    neg = torch.tensor([-1.0, -1.2, -5.0])
    assert greedy_pick(neg, outputs=[0], repetition_penalty=1.1) == 0  # -1.1 > -1.2
    assert greedy_pick(neg, outputs=[0], repetition_penalty=1.3) == 1  # -1.3 < -1.2
    # A penalty below 1 rewards repetition: the negative logit shrinks toward 0.
    assert greedy_pick(torch.tensor([-1.0, -0.8]), prompts=[0], repetition_penalty=0.5) == 0
    # any positive value, as vLLM and transformers take it (above 2 was a 400)
    assert greedy_pick(pos, prompts=[0], repetition_penalty=3.0) == 1
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ParamError, match="repetition_penalty"):
            SamplingParams(repetition_penalty=bad)


def test_advance_matches_rebuild_and_penalty_rows_do_not_leak():
    logits = torch.tensor([[3.0, 2.5, 0.0, -1.0]] * 3)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, frequency_penalty=0.3),
        SamplingParams(temperature=0.0),
    ]
    m = meta(params, vocab=4)
    assert sampler(logits, m).sampled.tolist() == [0, 0, 0]
    m.advance([[0], [0], []])
    assert sampler(logits, m).sampled.tolist() == [0, 0, 0]  # 3.0 - 0.3 = 2.7
    m.advance([[0], [0], [0]])
    assert sampler(logits, m).sampled.tolist() == [0, 1, 0]  # 3.0 - 0.6 = 2.4
    rebuilt = meta(params, outputs=[[0, 0], [0, 0], [0]], vocab=4)
    assert sampler(logits, rebuilt).sampled.tolist() == [0, 1, 0]


def test_penalties_count_repeats_within_one_step_and_keep_rows_apart():
    logits = torch.tensor([[3.0, 2.5, 0.0, -1.0]] * 2)
    params = [
        SamplingParams(temperature=0.0, frequency_penalty=0.3),
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
    ]
    m = meta(params, prompts=[[], [3]], vocab=4)
    m.advance([[0, 0, 99], [2]])  # two tokens in one step (e.g. speculative); 99 is ignored
    assert sampler(logits, m).sampled.tolist() == [1, 0]  # 3.0 - 0.6 = 2.4; row 1 untouched at 0
    m.advance([[], [0]])
    assert sampler(logits, m).sampled.tolist() == [1, 1]  # row 1: 3.0 / 1.5 = 2.0 < 2.5


def _dense_penalties(x, params, prompts, outputs):
    """Reference: the penalties over full [vocab] count vectors, row by row."""
    x = x.clone()
    vocab = x.shape[1]
    for i, p in enumerate(params):
        out = torch.tensor([t for t in outputs[i] if 0 <= t < vocab], dtype=torch.long)
        hist = torch.tensor([t for t in prompts[i] + outputs[i] if 0 <= t < vocab], dtype=torch.long)
        counts = torch.bincount(out, minlength=vocab).float()
        seen = torch.bincount(hist, minlength=vocab) > 0
        r = p.repetition_penalty
        x[i] = torch.where(seen, torch.where(x[i] > 0, x[i] / r, x[i] * r), x[i])
        x[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return x


def test_penalty_tables_match_dense_reference_through_advances():
    gen = torch.Generator().manual_seed(23)
    n, vocab = 12, 40

    def ints(hi, size):
        return torch.randint(0, hi, (size,), generator=gen).tolist()

    params = []
    for _ in range(n):
        pick = ints(4, 3)
        params.append(
            SamplingParams(
                repetition_penalty=[1.0, 1.3, 0.7, 2.0][pick[0]],
                frequency_penalty=[0.0, 0.5, -0.4, 1.5][pick[1]],
                presence_penalty=[0.0, 0.25, -1.0, 2.0][pick[2]],
            )
        )
    params[0] = SamplingParams(repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=0.5)
    prompts = [ints(vocab, int(ints(25, 1)[0])) for _ in range(n)]
    outputs = [ints(vocab, int(ints(8, 1)[0])) for _ in range(n)]
    prompts[0], outputs[0] = [], []  # nothing seen yet: its padding must not touch token 0
    prompts[1] = prompts[1] + [vocab + 5]  # out of vocabulary: ignored
    m = meta(params, outputs=outputs, prompts=prompts, vocab=vocab)
    assert m.penalties is not None
    for step in range(6):
        x = torch.randn(n, vocab, generator=gen) * 3
        got = x.clone()
        m.penalties.apply(got)
        assert torch.allclose(got, _dense_penalties(x, params, prompts, outputs), atol=1e-5), step
        new = [ints(vocab, int(ints(3, 1)[0])) for _ in range(n)]
        new[0] = [7, 7] if step == 1 else []
        new[2] = new[2] + [new[2][0]] if new[2] else []  # a repeat within one step
        m.advance(new)
        outputs = [o + t for o, t in zip(outputs, new)]


def test_logit_bias_forces_and_forbids():
    logits = torch.tensor([5.0, 1.0, 0.0, -2.0])
    assert greedy_pick(logits, logit_bias={3: 100.0}) == 3
    assert greedy_pick(logits, logit_bias={0: -100.0}) == 1
    assert greedy_pick(logits, logit_bias={99: 100.0}) == 0  # outside the vocab: ignored
    forced = sample_many(logits, SamplingParams(temperature=1.5, logit_bias={2: 100.0}), 2000)
    assert set(forced.tolist()) == {2}
    forbidden = sample_many(torch.zeros(4), SamplingParams(logit_bias={0: -100.0, 1: -100.0}), 4000)
    assert set(forbidden.unique().tolist()) == {2, 3}


def test_min_tokens_blocks_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0]])  # EOS (2) is the argmax, stop id 3 next
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[3], eos_token_ids=(2,))
    m = meta([p], vocab=4)
    picks = []
    for _ in range(4):
        tok = sampler(logits, m).sampled.tolist()
        picks.append(tok[0])
        m.advance([tok])
    assert picks == [1, 1, 1, 2]
    # Built mid-way with two outputs: one more blocked step.
    m2 = meta([p], outputs=[[1, 1]], vocab=4)
    assert sampler(logits, m2).sampled.item() == 1
    # ignore_eos: EOS is not a stop id, so it is not blocked.
    p3 = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True, eos_token_ids=(2,))
    assert sampler(logits, meta([p3], vocab=4)).sampled.item() == 2
    # Random rows never draw a blocked stop id either.
    pr = SamplingParams(temperature=1.0, min_tokens=5, eos_token_ids=(2,), stop_token_ids=[3])
    samples = sample_many(logits[0], pr, 3000)
    assert set(samples.unique().tolist()) == {0, 1}


def test_thinking_budget_forces_the_end_token_once_spent():
    logits = torch.tensor([[0.0, 5.0, 1.0, 0.5]])  # 1 is the argmax; 3 ends the thinking, 2 starts it
    picks = []
    p = SamplingParams(temperature=0.0, thinking_token_budget=2, thinking_markers=(3, None))
    m = meta([p], vocab=4)
    for _ in range(5):
        tok = sampler(logits, m).sampled.tolist()
        picks.append(tok[0])
        m.advance([tok])
    assert picks == [1, 1, 3, 1, 1]  # two thinking tokens, the end forced, then the answer
    # built mid-way: the same state from the output so far
    assert sampler(logits, meta([p], outputs=[[1, 1]], vocab=4)).sampled.item() == 3
    assert sampler(logits, meta([p], outputs=[[1, 3, 1]], vocab=4)).sampled.item() == 1
    # budget 0: the end comes first; random rows are forced too
    p0 = SamplingParams(temperature=1.0, thinking_token_budget=0, thinking_markers=(3, None))
    assert set(sample_many(logits[0], p0, 200).tolist()) == {3}
    # a model that chooses: counted only after it opened its thinking with the start token
    pc = SamplingParams(temperature=0.0, thinking_token_budget=1, thinking_markers=(3, 2))
    assert sampler(logits, meta([pc], vocab=4)).sampled.item() == 1  # undecided: free
    assert sampler(logits, meta([pc], outputs=[[2]], vocab=4)).sampled.item() == 1
    assert sampler(logits, meta([pc], outputs=[[2, 1]], vocab=4)).sampled.item() == 3
    assert sampler(logits, meta([pc], outputs=[[1, 1]], vocab=4)).sampled.item() == 1  # it answered at once
    # the other rows of the batch are left alone
    free = SamplingParams(temperature=0.0)
    both = meta([free, p], outputs=[[1, 1], [1, 1]], vocab=4)
    assert sampler(logits.repeat(2, 1), both).sampled.tolist() == [1, 3]


def test_a_row_its_bans_leave_nothing_takes_its_stop_token():
    """allowed_token_ids [1] with the bad word [1, 1]: after one 1 every token is forbidden, and
    the draw took token 0, which the row does not allow; it ends at its EOS instead, and the
    other rows are untouched."""
    logits = torch.tensor([[0.0, 5.0, 1.0, 0.5]] * 2)
    banned = SamplingParams(temperature=0.0, allowed_token_ids=[1], bad_words_token_ids=[[1, 1]], eos_token_ids=(3,))
    free = SamplingParams(temperature=0.0, eos_token_ids=(3,))
    assert sampler(logits, meta([banned, free], outputs=[[1], [1]], vocab=4)).sampled.tolist() == [3, 1]
    drawn = SamplingParams(temperature=1.0, allowed_token_ids=[1], bad_words_token_ids=[[1, 1]], eos_token_ids=(3,))
    assert set(sample_many(logits[0], drawn, 50).tolist()) == {1}  # nothing banned yet: 1
    m = meta([drawn] * 50, outputs=[[1]] * 50, vocab=4)
    assert set(sampler(logits[:1].expand(50, -1).contiguous(), m).sampled.tolist()) == {3}


def test_thinking_budget_is_checked():
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None
    for bad in (-2, 1.5, True):
        with pytest.raises(ParamError, match="thinking_token_budget"):
            SamplingParams(thinking_token_budget=bad, thinking_markers=(3, None))
    with pytest.raises(ParamError, match="--reasoning-parser"):
        SamplingParams(thinking_token_budget=10)


# --- logprobs ---------------------------------------------------------------------------


def test_logprobs_are_raw_with_sampled_first_and_correct_ranks():
    torch.manual_seed(19)
    n, vocab = 6, 50
    logits = torch.randn(n, vocab) * 2
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=1.0),  # did not ask
        SamplingParams(temperature=2.0, logprobs=0, logit_bias={7: 50.0}),
        SamplingParams(temperature=0.5, logprobs=5, presence_penalty=1.0, top_k=10),
        SamplingParams(temperature=1.0, logprobs=2, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, logprobs=20, logit_bias={4: 80.0}),
    ]
    m = meta(params, outputs=[[1]] * n, prompts=[[2, 3]] * n, vocab=vocab)
    before = logits.clone()
    out = sampler(logits, m)
    assert torch.equal(logits, before)  # processors work on a copy
    lp = out.logprobs
    assert lp is not None
    raw = torch.log_softmax(logits, -1)
    sampled = out.sampled.tolist()
    assert sampled[2] == 7 and sampled[5] == 4  # the bias decided the token ...
    for row, p in enumerate(params):
        if p.logprobs is None:
            assert lp.token_ids[row] == [] and lp.logprobs[row] == [] and out.row_logprobs(row) is None
            continue
        ids, vals = lp.token_ids[row], lp.logprobs[row]
        assert len(ids) == 1 + p.logprobs and ids[0] == sampled[row]
        # ... but logprobs describe the raw model distribution.
        assert torch.allclose(torch.tensor(vals), raw[row, ids], atol=1e-5)
        expected_top = raw[row].topk(p.logprobs).indices.tolist()
        assert ids[1:] == expected_top
        assert lp.ranks[row] == int((raw[row] >= raw[row, sampled[row]]).sum())  # vLLM's rank
        single = out.row_logprobs(row)
        assert single is not None and single.token_ids == [ids] and single.ranks == [lp.ranks[row]]
    assert lp.ranks[0] == 1  # greedy without processors takes the raw argmax


def test_tied_tokens_share_vllms_rank():
    """Exact ties (a scripted model's flat rows): every tied token's rank counts the tokens at
    least as likely, as vLLM's does; they were 2, 2 and 3 for three tokens of one logprob."""
    logits = torch.zeros(1, 12)
    logits[0, 5] = 3.0  # the argmax; the other eleven tie
    params = [SamplingParams(temperature=0.0, logprobs=2, logprob_token_ids=[0, 7])]
    out = sampler(logits, meta(params, outputs=[[1]], prompts=[[2]], vocab=12))
    lp = out.logprobs
    assert lp is not None and lp.ranks == [1] and lp.entry_ranks is not None
    assert lp.entry_ranks[0][3:] == [12, 12]  # tokens 0 and 7: all twelve are at least as likely


def test_named_token_logprobs_follow_the_top_ones_with_their_true_ranks():
    """logprob_token_ids: each named token's raw logprob and its rank in the row's own
    distribution, after the sampled token and the top-N; rows without names are unchanged."""
    torch.manual_seed(23)
    n, vocab = 3, 40
    logits = torch.randn(n, vocab) * 2
    params = [
        SamplingParams(temperature=0.0, logprobs=2, logprob_token_ids=[5, 30, 5]),
        SamplingParams(temperature=0.0, logprobs=1),
        SamplingParams(temperature=1.0, logprobs=0, logprob_token_ids=[0]),
    ]
    out = sampler(logits, meta(params, outputs=[[1]] * n, prompts=[[2]] * n, vocab=vocab))
    lp, raw = out.logprobs, torch.log_softmax(logits, -1)
    assert lp is not None and lp.entry_ranks is not None
    for row, p in enumerate(params):
        named = p.logprob_token_ids or []
        k = p.logprobs or 0
        assert lp.token_ids[row][1 + k :] == named
        for tid, val, rank in zip(lp.token_ids[row], lp.logprobs[row], lp.entry_ranks[row]):
            assert val == pytest.approx(raw[row, tid].item(), abs=1e-6)
            assert rank == int((raw[row] >= raw[row, tid]).sum())
        assert out.row_logprobs(row).entry_ranks == [lp.entry_ranks[row]]


def test_no_logprobs_requested_returns_none():
    out = sampler(torch.randn(3, 10), meta([SamplingParams()] * 3, vocab=10))
    assert out.logprobs is None


def test_shape_mismatch_is_rejected():
    with pytest.raises(ValueError):
        sampler(torch.randn(2, 10), meta([SamplingParams()] * 3, vocab=10))


def test_realistic_batch_smoke():
    """A 128 x 49152 mixed batch runs and every row's token is plausible."""
    torch.manual_seed(20)
    n, vocab = 128, 49152
    logits = torch.randn(n, vocab) * 3
    params = []
    for i in range(n):
        kind = i % 4
        params.append(
            [
                SamplingParams(temperature=0.0),
                SamplingParams(temperature=0.8, top_p=0.9, seed=i),
                SamplingParams(temperature=1.0, top_k=50, frequency_penalty=0.5, logprobs=5),
                SamplingParams(temperature=0.7, min_p=0.1, repetition_penalty=1.1),
            ][kind]
        )
    gens = [make_generator(p.seed) if p.seed is not None else None for p in params]
    outputs = [[int(t) for t in torch.randint(0, vocab, (20,))] for _ in range(n)]
    m = meta(params, outputs=outputs, prompts=outputs, vocab=vocab, generators=gens)
    out = sampler(logits, m)
    s = out.sampled
    assert ((s >= 0) & (s < vocab)).all()
    assert torch.equal(s[0::4], logits[0::4].argmax(-1))
    # Frequency penalty only lowers logits, so top-k picks stay inside the raw top-k
    # unless a penalised token dropped out; in both cases within the raw top 50 + 20.
    top70 = logits[2::4].topk(70, -1).indices
    assert (top70 == s[2::4].unsqueeze(1)).any(-1).all()
    assert out.logprobs is not None and all(len(out.logprobs.token_ids[i]) == 6 for i in range(2, n, 4))
    assert math.isfinite(sum(out.logprobs.logprobs[2]))
