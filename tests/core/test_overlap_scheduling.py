"""Overlap (async) and pipeline scheduling against a simulated worker that runs steps in order.

Overlap: the engine core submits step N+1 before it reads step N's result; the worker
fills step N+1's placeholder inputs from the tokens it sampled itself. Pipeline (P
stages): P steps are in flight, a request with a token in one of them waits for it, and
the engine sends that token in a later step's diff. Tokens here are a
pure function of (request, position), as greedy decoding of a fixed model is, so
every request must produce exactly the tokens the serial schedule produces, under
chunked prefill, prefix caching, preemption, stops and aborts, with every block
free at the end.
"""

from __future__ import annotations

import zlib
from collections import deque

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiolm.core.request import RequestStatus
from aiolm.core.scheduler import Scheduler
from aiolm.core.step import ModelRunnerOutput, SchedulerOutput

from .sim import EOS, check_scheduler, make_request, make_scheduler


def next_token(req_id: str, tokens: list[int]) -> int:
    """What a greedy model would sample after ``tokens``: deterministic, EOS now and then."""
    h = zlib.crc32(f"{req_id}:{len(tokens)}:{tokens[-1]}".encode())
    return EOS if h % 9 == 0 else 1 + h % 40


class OrderedWorker:
    """A persistent batch fed only by diffs that appends its own samples (overlap) or
    takes them from the diff (serial), and runs each step as soon as it is sent."""

    def __init__(self, overlap: bool) -> None:
        self.overlap = overlap
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def run(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.tokens.pop(rid, None)
            self.computed.pop(rid, None)
        for nr in so.scheduled_new_reqs:
            self.tokens[nr.req_id] = list(nr.prompt_token_ids) + list(nr.output_token_ids)
            self.computed[nr.req_id] = nr.num_computed_tokens
        c = so.scheduled_cached_reqs
        for rid, toks, ncomp in zip(c.req_ids, c.new_token_ids, c.num_computed_tokens):
            assert self.computed[rid] == ncomp, f"{rid}: worker computed {self.computed[rid]}, told {ncomp}"
            if self.overlap:
                assert toks == [], "overlap: the engine never sends back what the worker sampled"
            self.tokens[rid].extend(toks)
        ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            toks = self.tokens[rid]
            self.computed[rid] += n
            assert self.computed[rid] <= len(toks), f"{rid} scheduled past the tokens the worker holds"
            ids.append(rid)
            if self.computed[rid] == len(toks):
                tok = next_token(rid, toks)
                sampled.append([tok])
                if self.overlap:
                    toks.append(tok)
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled)


def run_program(
    sched: Scheduler,
    overlap: bool,
    arrivals: dict[int, list],
    aborts: dict[int, list[str]],
    max_steps: int = 3000,
    depth: int | None = None,
) -> dict[str, tuple[list[int], str | None]]:
    """Drive ``sched`` like the engine core: serial, up to two steps in flight (overlap), or
    ``depth`` steps in flight (a pipeline of that many stages)."""
    worker = OrderedWorker(overlap)
    depth = depth or (2 if overlap else 1)
    inflight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
    outputs: dict[str, list[int]] = {}
    finish: dict[str, str | None] = {}

    def record(outs) -> None:
        for o in outs:
            assert finish.get(o.req_id) is None, f"output after finish for {o.req_id}"
            outputs.setdefault(o.req_id, []).extend(o.new_token_ids)
            finish[o.req_id] = o.finish_reason

    for step in range(max_steps):
        for req in arrivals.get(step, []):
            sched.add_request(req)
        if step in aborts:
            record(sched.abort_requests(aborts[step]))
        if not sched.has_unfinished_requests() and not inflight and step > max(arrivals, default=0):
            break
        submitted = False
        if len(inflight) < depth and sched.has_unfinished_requests():
            so = sched.schedule()
            check_scheduler(sched, so)
            if depth > 1 and not overlap:  # a pipeline: a token in flight holds its request back
                sampling = {rid for _, out in inflight for rid, t in zip(out.req_ids, out.sampled_token_ids) if t}
                assert not sampling & set(so.num_scheduled_tokens), "scheduled again before its token came back"
            if so.total_num_scheduled_tokens or so.finished_req_ids or not inflight:
                inflight.append((so, worker.run(so)))
                submitted = True
            else:
                record(sched.update_from_output(so, None))
        if inflight and not (submitted and len(inflight) < depth):  # as EngineCore fills its pipeline
            so, runner_output = inflight.popleft()
            record(sched.update_from_output(so, runner_output))
            check_scheduler(sched)
            for req in sched.running if overlap else ():  # the workers hold the known tokens + placeholders
                held = worker.tokens[req.req_id]
                assert len(held) == req.num_tokens + req.num_output_placeholders
                assert held[: req.num_tokens] == req.all_token_ids
    assert not sched.has_unfinished_requests() and not inflight, "requests did not finish"
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks and kv.check_invariants() == []
    return {rid: (toks, finish.get(rid)) for rid, toks in outputs.items()}


