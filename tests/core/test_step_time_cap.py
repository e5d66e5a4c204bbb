"""--max-step-ms: the step cost fit (core/step_cost.py) and the scheduler capping each
step's prompt tokens with it, so that a long prompt does not pause every running stream."""

from __future__ import annotations

import pytest

from aiolm.core.scheduler import _WARMUP_STEPS, PREFILL_FLOOR_BLOCKS
from aiolm.core.step_cost import StepCost

from .sim import Driver, make_request, make_scheduler

# a slow CPU: 40 ms a step plus 2 ms a token (a 2,048-token chunk: 4.1 s)
FIXED, PER_TOKEN = 0.040, 0.002
LONG = list(range(1000, 2000))  # a prompt sharing no block with the streams' (no prefix-cache hit)


def linear_cost(so) -> float:
    return FIXED + PER_TOKEN * so.total_num_scheduled_tokens


# -- the fit ------------------------------------------------------------------------


def test_the_fit_recovers_a_linear_cost_and_sizes_a_step():
    cost = StepCost()
    assert cost.fit() is None and cost.max_tokens(0.5) is None
    for n in (8, 300, 64, 1000, 8, 120):
        cost.observe(n, FIXED + PER_TOKEN * n)
    fixed, per_token = cost.fit()
    assert fixed == pytest.approx(FIXED, rel=1e-6) and per_token == pytest.approx(PER_TOKEN, rel=1e-6)
    assert cost.max_tokens(0.5) in (229, 230)  # (0.5 - 0.04) / 0.002, rounded down
    assert cost.max_tokens(0.01) == 0  # not even the fixed part fits


def test_steps_of_one_size_count_everything_per_token_an_upper_bound():
    cost = StepCost()
    for _ in range(5):
        cost.observe(64, FIXED + PER_TOKEN * 64)
    fixed, per_token = cost.fit()
    assert fixed == 0.0 and per_token > PER_TOKEN
    # what it allows takes at most the limit at the true cost
    assert FIXED + PER_TOKEN * cost.max_tokens(0.5) <= 0.5


def test_a_cost_that_grows_faster_than_linear_is_overestimated_at_every_size():
    cost = StepCost()
    true = {n: 0.001 * n + 2e-6 * n * n for n in (16, 128, 512, 1024)}
    for n, t in true.items():
        cost.observe(n, t)
    fixed, per_token = cost.fit()
    for n, t in true.items():
        if n >= 512:  # the sizes a cap decides about
            assert fixed + per_token * n >= t * 0.999


def test_old_steps_fade_when_the_machine_slows_down():
    cost = StepCost()
    for i in range(60):
        n = 16 + 50 * (i % 5)
        cost.observe(n, 0.01 + 0.001 * n)
    for i in range(60):  # another job now shares the cores: every step costs 3x
        n = 16 + 50 * (i % 5)
        cost.observe(n, 3 * (0.01 + 0.001 * n))
    assert cost.fit()[1] == pytest.approx(0.003, rel=0.1)


def test_empty_steps_and_nonsense_times_teach_nothing():
    cost = StepCost()
    cost.observe(0, 1.0)
    cost.observe(10, 0.0)
    cost.observe(10, float("nan"))
    assert cost.fit() is None


# -- the scheduler ------------------------------------------------------------------


def _decoding(sched, d, n: int) -> None:
    """n requests decoding, their prompts done, the step cost measured on them."""
    for i in range(n):
        sched.add_request(make_request(f"s{i}", 6, max_tokens=400))
    for _ in range(_WARMUP_STEPS + 6):
        d.step()
    assert all(r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running)


