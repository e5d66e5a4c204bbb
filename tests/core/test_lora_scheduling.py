"""LoRA in the scheduler: at most ``max_loras`` adapters among the running requests, others
go past a request that waits for a slot, the adapter in the first block's hash, and a
request the workers could not run (``request_errors``) ends alone with its message."""

from __future__ import annotations

import pytest

from aiolm.core.kv_cache import hash_block_tokens, root_hash
from aiolm.core.request import Request
from aiolm.core.step import ModelRunnerOutput
from aiolm.lora.request import LoRARequest
from aiolm.params import SamplingParams

from .sim import EOS, Driver, check_scheduler, make_scheduler

ADAPTERS = {i: LoRARequest(f"ad{i}", i, f"/adapters/ad{i}") for i in (1, 2, 3)}


def lora_request(req_id: str, prompt: list[int] | int, lora: int | None, max_tokens: int = 4) -> Request:
    """A request on adapter ``lora`` (None: the base model); an int prompt is tokens 1..n."""
    tokens = list(range(1, prompt + 1)) if isinstance(prompt, int) else list(prompt)
    sp = SamplingParams(max_tokens=max_tokens, eos_token_ids=(EOS,))
    return Request(req_id, tokens, sp, lora_request=ADAPTERS[lora] if lora is not None else None)


def adapters_of(reqs: list[Request]) -> set[int]:
    return {r.lora_request.lora_int_id for r in reqs if r.lora_request is not None}


def scheduled(so) -> set[str]:
    return set(so.num_scheduled_tokens)


# -- how many adapters run at once ---------------------------------------------------


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_running_requests_never_hold_more_adapters_than_slots(policy):
    sched = make_scheduler(max_loras=2, policy=policy)
    reqs = {}
    # Interleaved arrivals: adapters 1, 2, 3 and the base, short and long outputs.
    for i in range(12):
        lora = [1, 2, 3, None][i % 4]
        r = lora_request(f"r{i}", 6 + i, lora, max_tokens=2 + (i * 5) % 7)
        r.arrival_time = float(i)  # the priority queue orders equal priorities by arrival
        reqs[r.req_id] = r
        sched.add_request(r)
    d = Driver(sched)
    seen: set[int] = set()
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        so, _ = d.step()
        step_adapters = adapters_of([reqs[rid] for rid in scheduled(so)])
        assert len(step_adapters) <= 2, f"step {len(d.history)} runs adapters {step_adapters}"
        assert len(adapters_of(sched.running)) <= 2
        seen |= step_adapters
    d.drain()
    assert seen == {1, 2, 3}
    assert set(d.finished) == set(reqs)
    assert all(o.finish_reason == "length" for o in d.finished.values())


def test_a_request_waiting_for_a_slot_lets_the_ones_behind_it_run():
    sched = make_scheduler(max_loras=2)
    sched.add_request(lora_request("a1", 8, 1, max_tokens=3))
    sched.add_request(lora_request("a2", 8, 2, max_tokens=6))
    sched.add_request(lora_request("a3", 8, 3, max_tokens=2))  # a third adapter: waits
    sched.add_request(lora_request("base", 8, None, max_tokens=6))  # behind it, but needs no slot
    sched.add_request(lora_request("a1-again", 8, 1, max_tokens=3))  # adapter 1 already runs
    sched.add_request(lora_request("a3-again", 8, 3, max_tokens=2))
    d = Driver(sched)
    so, _ = d.step()
    assert scheduled(so) == {"a1", "a2", "base", "a1-again"}
    # The skipped ones keep their places at the front of the queue.
    assert [r.req_id for r in sched.waiting] == ["a3", "a3-again"]
    so, _ = d.step()
    assert "a3" not in scheduled(so)
    # Adapter 1's requests finish after their third token; the next step admits adapter 3.
    while {"a1", "a1-again"} - set(d.finished):
        so, _ = d.step()
        assert not {"a3", "a3-again"} & scheduled(so)
    assert "a2" not in d.finished  # adapter 2 still holds the other slot
    so, _ = d.step()
    assert {"a3", "a3-again"} <= {nr.req_id for nr in so.scheduled_new_reqs}
    assert adapters_of(sched.running) == {2, 3}
    d.drain()
    assert set(d.finished) == {"a1", "a2", "a3", "base", "a1-again", "a3-again"}