def program(data, n_reqs: int) -> tuple[dict, dict, list[tuple]]:
    specs = []
    for i in range(n_reqs):
        prompt = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=30), label=f"prompt{i}")
        if data.draw(st.booleans(), label=f"shared{i}"):
            prompt = list(range(1, 13)) + prompt[:10]  # shared prefixes: prefix-cache hits
        max_tokens = data.draw(st.one_of(st.none(), st.integers(1, 12)), label=f"max{i}")
        arrive = data.draw(st.integers(0, 12), label=f"arrive{i}")
        ignore_eos = data.draw(st.booleans(), label=f"ignore_eos{i}")
        min_tokens = data.draw(st.integers(0, 3), label=f"min{i}")
        if max_tokens is not None:
            min_tokens = min(min_tokens, max_tokens)
        specs.append((f"r{i}", prompt, max_tokens, arrive, ignore_eos, min_tokens))
    return specs


def build(specs, aborts_at: dict[int, list[str]]):
    arrivals: dict[int, list] = {}
    for rid, prompt, max_tokens, arrive, ignore_eos, min_tokens in specs:
        arrivals.setdefault(arrive, []).append(
            make_request(
                rid,
                prompt,
                max_tokens=max_tokens,
                ignore_eos=ignore_eos,
                min_tokens=min_tokens,
                arrival_time=float(int(rid[1:])),
            )
        )
    return arrivals


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    num_blocks=st.integers(9, 24),
    budget=st.integers(1, 24),
    max_num_seqs=st.integers(1, 6),
    threshold=st.sampled_from([0, 0, 3]),
    policy=st.sampled_from(["fcfs", "priority"]),
    caching=st.booleans(),
)
def test_overlap_produces_the_serial_tokens(data, num_blocks, budget, max_num_seqs, threshold, policy, caching):
    specs = program(data, data.draw(st.integers(1, 7), label="n"))
    aborted = data.draw(st.lists(st.sampled_from([s[0] for s in specs]), max_size=2, unique=True), label="abort")
    abort_step = data.draw(st.integers(0, 30), label="abort_step")
    results = {}
    for overlap, depth in ((False, 1), (True, 2), (False, 3)):
        sched = make_scheduler(
            num_blocks=num_blocks,
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            long_prefill_token_threshold=threshold,
            policy=policy,
            enable_prefix_caching=caching,
            max_model_len=48,
            async_scheduling=overlap,
            pipeline_depth=1 if overlap else depth,
        )
        results[depth] = run_program(sched, overlap, build(specs, {}), {abort_step: aborted}, depth=depth)
    serial = results[1]
    for other in (results[2], results[3]):
        for rid, *_ in specs:
            if rid in aborted:  # aborted at another point of its life: its tokens so far are a prefix
                a, b = serial.get(rid, ([], None))[0], other.get(rid, ([], None))[0]
                n = min(len(a), len(b))
                assert a[:n] == b[:n]
                continue
            assert other[rid] == serial[rid], rid
            assert serial[rid][1] in ("stop", "length", "error")


def test_a_stop_at_step_n_discards_the_token_of_step_n_plus_1():
    """The request is scheduled again before its EOS is seen: the extra token never shows."""
    sched = make_scheduler(async_scheduling=True)
    worker = OrderedWorker(overlap=True)
    sched.add_request(make_request("r", [3, 4, 5], max_tokens=10))
    so1 = sched.schedule()
    worker.run(so1)  # its reply is replaced by eos below
    so2 = sched.schedule()  # before so1's token is known: a placeholder decode
    assert so2.num_scheduled_tokens == {"r": 1}
    assert sched.requests["r"].num_output_placeholders == 2
    runner_output2 = worker.run(so2)
    eos = ModelRunnerOutput(["r"], [[EOS]])  # step 1 sampled EOS after all
    (out,) = sched.update_from_output(so1, eos)
    assert out.new_token_ids == [EOS] and out.finish_reason == "stop"
    assert sched.kv_cache_manager.usage == 0.0  # freed now: step 2, still running, was sent first
    assert sched.update_from_output(so2, runner_output2) == []  # step 2's token is dropped
    so3 = sched.schedule()
    assert so3.finished_req_ids == {"r"} and not so3.num_scheduled_tokens
    assert not sched.has_unfinished_requests()


