"""Scheduler rules: chunking, limits, preemption, stops, aborts, errors and the diff protocol."""

from __future__ import annotations

import pytest

from aiolm.core.request import Request, RequestStatus
from aiolm.core.scheduler import SchedulerConfig
from aiolm.core.step import LogprobsLists, ModelRunnerOutput, PromptLogprobs
from aiolm.params import ParamError, SamplingParams
from aiolm.structured.spec import StructuredOutputs

from .sim import EOS, Driver, check_scheduler, make_request, make_scheduler


def one_step(sched, token: int = 7):
    """Schedule and feed ``token`` to every request whose prefill completed."""
    so = sched.schedule()
    check_scheduler(sched, so)
    sampling = [
        rid
        for rid in so.num_scheduled_tokens
        if sched.requests[rid].num_computed_tokens == sched.requests[rid].num_tokens
    ]
    runner_output = ModelRunnerOutput(req_ids=sampling, sampled_token_ids=[[token] for _ in sampling])
    return so, sched.update_from_output(so, runner_output)


# -- intake -------------------------------------------------------------------------


def test_prompt_must_leave_room_for_one_output_token():
    sched = make_scheduler(max_model_len=16)
    sched.add_request(make_request("ok", 15))
    with pytest.raises(ParamError) as e:
        sched.add_request(make_request("long", 16))
    assert e.value.param == "prompt"
    with pytest.raises(ParamError):
        sched.add_request(make_request("empty", []))
    with pytest.raises(ValueError):
        sched.add_request(make_request("ok", 3))
    assert sched.get_num_unfinished_requests() == 1 and sched.num_waiting == 1


def test_config_is_validated():
    with pytest.raises(ValueError):
        SchedulerConfig(num_blocks=8, policy="lifo")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        SchedulerConfig(num_blocks=8, max_num_batched_tokens=0)


def test_max_tokens_none_means_until_max_model_len():
    sched = make_scheduler(max_model_len=20)
    r = make_request("r", 12, max_tokens=None)
    sched.add_request(r)
    assert r.max_tokens == 8
    d = Driver(sched)
    d.drain()
    assert d.finished["r"].finish_reason == "length"
    assert len(d.outputs["r"]) == 8 and r.num_tokens == 20


# -- basic lifecycle and chunking ------------------------------------------------------


def test_single_request_prefill_then_decode_then_length():
    sched = make_scheduler()
    sched.add_request(make_request("r", 10, max_tokens=3))
    so, outs = one_step(sched)
    assert so.num_scheduled_tokens == {"r": 10}
    assert [nr.req_id for nr in so.scheduled_new_reqs] == ["r"]
    assert outs[0].new_token_ids == [7] and not outs[0].finished
    so, outs = one_step(sched)
    assert so.num_scheduled_tokens == {"r": 1} and so.scheduled_cached_reqs.req_ids == ["r"]
    so, outs = one_step(sched)
    assert outs[0].finish_reason == "length" and outs[0].new_token_ids == [7]
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_usage == 0.0
    assert sched.schedule().finished_req_ids == {"r"}


def test_chunked_prefill_by_token_budget():
    sched = make_scheduler(max_num_batched_tokens=32)
    sched.add_request(make_request("r", 100, max_tokens=2))
    d = Driver(sched)
    chunks = []
    for _ in range(4):
        so, outs = d.step()
        chunks.append(so.num_scheduled_tokens["r"])
        assert (outs == []) == (len(chunks) < 4)  # nothing sampled until the prompt is done
    assert chunks == [32, 32, 32, 4]
    assert len(d.history[0].scheduled_new_reqs) == 1
    assert all(not so.scheduled_new_reqs for so in d.history[1:])
    d.drain()


def test_long_prefill_threshold_interleaves_prefills():
    sched = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    sched.add_request(make_request("a", 20, max_tokens=1))
    sched.add_request(make_request("b", 20, max_tokens=1))
    d = Driver(sched)
    so, _ = d.step()
    assert so.num_scheduled_tokens == {"a": 8, "b": 8}
    so, _ = d.step()
    assert so.num_scheduled_tokens == {"a": 8, "b": 8}
    so, _ = d.step()
    assert so.num_scheduled_tokens == {"a": 4, "b": 4}
    d.drain()