def test_without_max_loras_adapters_are_not_counted():
    """max_loras=0 (no LoRA) puts no limit on adapters: the check is off, not zero slots."""
    sched = make_scheduler()
    for i in (1, 2, 3):
        sched.add_request(lora_request(f"a{i}", 8, i))
    so, _ = Driver(sched).step()
    assert scheduled(so) == {"a1", "a2", "a3"}


# -- block hashes -------------------------------------------------------------------


def hashes(req: Request, sched) -> list[bytes]:
    sched.add_request(req)
    return list(req.block_hashes)


def test_the_adapter_is_part_of_every_block_hash():
    sched = make_scheduler(block_size=4, hash_seed=0)
    tokens = list(range(10, 30))  # five full blocks
    base = hashes(lora_request("base", tokens, None), sched)
    base2 = hashes(lora_request("base2", tokens, None), sched)
    one = hashes(lora_request("one", tokens, 1), sched)
    one2 = hashes(lora_request("one2", tokens, 1), sched)
    two = hashes(lora_request("two", tokens, 2), sched)
    assert len(base) == 5
    assert one == one2 and base == base2
    # Chained from the first block: no block of one adapter matches another's, or the base's.
    assert not set(one) & set(two) and not set(one) & set(base) and not set(two) & set(base)
    # Without an adapter the hashes are the tokens' alone, as before LoRA existed.
    parent, expected = root_hash(0), []
    for i in range(0, 20, 4):
        parent = hash_block_tokens(parent, tokens[i : i + 4])
        expected.append(parent)
    assert base == expected
    # The adapter's id and folder both name it: the same name with another id or folder differs.
    other_id = Request("x", tokens, SamplingParams(max_tokens=2), lora_request=LoRARequest("ad1", 9, "/adapters/ad1"))
    other_dir = Request("y", tokens, SamplingParams(max_tokens=2), lora_request=LoRARequest("ad1", 1, "/elsewhere"))
    assert len({hashes(other_id, sched)[0], hashes(other_dir, sched)[0], one[0]}) == 3


def test_prefix_cache_hits_only_within_one_adapter():
    sched = make_scheduler(block_size=4)
    tokens = list(range(10, 27))  # four full blocks and one token
    d = Driver(sched)

    def run(req_id: str, lora: int | None) -> int:
        r = lora_request(req_id, tokens, lora, max_tokens=2)
        sched.add_request(r)
        d.drain()
        return d.finished[req_id].num_cached_tokens

    assert run("a", 1) == 0
    assert run("a-again", 1) == 16
    assert run("b", 2) == 0
    assert run("base", None) == 0
    assert run("b-again", 2) == 16


# -- request_errors ---------------------------------------------------------------------


def step_with_errors(d: Driver, errors: dict[str, str], token: int = 7):
    """One Driver step whose runner output names ``errors`` (their sampled tokens are sent too)."""
    so = d.sched.schedule()
    d.history.append(so)
    check_scheduler(d.sched, so)
    sampling = d.worker.apply(so)
    d.worker.check(d.sched, so)
    out = ModelRunnerOutput(req_ids=sampling, sampled_token_ids=[[token] for _ in sampling], request_errors=errors)
    outs = d.sched.update_from_output(so, out)
    d.record(outs)
    check_scheduler(d.sched)
    return so, outs


