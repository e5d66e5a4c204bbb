"""Speculative decoding in the scheduler: lookahead slots, rollback, caps, adaptivity."""

from __future__ import annotations

from aiolm.core.step import ModelRunnerOutput
from aiolm.spec_decode import SpecConfig

from .sim import Driver, check_scheduler, make_request, make_scheduler

REPEAT = [5, 6, 7, 8, 5, 6, 7]  # ends in "5 6 7", which was followed by 8


def spec_config(k: int = 3, **kw) -> SpecConfig:
    kw.setdefault("prompt_lookup_min", 2)
    kw.setdefault("prompt_lookup_max", 3)
    return SpecConfig(num_speculative_tokens=k, search_window=64, **kw)


def prefill(sched, req):
    sched.add_request(req)
    so = sched.schedule()
    sched.update_from_output(so, ModelRunnerOutput([req.req_id], [[8]]))  # prompt + 8: "...5 6 7 8"
    return req


def test_drafts_are_scheduled_with_reserved_slots_and_rejected_ones_rolled_back():
    sched = make_scheduler(speculative=spec_config(k=3), block_size=4)
    req = prefill(sched, make_request("a", REPEAT, max_tokens=20))
    so = sched.schedule()
    # Suffix "6 7 8" occurred at the start, followed by 5 6 7.
    assert so.scheduled_spec_decode_tokens == {"a": [5, 6, 7]}
    assert so.num_scheduled_tokens == {"a": 4}
    assert req.num_computed_tokens == 8 + 3
    assert len(sched.kv_cache_manager.get_blocks("a")) * 4 >= 11
    check_scheduler(sched, so)
    # The worker accepted two drafts and sampled 9 after them.
    outs = sched.update_from_output(so, ModelRunnerOutput(["a"], [[5, 6, 9]]))
    assert outs[0].new_token_ids == [5, 6, 9]
    assert req.all_token_ids == REPEAT + [8, 5, 6, 9]
    assert req.num_computed_tokens == req.num_tokens - 1  # only accepted tokens count as computed
    st = sched.spec_decode_stats
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (1, 3, 2)
    assert st.accepted_per_position == [1, 1, 0]
    check_scheduler(sched)


def test_blocks_that_accepted_drafts_fill_are_published_when_they_come_back():
    """Drafts are not published when scheduled (they may be rejected); once accepted, the
    blocks they filled are, even when the request ends in that same step."""
    sched = make_scheduler(speculative=spec_config(k=4, prompt_lookup_min=1), block_size=4)
    req = prefill(sched, make_request("a", [5, 6, 7, 8, 5, 6, 7], max_tokens=6))  # + 8
    so = sched.schedule()
    assert so.scheduled_spec_decode_tokens == {"a": [5, 6, 7, 8]}  # positions 8-11: the third block
    outs = sched.update_from_output(so, ModelRunnerOutput(["a"], [[5, 6, 7, 8, 9]]))
    assert outs[0].finish_reason == "length" and req.num_computed_tokens == 12
    assert len(sched.kv_cache_manager.pool.cached) == 3


def test_a_stop_inside_the_accepted_run_truncates_and_frees():
    sched = make_scheduler(speculative=spec_config(k=3), block_size=4)
    prefill(sched, make_request("a", REPEAT, max_tokens=20, stop_token_ids=[6]))
    so = sched.schedule()
    assert so.scheduled_spec_decode_tokens == {"a": [5, 6, 7]}
    outs = sched.update_from_output(so, ModelRunnerOutput(["a"], [[5, 6, 7, 1]]))
    assert outs[0].new_token_ids == [5, 6] and outs[0].finish_reason == "stop" and outs[0].stop_reason == 6
    assert "a" not in sched.requests and sched.kv_cache_manager.usage == 0.0


def test_drafts_are_capped_by_max_tokens_context_and_budget():
    sched = make_scheduler(speculative=spec_config(k=3), block_size=4)
    prefill(sched, make_request("a", REPEAT, max_tokens=3))  # one output so far, two more allowed
    so = sched.schedule()
    assert so.scheduled_spec_decode_tokens == {"a": [5]}  # two tokens at most: one draft + one
    sched = make_scheduler(speculative=spec_config(k=3), block_size=4, max_model_len=10)
    prefill(sched, make_request("a", REPEAT, max_tokens=20))  # 8 tokens, positions up to 9 fit
    assert sched.schedule().scheduled_spec_decode_tokens == {"a": [5, 6]}
    sched = make_scheduler(speculative=spec_config(k=3), block_size=4, max_num_batched_tokens=8)
    prefill(sched, make_request("a", REPEAT, max_tokens=20))
    assert sched.schedule().scheduled_spec_decode_tokens == {"a": [5, 6, 7]}
    sched = make_scheduler(speculative=spec_config(k=3), block_size=4, long_prefill_token_threshold=2)
    prefill(sched, make_request("a", REPEAT[:4], max_tokens=20))
    so = sched.schedule()  # "5 6 7 8 8": no drafts, or at most threshold - 1 of them
    assert all(len(d) <= 1 for d in so.scheduled_spec_decode_tokens.values())


def test_lookahead_is_dropped_before_anyone_is_preempted():
    # 3 usable blocks of 4: "a" (7 tokens) takes 2, "b" (3 tokens) takes 1; none is left for drafts.
    sched = make_scheduler(speculative=spec_config(k=3), block_size=4, num_blocks=4)
    a, b = make_request("a", REPEAT, max_tokens=20), make_request("b", [1, 2, 3], max_tokens=20)
    sched.add_request(a)
    sched.add_request(b)
    so = sched.schedule()
    sched.update_from_output(so, ModelRunnerOutput(["a", "b"], [[8], [4]]))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}  # both run, nobody preempted
    assert so.scheduled_spec_decode_tokens == {} and not so.finished_req_ids
    assert a.num_computed_tokens == 8
    check_scheduler(sched, so)


def test_requests_that_cannot_be_verified_exactly_never_draft():
    sched = make_scheduler(speculative=spec_config(k=3), block_size=4)
    prefill(sched, make_request("a", REPEAT, max_tokens=20, temperature=0.7, seed=1))
    assert sched.schedule().scheduled_spec_decode_tokens == {}


def test_low_acceptance_pauses_a_request():
    sched = make_scheduler(
        speculative=spec_config(k=2, prompt_lookup_min=1, prompt_lookup_max=1, window=2, min_acceptance=0.5, backoff=4),
        block_size=4,
    )
    drv = Driver(sched)
    sched.add_request(make_request("a", [1, 2, 3, 4], max_tokens=40))
    drafted = []
    for _ in range(9):
        so = sched.schedule()
        spec_tokens = so.scheduled_spec_decode_tokens
        drafted.append(bool(spec_tokens))
        sampling = drv.worker.apply(so)
        # The "model" never agrees with a draft but always says a token seen before (1..4),
        # so a 1-gram match, and drafts, exist at every step.
        toks = [[spec_tokens["a"][0] % 4 + 1] if "a" in spec_tokens else [1]]
        if "a" in spec_tokens:
            drv.worker.reject("a", len(spec_tokens["a"]))
        sched.update_from_output(so, ModelRunnerOutput(sampling, toks))
        check_scheduler(sched)
    # Prefill, two verifications with nothing accepted, a pause of 4 decode steps, then drafts again.
    assert drafted == [False, True, True, False, False, False, False, True, True]
    assert sched.spec_decode_stats.num_accepted_tokens == 0