def test_running_requests_are_served_before_waiting_ones():
    sched = make_scheduler(max_num_batched_tokens=10)
    sched.add_request(make_request("a", 6, max_tokens=5))
    sched.add_request(make_request("b", 6, max_tokens=5))
    d = Driver(sched)
    so, _ = d.step()
    assert so.num_scheduled_tokens == {"a": 6, "b": 4}  # b's prompt is chunked by the budget
    so, _ = d.step()
    assert so.num_scheduled_tokens == {"a": 1, "b": 2}  # decode first, then the rest of b's prompt
    d.drain()


def test_max_num_seqs_caps_the_batch():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", 4, max_tokens=2))
    d = Driver(sched)
    so, _ = d.step()
    assert set(so.num_scheduled_tokens) == {"r0", "r1"} and sched.num_waiting == 3
    so, _ = d.step()
    assert set(so.num_scheduled_tokens) == {"r0", "r1"}  # both finish (max_tokens=2)
    so, _ = d.step()
    assert set(so.num_scheduled_tokens) == {"r2", "r3"}
    assert so.finished_req_ids == {"r0", "r1"}
    d.drain()


def test_priority_policy_admits_lowest_value_first():
    sched = make_scheduler(policy="priority", max_num_seqs=1)
    sched.add_request(make_request("low", 4, max_tokens=1, priority=5, arrival_time=1.0))
    sched.add_request(make_request("high", 4, max_tokens=1, priority=-1, arrival_time=2.0))
    sched.add_request(make_request("mid", 4, max_tokens=1, priority=0, arrival_time=0.0))
    d = Driver(sched)
    order = [next(iter(d.step()[0].num_scheduled_tokens)) for _ in range(3)]
    assert order == ["high", "mid", "low"]


# -- preemption ------------------------------------------------------------------------


def test_preemption_by_recompute_and_resume_as_new():
    # 6 usable blocks of 4 tokens; two requests of 8-token prompts grow until they collide.
    sched = make_scheduler(num_blocks=7, max_model_len=64)
    sched.add_request(make_request("a", list(range(1, 9)), max_tokens=12, ignore_eos=True))
    sched.add_request(make_request("b", list(range(101, 109)), max_tokens=12, ignore_eos=True))
    d = Driver(sched)
    preempt_step = None
    for s in range(40):
        so, _ = d.step()
        if sched.get_request("b") is not None and sched.get_request("b").status == RequestStatus.PREEMPTED:
            preempt_step = s
            break
    assert preempt_step is not None, "b was never preempted"
    b = sched.get_request("b")
    assert b.num_computed_tokens == 0 and sched.kv_cache_manager.get_block_ids("b") == []
    assert sched.waiting.peek() is b
    assert "b" in so.finished_req_ids  # workers drop it in the same step
    assert "b" not in so.num_scheduled_tokens
    outputs_before = list(b.output_token_ids)
    assert outputs_before
    # Run until b is re-admitted: it must come back in full, with every block id.
    for _ in range(40):
        so, _ = d.step()
        resumed = [nr for nr in so.scheduled_new_reqs if nr.req_id == "b"]
        if resumed:
            nr = resumed[0]
            assert nr.output_token_ids == outputs_before
            assert nr.block_ids == sched.kv_cache_manager.get_block_ids("b")
            assert len(nr.block_ids) * 4 >= b.num_computed_tokens
            break
    else:
        pytest.fail("b never resumed")
    d.drain()
    assert d.worker.seen_new.count("b") == 2
    assert len(d.outputs["a"]) == 12 and len(d.outputs["b"]) == 12