def test_a_request_error_ends_that_request_frees_its_blocks_and_others_go_on():
    sched = make_scheduler(block_size=4, num_blocks=64)
    kv = sched.kv_cache_manager
    for rid, lora in (("a", 1), ("b", 2), ("base", None)):
        sched.add_request(lora_request(rid, 10, lora, max_tokens=4))
    d = Driver(sched)
    d.step()  # every prompt ran; one token each
    held = len(kv.get_blocks("b"))
    free_before = kv.num_free_blocks
    message = "adapter 'ad2' (/adapters/ad2) cannot be loaded: no such folder"
    so, outs = step_with_errors(d, {"b": message})
    by_id = {o.req_id: o for o in outs}
    assert by_id["b"].finish_reason == "error" and by_id["b"].error == message
    assert by_id["b"].new_token_ids == []  # the token it was sampled without its adapter is dropped
    assert by_id["a"].new_token_ids == [7] and by_id["base"].new_token_ids == [7]
    assert not by_id["a"].finished and not by_id["base"].finished
    assert "b" not in sched.requests and "b" not in kv.req_to_blocks
    assert {r.req_id for r in sched.running} == {"a", "base"}
    # a and base needed no new block this step (11 tokens fit their 3), so the change is b's
    assert kv.num_free_blocks == free_before + held
    so, _ = d.step()
    assert "b" in so.finished_req_ids and scheduled(so) == {"a", "base"}
    d.drain()
    assert len(d.outputs["a"]) == 4 and len(d.outputs["base"]) == 4
    assert d.finished["b"].error == message
    assert kv.usage == 0.0


def test_a_request_error_during_a_chunked_prefill():
    """The workers fail a request in the first step it appears, before its prompt is done."""
    sched = make_scheduler(block_size=4, max_num_batched_tokens=8)
    sched.add_request(lora_request("long", 20, 3, max_tokens=3))
    d = Driver(sched)
    so, outs = step_with_errors(d, {"long": "cannot be loaded"})
    assert so.num_scheduled_tokens == {"long": 8}
    assert [(o.req_id, o.finish_reason, o.error) for o in outs] == [("long", "error", "cannot be loaded")]
    assert not sched.has_unfinished_requests() and sched.kv_cache_manager.usage == 0.0
    assert sched.schedule().finished_req_ids == {"long"}
    # its blocks were computed without the adapter their hashes name: none stays a prefix hit
    assert sched.kv_cache_manager.pool.cached == {}
    sched.add_request(lora_request("again", 20, 3, max_tokens=3))
    assert sched.schedule().scheduled_new_reqs[0].num_computed_tokens == 0


def test_a_failed_request_keeps_the_prefix_it_found_cached():
    """Blocks another request computed stay published when one that hit them fails."""
    sched = make_scheduler(block_size=4, max_num_batched_tokens=64)
    sched.add_request(lora_request("first", 12, 3, max_tokens=1))
    d = Driver(sched)
    d.drain()
    cached = dict(sched.kv_cache_manager.pool.cached)
    assert len(cached) == 3
    sched.add_request(lora_request("second", list(range(1, 13)) + [40, 41, 42, 43, 44], 3, max_tokens=3))
    so, _ = step_with_errors(d, {"second": "cannot be loaded"})
    assert so.scheduled_new_reqs[0].num_computed_tokens == 12  # it published tokens 12-15's block
    assert sched.kv_cache_manager.pool.cached == cached


def test_an_error_for_a_request_aborted_while_its_step_ran_is_ignored():
    sched = make_scheduler()
    sched.add_request(lora_request("a", 6, 1, max_tokens=1))
    so = sched.schedule()
    (aborted,) = sched.abort_requests(["a"])
    assert aborted.finish_reason == "abort"
    outs = sched.update_from_output(
        so, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[7]], request_errors={"a": "x"})
    )
    assert outs == []  # it stays aborted: no second, error, ending
    assert sched.requests == {} and sched.kv_cache_manager.usage == 0.0
