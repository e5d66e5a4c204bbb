"""The n-gram proposer against a brute-force reference, and the acceptance window."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiolm.params import SamplingParams
from aiolm.spec_decode import AcceptanceWindow, NgramProposer, SpecConfig, SpecDecodeStats, supports_speculation
from aiolm.structured.spec import StructuredOutputs


def reference(tokens: list[int], k: int, min_n: int, max_n: int, window: int) -> list[int]:
    """Longest n in [min_n, max_n] whose suffix occurs earlier (inside the window); the most
    recent such occurrence; the k tokens after it."""
    lo = max(0, len(tokens) - window)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for end in range(len(tokens) - 2, lo + n - 2, -1):  # end: index of the match's last token
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), max_size=60),
    k=st.integers(1, 5),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 3),
    window=st.integers(8, 40),
)
def test_matches_brute_force(tokens, k, min_n, extra, window):
    max_n = min_n + extra
    if window <= max_n:
        return
    got = NgramProposer(k, min_n, max_n, window).propose(tokens)
    assert got == reference(tokens, k, min_n, max_n, window)


def test_examples():
    p = NgramProposer(k=3, min_n=2, max_n=4)
    # "1 2 3" occurred before, followed by 4 5 6.
    assert p.propose([1, 2, 3, 4, 5, 6, 9, 1, 2, 3]) == [4, 5, 6]
    # The longer match wins over a more recent shorter one.
    assert p.propose([7, 2, 3, 4, 8, 2, 3, 5, 9, 7, 2, 3]) == [4, 8, 2]
    # Equally long: the most recent occurrence.
    assert p.propose([2, 3, 4, 2, 3, 5, 2, 3]) == [5, 2, 3]
    assert p.propose([1, 2, 3, 4]) == []  # no repeat
    assert p.propose([1, 2, 9, 2]) == []  # only a 1-gram repeats, below min_n
    assert p.propose([1, 2, 3, 1, 2], k=1) == [3]
    assert p.propose([1, 2, 3, 1, 2], k=0) == []
    # The continuation may run into the suffix itself (a sequence repeating itself).
    assert p.propose([5, 5, 5, 5]) == [5]


def test_search_is_bounded_and_cheap():
    """A long sequence only costs a scan of the window."""
    p = NgramProposer(k=4, min_n=2, max_n=5, window=1024)
    seq = [i % 7 for i in range(20000)]  # the last token occurs every 7 tokens
    t0 = time.perf_counter()
    for _ in range(50):
        assert p.propose(seq) == seq[-7:-3]
    assert (time.perf_counter() - t0) / 50 < 0.01  # generous: far below a decode step


def test_acceptance_window_pauses_and_backs_off():
    w = AcceptanceWindow(window=2, min_rate=0.5, backoff=3)
    w.record(4, 4)
    w.record(4, 0)  # 4 of 8: not below 0.5
    assert w.allow()
    w.record(4, 0)
    w.record(4, 1)  # 1 of 8: pause for 3 steps
    assert [w.allow() for _ in range(4)] == [False, False, False, True]
    w.record(4, 0)
    w.record(4, 0)  # low again: the pause doubles
    assert [w.allow() for _ in range(7)] == [False] * 6 + [True]
    w.record(4, 4)
    w.record(4, 4)  # a good window resets the backoff
    w.record(4, 0)
    w.record(4, 0)
    assert [w.allow() for _ in range(4)] == [False, False, False, True]


def test_draft_length_follows_the_last_accepted_run():
    w = AcceptanceWindow(window=8, min_rate=0.0, backoff=3, max_len=4)
    assert w.draft_len == 4
    w.record(4, 1)
    assert w.draft_len == 2  # one accepted: the next draft has two tokens
    w.record(2, 2)
    assert w.draft_len == 3  # all accepted: one more
    w.record(3, 3)
    w.record(4, 4)
    assert w.draft_len == 4  # capped at num_speculative_tokens
    w.record(4, 0)
    assert w.draft_len == 1


def test_stats_per_position():
    s = SpecDecodeStats()
    s.record(3, 1)
    s.record(2, 2)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (2, 5, 3)
    assert s.drafted_per_position == [2, 2, 1] and s.accepted_per_position == [2, 1, 0]
    assert s.acceptance_rate == 0.6 and s.mean_acceptance_length == 2.5
    assert "60.0%" in s.summary()


def test_which_requests_speculate():
    assert supports_speculation(SamplingParams(temperature=0.0))
    assert supports_speculation(SamplingParams(temperature=0.8, repetition_penalty=1.2, logprobs=2))
    assert supports_speculation(SamplingParams(temperature=0.0, seed=3))  # greedy: the seed is unused
    assert not supports_speculation(SamplingParams(temperature=0.8, seed=3))
    assert not supports_speculation(SamplingParams(structured_outputs=StructuredOutputs("regex", "a|b")))


@pytest.mark.parametrize(
    "kw",
    [
        dict(method="eagle"),
        dict(num_speculative_tokens=0),
        dict(prompt_lookup_min=0),
        dict(prompt_lookup_min=4, prompt_lookup_max=3),
    ],
)
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError):
        SpecConfig(**kw)


def test_speculation_and_overlap_scheduling_are_not_combined():
    from aiolm.config import EngineArgs

    with pytest.raises(ValueError, match="async_scheduling cannot be combined with speculative"):
        EngineArgs(speculative="ngram", async_scheduling=True)
    assert EngineArgs(speculative="ngram").spec_config() is not None