def test_preemption_refunds_budget_of_a_victim_scheduled_earlier():
    # priority policy: "old" is first in the running list but has the worst priority.
    sched = make_scheduler(num_blocks=5, policy="priority", max_model_len=64)  # 4 usable blocks
    sched.add_request(make_request("old", 4, max_tokens=8, priority=9, arrival_time=0.0, ignore_eos=True))
    d = Driver(sched)
    d.step()  # old: prefill 4 tokens (1 block)
    sched.add_request(
        make_request("vip", list(range(50, 57)), max_tokens=8, priority=0, arrival_time=1.0, ignore_eos=True)
    )
    d.step()  # old decodes into its block 2, vip prefills into 2 blocks -> pool full
    assert sched.num_free_blocks == 0
    d.step()  # both still fit in their last blocks
    so, _ = d.step()  # old is scheduled, then vip needs a block: old is the victim and is refunded
    assert so.num_scheduled_tokens == {"vip": 1}
    assert so.total_num_scheduled_tokens == 1
    assert so.scheduled_cached_reqs.req_ids == ["vip"]
    assert "old" in so.finished_req_ids
    assert sched.get_request("old").status == RequestStatus.PREEMPTED
    d.drain()
    assert len(d.outputs["old"]) == 8 and len(d.outputs["vip"]) == 8


def test_refund_lets_later_running_requests_use_the_victims_budget():
    # Running order [V, R, T]; V has the worst priority and is scheduled first, then R needs a block.
    sched = make_scheduler(num_blocks=5, policy="priority", max_model_len=64)  # 4 usable blocks
    sched.add_request(make_request("V", list(range(1, 7)), max_tokens=9, priority=9, arrival_time=0.0, ignore_eos=True))
    d = Driver(sched)
    d.step()  # V: 6-token prompt in 2 blocks
    sched.add_request(make_request("R", [41, 42, 43, 44], max_tokens=9, priority=0, arrival_time=1.0, ignore_eos=True))
    sched.add_request(
        make_request("T", list(range(60, 72)), max_tokens=9, priority=1, arrival_time=2.0, ignore_eos=True)
    )
    sched.config.max_num_batched_tokens = 9
    so, _ = d.step()
    assert so.num_scheduled_tokens == {"V": 1, "R": 4, "T": 4} and sched.num_free_blocks == 0
    sched.config.max_num_batched_tokens = 3
    so, _ = d.step()
    # V got 1 token, then was preempted for R: its token is refunded and T (after R) still runs.
    assert so.num_scheduled_tokens == {"R": 1, "T": 2}
    assert so.finished_req_ids == {"V"}
    d.drain()


def test_no_admission_in_a_step_that_preempted():
    sched = make_scheduler(num_blocks=4, policy="priority", max_model_len=64)  # 3 usable blocks
    sched.add_request(make_request("A", [1, 2, 3, 4], max_tokens=4, priority=0, arrival_time=0.0, ignore_eos=True))
    sched.add_request(
        make_request("B", list(range(11, 19)), max_tokens=4, priority=5, arrival_time=1.0, ignore_eos=True)
    )
    d = Driver(sched)
    so, _ = d.step()
    assert sched.num_free_blocks == 0
    sched.add_request(make_request("C", [7, 7, 7], max_tokens=1, priority=0, arrival_time=2.0))
    so, _ = d.step()  # A needs a block: B is preempted; the freed block must not go to C this step
    assert so.num_scheduled_tokens == {"A": 1} and so.finished_req_ids == {"B"}
    so, _ = d.step()
    assert "C" in so.num_scheduled_tokens
    d.drain()


def test_preempted_request_resumes_from_its_cached_prefix():
    sched = make_scheduler(num_blocks=7, max_model_len=64)
    sched.add_request(make_request("a", list(range(1, 9)), max_tokens=12, ignore_eos=True))
    sched.add_request(make_request("b", list(range(101, 109)), max_tokens=12, ignore_eos=True))
    d = Driver(sched)
    d.drain()
    resumed = [nr for so in d.history for nr in so.scheduled_new_reqs if nr.req_id == "b"][1:]
    assert resumed and resumed[0].num_computed_tokens > 0  # some of b's blocks survived in the cache
    # vLLM's prefix-cache counters count the two prompts' first lookups only: a preempted
    # request's lookups, one a step while it waits, are recomputation.
    stats = sched.prefix_cache_stats
    assert sched.num_preemptions > 0 and stats.requests == 2 and stats.queries == 16 and stats.hits == 0
    assert stats.preempted_requests > 0 and stats.preempted_hits > 0  # kept apart, as vLLM keeps them