def test_a_long_prompt_is_cut_to_what_the_step_time_allows_and_streams_keep_their_tokens():
    sched = make_scheduler(num_blocks=400, max_num_batched_tokens=1024, max_step_ms=300, max_model_len=2048)
    d = Driver(sched)
    d.step_seconds = linear_cost
    _decoding(sched, d, 8)
    sched.add_request(make_request("long", LONG[:1000], max_tokens=2))
    long_chunks = []
    for _ in range(40):
        so, _ = d.step()
        streams = {f"s{i}" for i in range(8)}
        assert streams <= set(so.num_scheduled_tokens), "a stream lost its token this step"
        assert linear_cost(so) <= 0.300 * 1.05 or so.num_scheduled_tokens.get("long", 0) <= PREFILL_FLOOR_BLOCKS * 4
        if "long" in so.num_scheduled_tokens:
            long_chunks.append(so.num_scheduled_tokens["long"])
        if sched.requests["long"].num_computed_tokens >= 1000:
            break
    assert sum(long_chunks) == 1000, "the prompt did not finish its prefill"
    # without the cap it would run in one 1,000-token step of 2.06 s; cut to ~0.3 s steps
    assert max(long_chunks) < 1000 and len(long_chunks) >= 6
    assert max(long_chunks) <= (0.300 - FIXED) / PER_TOKEN


def test_prompts_still_progress_when_the_streams_alone_fill_the_step_time():
    sched = make_scheduler(num_blocks=400, max_num_batched_tokens=1024, max_step_ms=30, max_model_len=2048)
    d = Driver(sched)
    d.step_seconds = linear_cost  # 40 ms fixed: every step is over 30 ms
    _decoding(sched, d, 4)
    sched.add_request(make_request("long", LONG[:200], max_tokens=2))
    chunks = []
    for _ in range(40):
        so, _ = d.step()
        chunks.append(so.num_scheduled_tokens.get("long", 0))
        if sched.requests["long"].num_computed_tokens >= 200:
            break
    assert sum(chunks) == 200
    assert all(c >= PREFILL_FLOOR_BLOCKS * sched.config.block_size for c in chunks[:-1])


@pytest.mark.parametrize(
    "max_step_ms,seconds", [(0, linear_cost), (300, lambda so: 1e-5 * so.total_num_scheduled_tokens)]
)
def test_no_cap_when_off_or_when_steps_are_fast(max_step_ms, seconds):
    sched = make_scheduler(num_blocks=400, max_num_batched_tokens=1024, max_step_ms=max_step_ms, max_model_len=2048)
    d = Driver(sched)
    d.step_seconds = seconds
    _decoding(sched, d, 4)
    sched.add_request(make_request("long", LONG[:900], max_tokens=2))
    so, _ = d.step()
    assert so.num_scheduled_tokens["long"] == 900


def test_the_first_steps_of_a_process_are_not_measured():
    sched = make_scheduler(num_blocks=400, max_num_batched_tokens=1024, max_step_ms=300, max_model_len=2048)
    d = Driver(sched)
    d.step_seconds = lambda so: 60.0  # a kernel build
    sched.add_request(make_request("a", 6, max_tokens=50))
    for _ in range(_WARMUP_STEPS):
        d.step()
    assert sched.step_cost.fit() is None
    d.step_seconds = linear_cost
    d.step()
    assert sched.step_cost.fit() is not None
    sched.reset_workers(400)  # new worker processes: their first steps are one-time costs again
    d.worker = type(d.worker)(block_size=sched.config.block_size)
    assert sched._unmeasured_steps == _WARMUP_STEPS


def test_unchunked_encoder_prompts_are_never_capped():
    sched = make_scheduler(max_step_ms=300, chunked_prefill=False)
    assert sched.step_cost is None


def test_unchunked_prompts_run_whole_past_the_long_prefill_threshold():
    """An encoder's prompt attends to itself only within its step (it keeps no KV): a piece
    of it would pool a different vector, so --long-prefill-token-threshold leaves it whole."""
    sched = make_scheduler(max_num_batched_tokens=64, chunked_prefill=False, long_prefill_token_threshold=4)
    sched.add_request(make_request("e", 10, max_tokens=1))
    assert sched.schedule().num_scheduled_tokens == {"e": 10}


def test_the_cap_must_not_be_negative():
    with pytest.raises(ValueError, match="max_step_ms"):
        make_scheduler(max_step_ms=-1)