def test_max_tokens_reached_by_placeholders_is_not_scheduled_again():
    sched = make_scheduler(async_scheduling=True)
    sched.add_request(make_request("r", [3, 4, 5], max_tokens=2, ignore_eos=True))
    so1 = sched.schedule()
    so2 = sched.schedule()
    assert so2.num_scheduled_tokens == {"r": 1}
    so3 = sched.schedule()  # two tokens in flight: max_tokens reached
    assert so3.num_scheduled_tokens == {}
    sched.update_from_output(so3, None)
    (o1,) = sched.update_from_output(so1, ModelRunnerOutput(["r"], [[7]]))
    (o2,) = sched.update_from_output(so2, ModelRunnerOutput(["r"], [[8]]))
    assert (o1.new_token_ids, o1.finish_reason) == ([7], None)
    assert (o2.new_token_ids, o2.finish_reason) == ([8], "length")


@pytest.mark.parametrize("max_tokens", [5, 8, 9, 13])
def test_a_finished_output_leaves_as_many_blocks_in_the_prefix_cache_as_serial(max_tokens):
    """The block that an output's last known token fills is published under overlap too,
    where that token was still a placeholder when the step computing its KV was scheduled:
    the next turn of a chat (the prompt plus the answer) hits as many cached tokens."""
    cached = {}
    for overlap in (False, True):
        sched = make_scheduler(async_scheduling=overlap)
        first = make_request("a", [3, 4, 5], max_tokens=max_tokens, ignore_eos=True)
        out = run_program(sched, overlap, {0: [first]}, {})
        turn = make_request("b", first.all_token_ids + [6], max_tokens=1, ignore_eos=True)
        run_program(sched, overlap, {0: [turn]}, {})
        cached[overlap] = turn.num_cached_tokens
        assert out["a"][0] == first.output_token_ids and len(first.output_token_ids) == max_tokens
    # KV exists for the prompt and every output token but the last (sampled, never computed)
    assert cached[False] == (3 + max_tokens - 1) // 4 * 4
    assert cached[True] == cached[False]


def test_preempted_while_in_flight_keeps_its_token():
    """A request preempted while a step samples for it appends that token when it arrives,
    as it would have without overlap, and resumes with it."""
    sched = make_scheduler(num_blocks=5, block_size=4, async_scheduling=True)  # 4 usable blocks
    sched.add_request(make_request("a", list(range(1, 8)), max_tokens=8, ignore_eos=True, arrival_time=0.0))
    sched.add_request(
        make_request("b", list(range(1, 8)), max_tokens=8, ignore_eos=True, arrival_time=1.0, cache_salt="x")
    )
    so1 = sched.schedule()  # both prefill 7 tokens: 2 blocks each, the pool is full
    assert so1.num_scheduled_tokens == {"a": 7, "b": 7}
    so2 = sched.schedule()  # both decode position 7 (still in their second block)
    assert so2.num_scheduled_tokens == {"a": 1, "b": 1}
    so3 = sched.schedule()  # position 8 needs a third block each: b (the latest) is preempted
    b = sched.get_request("b")
    assert b.status is RequestStatus.PREEMPTED and b.num_output_placeholders == 2
    assert "b" in so3.finished_req_ids and so3.num_scheduled_tokens == {"a": 1}
    sched.update_from_output(so1, ModelRunnerOutput(["a", "b"], [[11], [21]]))
    sched.update_from_output(so2, ModelRunnerOutput(["a", "b"], [[12], [22]]))
    assert b.output_token_ids == [21, 22] and b.num_output_placeholders == 0
    sched.update_from_output(so3, ModelRunnerOutput(["a"], [[13]]))
    assert sched.get_request("a").output_token_ids == [11, 12, 13]


def test_a_pipeline_shares_a_decode_batch_out_among_its_steps():
    """Three stages, six decoding requests: each step in flight takes two of them, and none
    is scheduled again before its token is back; that token then comes in the diff."""
    sched = make_scheduler(pipeline_depth=3, max_num_batched_tokens=64)
    for i in range(6):
        sched.add_request(make_request(f"r{i}", [3, 4, 5], max_tokens=5, ignore_eos=True))
    prefill = sched.schedule()  # all six prompts, one step
    assert len(prefill.num_scheduled_tokens) == 6
    sched.update_from_output(prefill, ModelRunnerOutput(sorted(prefill.num_scheduled_tokens), [[7]] * 6))
    steps = [sched.schedule() for _ in range(3)]
    rows = [set(so.num_scheduled_tokens) for so in steps]
    assert [len(r) for r in rows] == [2, 2, 2] and len(set.union(*rows)) == 6
    assert sched.schedule().num_scheduled_tokens == {}  # every request has a token in flight
    first = steps[0]
    sched.update_from_output(first, ModelRunnerOutput(sorted(rows[0]), [[8], [8]]))
    again = sched.schedule()
    assert set(again.num_scheduled_tokens) <= rows[0] and again.num_scheduled_tokens
    c = again.scheduled_cached_reqs
    assert all(toks == [8] for toks in c.new_token_ids)  # the engine hands the token to the first stage