# -- too large --------------------------------------------------------------------------------


def test_prompt_larger_than_the_pool_finishes_with_error():
    sched = make_scheduler(num_blocks=5, max_model_len=64)  # 4 usable blocks = 16 tokens
    sched.add_request(make_request("big", 17))
    sched.add_request(make_request("ok", 5, max_tokens=1))
    so = sched.schedule()
    assert set(so.num_scheduled_tokens) == {"ok"}  # the big one does not block the queue
    outs = sched.update_from_output(so, ModelRunnerOutput(["ok"], [[3]]))
    by_id = {o.req_id: o for o in outs}
    assert by_id["big"].finish_reason == "error"
    assert "KV cache" in by_id["big"].error and "4" in by_id["big"].error
    assert by_id["ok"].finish_reason == "length"
    assert not sched.has_unfinished_requests()


def test_request_that_outgrows_the_pool_alone_finishes_with_error():
    sched = make_scheduler(num_blocks=5, max_model_len=64)  # 16 token slots
    sched.add_request(make_request("r", 10, max_tokens=30, ignore_eos=True))
    d = Driver(sched)
    d.drain()
    out = d.finished["r"]
    assert out.finish_reason == "error" and out.error
    assert len(d.outputs["r"]) == 7  # 10 + 7 = 17 tokens: the 17th needs a 5th block to compute
    assert sched.kv_cache_usage == 0.0


def test_error_output_is_reported_even_when_nothing_runs():
    sched = make_scheduler(num_blocks=3, max_model_len=64)
    sched.add_request(make_request("big", 20))
    so = sched.schedule()
    assert so.is_empty and sched.has_unfinished_requests()
    outs = sched.update_from_output(so, None)
    assert [o.finish_reason for o in outs] == ["error"]
    assert not sched.has_unfinished_requests()


# -- stop conditions ---------------------------------------------------------------------------


def run_tokens(tokens: list[int], **req_kwargs) -> tuple[list, object]:
    """Feed a fixed token stream to one request; return its outputs and final output."""
    sched = make_scheduler(max_model_len=req_kwargs.pop("max_model_len", 64))
    sched.add_request(make_request("r", 4, **req_kwargs))
    got, final = [], None
    for tok in tokens:
        so, outs = one_step(sched, tok)
        for o in outs:
            got.extend(o.new_token_ids)
            final = o if o.finished else final
        if final:
            break
    return got, final


def test_eos_stops_with_stop_reason_none():
    got, final = run_tokens([5, 6, EOS, 8])
    assert got == [5, 6, EOS] and final.finish_reason == "stop" and final.stop_reason is None


def test_stop_token_ids_report_the_token():
    got, final = run_tokens([5, 42, 8], stop_token_ids=[42])
    assert got == [5, 42] and final.finish_reason == "stop" and final.stop_reason == 42


def test_min_tokens_suppresses_early_stop():
    got, final = run_tokens([EOS, EOS, EOS, 5], min_tokens=3)
    assert got == [EOS, EOS, EOS] and final.finish_reason == "stop"
    got, final = run_tokens([EOS, 5, EOS, 6], min_tokens=2)
    assert got == [EOS, 5, EOS]


def test_ignore_eos_runs_to_max_tokens():
    got, final = run_tokens([EOS] * 10, ignore_eos=True, max_tokens=4)
    assert got == [EOS] * 4 and final.finish_reason == "length"


def test_stop_token_wins_over_length_on_the_last_token():
    got, final = run_tokens([5, EOS], max_tokens=2)
    assert final.finish_reason == "stop"


def test_max_model_len_stops_with_length():
    got, final = run_tokens([5] * 10, max_tokens=None, max_model_len=7)
    assert got == [5, 5, 5] and final.finish_reason == "length"


def test_multi_token_output_is_cut_at_the_stop_and_logprobs_trimmed():
    sched = make_scheduler()
    sched.add_request(make_request("r", 4, logprobs=1))
    so = sched.schedule()
    lp = LogprobsLists(token_ids=[[5], [EOS], [9]], logprobs=[[-0.1], [-0.2], [-0.3]], ranks=[1, 1, 1])
    outs = sched.update_from_output(so, ModelRunnerOutput(["r"], [[5, EOS, 9]], {"r": lp}))
    assert outs[0].new_token_ids == [5, EOS] and outs[0].finish_reason == "stop"
    assert outs[0].new_logprobs.ranks == [1, 1] and len(outs[0].new_logprobs.token_ids) == 2


# -- abort ----------------------------------------------------------------------------------


def test_abort_frees_blocks_in_the_same_call():
    sched = make_scheduler()
    sched.add_request(make_request("run", 10, max_tokens=50))
    sched.add_request(make_request("wait", 10, max_tokens=50))
    sched.config.max_num_seqs = 1
    d = Driver(sched)
    d.step()
    used = sched.kv_cache_manager.num_usable_blocks - sched.num_free_blocks
    assert used == 3
    outs = sched.abort_requests(["run", "wait", "nope"])
    assert [(o.req_id, o.finish_reason) for o in outs] == [("run", "abort"), ("wait", "abort")]
    assert sched.kv_cache_usage == 0.0 and not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.check_invariants() == []
    so = sched.schedule()
    assert so.finished_req_ids == {"run"}  # the workers never saw "wait"


def test_output_for_a_request_aborted_mid_step_is_dropped():
    sched = make_scheduler()
    sched.add_request(make_request("r", 4))
    so = sched.schedule()
    sched.abort_requests(["r"])
    assert sched.update_from_output(so, ModelRunnerOutput(["r"], [[5]])) == []
    assert sched.kv_cache_manager.check_invariants() == []


def test_aborted_request_id_can_be_reused():
    sched = make_scheduler()
    sched.add_request(make_request("x", 6, max_tokens=5))
    d = Driver(sched)
    d.step()
    d.record(sched.abort_requests(["x"]))
    d.finished.pop("x")
    sched.add_request(make_request("x", [9, 9, 9], max_tokens=2))
    so, _ = d.step()  # workers drop the old "x" and get the new one in one message
    assert "x" in so.finished_req_ids and so.scheduled_new_reqs[0].prompt_token_ids == [9, 9, 9]
    d.drain()


# -- prefix caching through the scheduler --------------------------------------------------


def test_second_request_with_same_prompt_reuses_blocks():
    sched = make_scheduler(num_blocks=32)
    prompt = list(range(1, 30))
    sched.add_request(make_request("a", prompt, max_tokens=1))
    d = Driver(sched)
    d.step()
    sched.add_request(make_request("b", prompt, max_tokens=1))
    so, outs = d.step()
    nr = so.scheduled_new_reqs[0]
    assert nr.num_computed_tokens == 28  # 7 full blocks of the 29-token prompt
    assert so.num_scheduled_tokens["b"] == 1
    assert outs[0].num_cached_tokens == 28
    stats = sched.prefix_cache_stats
    assert stats.hits == 28 and stats.queries == 58 and stats.requests == 2
    d.drain()


def test_prompt_logprobs_skip_the_prefix_cache_and_arrive_once_in_order():
    """Chunks of prompt logprobs are gathered (a repeated one adds nothing) and sent with the first token."""
    sched = make_scheduler(num_blocks=32, max_num_batched_tokens=12)
    prompt = list(range(1, 30))
    d = Driver(sched)
    sched.add_request(make_request("a", prompt, max_tokens=1))
    d.drain()
    sched.add_request(make_request("b", prompt, max_tokens=2, prompt_logprobs=0))
    firsts = []
    for _ in range(10):
        so = sched.schedule()
        check_scheduler(sched, so)
        if not so.num_scheduled_tokens:
            break
        req = sched.requests["b"]
        n = so.num_scheduled_tokens["b"]
        start = req.num_computed_tokens - n  # positions start .. start+n-1 score tokens start+1 ..
        if so.scheduled_new_reqs:
            assert so.scheduled_new_reqs[0].num_computed_tokens == 0  # no cached prefix for "b"
        count = min(n, len(prompt) - 1 - start)
        plp = {}
        if count > 0:
            # send each chunk twice, as after a preemption's recompute: only the new entries count
            chunk = PromptLogprobs(
                start + 1,
                LogprobsLists(
                    [[prompt[start + 1 + i]] for i in range(count)],
                    [[-float(start + 1 + i)] for i in range(count)],
                    [1] * count,
                ),
            )
            plp = {"b": chunk}
            sched.update_from_output(so, ModelRunnerOutput(req_ids=[], sampled_token_ids=[], prompt_logprobs=plp))
        done = req.num_computed_tokens == req.num_tokens
        outs = sched.update_from_output(
            so, ModelRunnerOutput(req_ids=["b"], sampled_token_ids=[[7] if done else []], prompt_logprobs=plp)
        )
        firsts += [o for o in outs if o.req_id == "b"]
    assert firsts[0].prompt_logprobs is not None and all(o.prompt_logprobs is None for o in firsts[1:])
    got = firsts[0].prompt_logprobs
    assert got.token_ids == [[t] for t in prompt[1:]] and got.logprobs == [[-float(i)] for i in range(1, 29)]


def test_aborted_requests_computed_blocks_serve_the_same_prompt_again():
    sched = make_scheduler(num_blocks=32, max_num_batched_tokens=8)
    prompt = list(range(1, 30))
    sched.add_request(make_request("a", prompt))
    d = Driver(sched)
    d.step()
    d.step()  # 16 of 29 prompt tokens computed
    d.record(sched.abort_requests(["a"]))
    sched.add_request(make_request("a2", prompt))
    so, _ = d.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 16
    d.drain()


def test_cache_salt_isolates_prefixes():
    sched = make_scheduler(num_blocks=32)
    prompt = list(range(1, 20))
    sched.add_request(make_request("a", prompt, max_tokens=1, cache_salt="alice"))
    d = Driver(sched)
    d.step()
    sched.add_request(make_request("b", prompt, max_tokens=1, cache_salt="bob"))
    sched.add_request(make_request("c", prompt, max_tokens=1, cache_salt="alice"))
    so, _ = d.step()
    hits = {nr.req_id: nr.num_computed_tokens for nr in so.scheduled_new_reqs}
    assert hits == {"b": 0, "c": 16}


def test_diff_delivers_each_sampled_token_exactly_once():
    # A budget smaller than the decode batch leaves some requests unscheduled for a step.
    sched = make_scheduler(max_num_batched_tokens=3, num_blocks=64)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", 2, max_tokens=6, ignore_eos=True))
    d = Driver(sched, seed=3)
    d.drain()
    for i in range(5):
        r = f"r{i}"
        sent = []
        for so in d.history:
            c = so.scheduled_cached_reqs
            for rid, toks in zip(c.req_ids, c.new_token_ids):
                if rid == r:
                    sent.extend(toks)
        # Every sampled token except the last (never fed back) crosses exactly once.
        assert sent == d.outputs[r][:-1]


def test_request_fields_and_status():
    r = Request("q", [1, 2], SamplingParams(max_tokens=None))
    assert r.status == RequestStatus.WAITING and not r.is_finished and r.finish_reason is None
    assert r.num_cached_tokens == -1 and r.max_tokens is None
    r.resolve_max_tokens(10)
    assert r.max_tokens == 8
    r.append_output_token_ids([3, 4])
    assert r.all_token_ids == [1, 2, 3, 4] and r.num_output_tokens == 2 and r.prompt_token_ids == [1, 2]
    for status, reason in [
        (RequestStatus.FINISHED_STOPPED, "stop"),
        (RequestStatus.FINISHED_LENGTH, "length"),
        (RequestStatus.FINISHED_ABORTED, "abort"),
        (RequestStatus.FINISHED_ERROR, "error"),
    ]:
        assert status.is_finished and status.finish_reason == reason
    assert not RequestStatus.PREEMPTED.is_finished
    assert not RequestStatus.WAITING_FOR_GRAMMAR.is_finished


# -- the grammar wait state ---------------------------------------------------------------

DIGITS = StructuredOutputs("regex", "[0-9]+")


def test_a_request_waits_for_its_grammar_while_others_run():
    sched = make_scheduler()
    sched.add_request(make_request("plain", 4, max_tokens=8, ignore_eos=True))
    sched.add_request(make_request("json", 4, max_tokens=2, ignore_eos=True, structured_outputs=DIGITS))
    assert sched.num_waiting == 2 and sched.get_request("json").status == RequestStatus.WAITING_FOR_GRAMMAR
    so, _ = one_step(sched)
    assert so.grammars == {"json": DIGITS} and list(so.num_scheduled_tokens) == ["plain"]
    for _ in range(3):  # the grammar is sent once; the request holds no blocks meanwhile
        so, _ = one_step(sched)
        assert not so.grammars and list(so.num_scheduled_tokens) == ["plain"]
        assert sched.kv_cache_manager.get_blocks("json") == []
    so = sched.schedule()
    outs = sched.update_from_output(so, ModelRunnerOutput(["plain"], [[7]], grammars_ready=["json"]))
    assert sched.get_request("json").status == RequestStatus.WAITING and [o.req_id for o in outs] == ["plain"]
    so, _ = one_step(sched)
    assert set(so.num_scheduled_tokens) == {"plain", "json"}
    # Preempted and resumed, the request does not wait again: the workers keep compiled grammars.
    req = sched.requests["json"]
    sched.running.remove(req)
    sched._preempt(req)
    so, _ = one_step(sched)
    assert not so.grammars and "json" in so.num_scheduled_tokens


def test_an_empty_step_carries_the_grammar_and_its_failure_finishes_the_request():
    sched = make_scheduler()
    sched.add_request(make_request("bad", 4, structured_outputs=StructuredOutputs("regex", "(")))
    so = sched.schedule()
    assert so.is_empty and set(so.grammars) == {"bad"}  # the engine still sends it: the workers must hear
    assert sched.update_from_output(so, ModelRunnerOutput([], [])) == []
    so = sched.schedule()
    outs = sched.update_from_output(so, ModelRunnerOutput([], [], grammar_errors={"bad": "invalid regex: ("}))
    assert [(o.req_id, o.finish_reason) for o in outs] == [("bad", "error")]
    assert "invalid regex: (" in outs[0].error and not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_usable_blocks


def test_aborting_a_request_that_waits_for_its_grammar():
    sched = make_scheduler()
    sched.add_request(make_request("a", 4, structured_outputs=DIGITS))
    sched.add_request(make_request("b", 4, structured_outputs=DIGITS))
    assert [o.finish_reason for o in sched.abort_requests(["a"])] == ["abort"]
    so = sched.schedule()
    assert set(so.grammars) == {"b"} and not so.finished_req_ids  # "a" never reached the workers
    sched.abort_requests(["b"])
    so = sched.schedule()  # a late report for an aborted request is ignored
    assert sched.update_from_output(so, ModelRunnerOutput([], [], grammars_ready=["b"])) == []
    assert not sched.has_unfinished_requests() and sched.num_waiting == 0


def test_a_request_added_late_waits_ahead_of_those_that_arrived_after_it():
    """n > 1 siblings join once the first sequence has prefilled: with arrival order kept,
    they take the next seats ahead of requests that arrived after their parent (they went to
    the back, and later requests took their seats)."""
    sched = make_scheduler(max_num_seqs=2)
    sched.add_request(make_request("parent", 8, max_tokens=4, arrival_time=1.0))
    sched.add_request(make_request("later-1", 8, max_tokens=4, arrival_time=3.0))
    sched.add_request(make_request("later-2", 8, max_tokens=4, arrival_time=4.0))
    sched.add_request(make_request("sibling", 8, max_tokens=4, arrival_time=1.0))  # joins after the parent's prefill
    assert [r.req_id for r in sched.waiting] == ["parent", "sibling", "later-1", "later-2"]
    so = sched.schedule()
    assert set(so.num_scheduled_tokens) == {"parent", "sibling"}
