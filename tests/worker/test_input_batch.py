"""InputBatch: the worker's persistent batch, fed only by SchedulerOutput diffs.

Checked three ways: hand-built diffs (rows stay compact, a resumed request is
rebuilt), prepare() against a plain-Python computation of the flat inputs, and
random runs of the real Scheduler whose every step is replayed into an InputBatch
and compared with the scheduler's own Request state.
"""

from __future__ import annotations

import random

import pytest
import torch

from aiolm.core.request import Request
from aiolm.core.scheduler import Scheduler, SchedulerConfig
from aiolm.core.step import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from aiolm.params import SamplingParams
from aiolm.worker.input_batch import InputBatch

CPU = torch.device("cpu")
BS = 4


def _sp(**kw) -> SamplingParams:
    kw.setdefault("max_tokens", 8)
    return SamplingParams(**kw)


def _new(
    rid: str, prompt: list[int], blocks: list[int], computed: int = 0, output: list[int] | None = None, **sp
) -> NewRequestData:
    return NewRequestData(rid, list(prompt), list(output or []), _sp(**sp), list(blocks), computed)


def _so(new=(), cached=None, sched=None, finished=()) -> SchedulerOutput:
    sched = dict(sched or {})
    return SchedulerOutput(
        step=0,
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached or CachedRequestData(),
        num_scheduled_tokens=sched,
        total_num_scheduled_tokens=sum(sched.values()),
        finished_req_ids=set(finished),
    )


def _check_compact(b: InputBatch) -> None:
    """Rows [0, len) hold exactly the live requests, row_of agrees, nothing beyond."""
    n = len(b)
    assert b.num_rows == n
    assert sorted(b.row_of.values()) == list(range(n))
    for rid, row in b.row_of.items():
        assert b.req_ids[row] == rid
        assert b.params[row] is not None
    assert all(r is None for r in b.req_ids[n:])
    assert all(p is None for p in b.params[n:])


def _row_tokens(b: InputBatch, rid: str) -> list[int]:
    row = b.row_of[rid]
    return b.token_ids[row, : b.num_tokens[row]].tolist()


def _row_blocks(b: InputBatch, rid: str) -> list[int]:
    row = b.row_of[rid]
    return b.block_table[row, : b.num_blocks[row]].tolist()


# -- hand-built diffs ----------------------------------------------------------------


def test_add_remove_condense_keeps_rows_compact_and_data_with_its_row():
    b = InputBatch(max_num_reqs=8, max_model_len=64, block_size=BS)
    prompts = {f"r{i}": list(range(100 * i + 1, 100 * i + 3 + i)) for i in range(6)}
    blocks = {f"r{i}": [10 * i + 1, 10 * i + 2] for i in range(6)}
    b.update(
        _so(new=[_new(r, p, blocks[r]) for r, p in prompts.items()], sched={r: len(p) for r, p in prompts.items()})
    )
    _check_compact(b)
    assert [b.req_ids[i] for i in range(6)] == list(prompts)  # added in order

    # Drop a middle row, the first row and the last row in one step; one request decodes.
    b.update(
        _so(
            finished={"r0", "r2", "r5"},
            cached=CachedRequestData(["r3"], [[7]], [[99]], [len(prompts["r3"])]),
            sched={"r3": 1},
        )
    )
    _check_compact(b)
    assert set(b.row_of) == {"r1", "r3", "r4"}
    for rid in ("r1", "r4"):
        assert _row_tokens(b, rid) == prompts[rid]
        assert _row_blocks(b, rid) == blocks[rid]
    assert _row_tokens(b, "r3") == prompts["r3"] + [7]
    assert _row_blocks(b, "r3") == blocks["r3"] + [99]
    assert b.num_computed[b.row_of["r3"]] == len(prompts["r3"])
    assert b.prompt_tokens(b.row_of["r3"]).tolist() == prompts["r3"]
    assert b.output_tokens(b.row_of["r3"]).tolist() == [7]

    # Remove and add in the same step: the new one fills a hole, still compact.
    b.update(_so(finished={"r1"}, new=[_new("x", [5, 6, 7], [42], seed=3)], sched={"x": 3}))
    _check_compact(b)
    assert set(b.row_of) == {"r3", "r4", "x"}
    assert _row_tokens(b, "x") == [5, 6, 7] and _row_blocks(b, "x") == [42]
    assert b.generators[b.row_of["x"]] is not None  # seeded request keeps its generator
    assert _row_tokens(b, "r3") == prompts["r3"] + [7]

    # Finishing an unknown id (e.g. aborted before it ever ran) is harmless.
    b.update(_so(finished={"nope", "r3", "r4", "x"}))
    _check_compact(b)
    assert len(b) == 0


def test_persistent_batch_full_raises():
    b = InputBatch(max_num_reqs=2, max_model_len=16, block_size=BS)
    b.update(_so(new=[_new("a", [1], [1]), _new("b", [2], [2])], sched={"a": 1, "b": 1}))
    with pytest.raises(RuntimeError, match="full"):
        b.update(_so(new=[_new("c", [3], [3])], sched={"c": 1}))


@pytest.mark.parametrize("told_finished", [True, False])
def test_resumed_request_replaces_its_row(told_finished):
    """After preemption a request comes back as new, with its outputs and fresh blocks."""
    b = InputBatch(max_num_reqs=4, max_model_len=64, block_size=BS)
    b.update(_so(new=[_new("a", [1, 2, 3, 4, 5], [3, 4]), _new("b", [9, 9], [5])], sched={"a": 5, "b": 2}))
    b.update(_so(cached=CachedRequestData(["a", "b"], [[6], [8]], [[], []], [5, 2]), sched={"a": 1, "b": 1}))
    b.update(_so(cached=CachedRequestData(["a", "b"], [[7], [8]], [[11], []], [6, 3]), sched={"a": 1, "b": 1}))
    assert _row_tokens(b, "a") == [1, 2, 3, 4, 5, 6, 7]
    assert _row_blocks(b, "a") == [3, 4, 11]
    # "a" was preempted (its blocks freed), now resumed: prompt + 3 outputs, a
    # prefix-cache hit on one block, different block ids.
    resumed = _new("a", [1, 2, 3, 4, 5], [3, 20], computed=4, output=[6, 7, 8])
    b.update(_so(finished={"a"} if told_finished else (), new=[resumed], sched={"a": 4}))
    _check_compact(b)
    assert len(b) == 2
    row = b.row_of["a"]
    assert _row_tokens(b, "a") == [1, 2, 3, 4, 5, 6, 7, 8]
    assert b.num_prompt[row] == 5
    assert b.output_tokens(row).tolist() == [6, 7, 8]
    assert _row_blocks(b, "a") == [3, 20]
    assert b.num_computed[row] == 4
    step = b.prepare(_so(sched={"a": 4}), CPU)
    assert step.req_ids == ["a"]
    assert step.input_ids.tolist() == [5, 6, 7, 8]
    assert step.positions.tolist() == [4, 5, 6, 7]
    assert step.slot_mapping.tolist() == [20 * BS + 0, 20 * BS + 1, 20 * BS + 2, 20 * BS + 3]
    assert step.sample_mask == [True]


# -- prepare() against plain Python --------------------------------------------------


def _reference_inputs(
    reqs: dict[str, tuple[list[int], list[int], int]], sched: dict[str, int], order: list[str], bs: int
):
    """Plain lists: rid -> (all tokens, block ids, computed); in ``order``."""
    ids, pos, slots, qsl, seq_lens, sample = [], [], [], [0], [], []
    for rid in order:
        toks, blocks, start = reqs[rid]
        q = sched[rid]
        for p in range(start, start + q):
            ids.append(toks[p])
            pos.append(p)
            slots.append(blocks[p // bs] * bs + p % bs)
        qsl.append(qsl[-1] + q)
        seq_lens.append(start + q)
        sample.append(start + q == len(toks))
    return ids, pos, slots, qsl, seq_lens, sample


def _check_prepare(b: InputBatch, so: SchedulerOutput, reqs) -> None:
    step = b.prepare(so, CPU)
    assert sorted(step.req_ids) == sorted(so.num_scheduled_tokens)
    assert [b.row_of[r] for r in step.req_ids] == step.rows.tolist()
    ids, pos, slots, qsl, seq_lens, sample = _reference_inputs(
        reqs, so.num_scheduled_tokens, step.req_ids, b.block_size
    )
    assert step.input_ids.tolist() == ids
    assert step.positions.tolist() == pos
    assert step.slot_mapping.tolist() == slots
    assert step.query_start_loc.tolist() == qsl
    assert step.seq_lens.tolist() == seq_lens == step.seq_lens_list
    assert step.query_lens == [so.num_scheduled_tokens[r] for r in step.req_ids]
    assert step.sample_mask == sample
    for dt in (step.input_ids, step.positions, step.slot_mapping, step.query_start_loc, step.seq_lens):
        assert dt.dtype == torch.int64
    # Each row of the step's block table starts with the request's blocks, enough for its length.
    width = step.block_table.shape[1]
    assert width * b.block_size >= max(seq_lens)
    for i, rid in enumerate(step.req_ids):
        need = -(-seq_lens[i] // b.block_size)
        assert step.block_table[i, :need].tolist() == reqs[rid][1][:need]


def test_prepare_mixed_chunked_prefill_and_decode_matches_plain_python():
    b = InputBatch(max_num_reqs=8, max_model_len=64, block_size=BS)
    rng = random.Random(1)
    p_long = [rng.randrange(1, 1000) for _ in range(23)]
    p_mid = [rng.randrange(1, 1000) for _ in range(9)]
    p_dec = [rng.randrange(1, 1000) for _ in range(6)]
    p_hit = p_long[:8] + [rng.randrange(1, 1000) for _ in range(5)]  # 2 blocks from the cache
    # Step 1: "dec" prefills fully, "long" prefills a first chunk.
    b.update(_so(new=[_new("dec", p_dec, [7, 8]), _new("long", p_long, [1, 2, 3])], sched={"dec": 6, "long": 10}))
    reqs = {"dec": (p_dec, [7, 8], 0), "long": (p_long, [1, 2, 3], 0)}
    _check_prepare(b, _so(sched={"dec": 6, "long": 10}), reqs)
    # Step 2: a mixed batch. "dec" decodes its sampled token 50, "long" takes a
    # middle chunk (not the last: no sample), "mid" arrives and prefills completely
    # in one go, "hit" arrives with 8 tokens cached and computes the rest.
    so = _so(
        new=[_new("mid", p_mid, [9, 10, 11]), _new("hit", p_hit, [1, 2, 12, 13], computed=8)],
        cached=CachedRequestData(["dec", "long"], [[50], []], [[], [4, 5]], [6, 10]),
        sched={"dec": 1, "long": 9, "mid": 9, "hit": 5},
    )
    b.update(so)
    reqs = {
        "dec": (p_dec + [50], [7, 8], 6),
        "long": (p_long, [1, 2, 3, 4, 5], 10),
        "mid": (p_mid, [9, 10, 11], 0),
        "hit": (p_hit, [1, 2, 12, 13], 8),
    }
    _check_prepare(b, so, reqs)
    step = b.prepare(so, CPU)
    assert dict(zip(step.req_ids, step.sample_mask)) == {"dec": True, "long": False, "mid": True, "hit": True}
    # Step 3: "mid" finished and left a hole; "long" finishes its prefill; a request
    # that is held but not scheduled this step ("hit") is simply absent.
    so = _so(
        finished={"mid"},
        cached=CachedRequestData(["dec", "long"], [[51], []], [[], [6]], [7, 19]),
        sched={"dec": 1, "long": 4},
    )
    b.update(so)
    _check_compact(b)
    reqs = {"dec": (p_dec + [50, 51], [7, 8], 7), "long": (p_long, [1, 2, 3, 4, 5, 6], 19)}
    _check_prepare(b, so, reqs)


# -- random runs of the real scheduler ------------------------------------------------


def _check_against_scheduler(b: InputBatch, sched: Scheduler, so: SchedulerOutput) -> None:
    """After update(): the batch holds exactly the running requests, each as the scheduler says."""
    _check_compact(b)
    assert set(b.row_of) == {r.req_id for r in sched.running}
    kv = sched.kv_cache_manager
    for req in sched.running:
        rid = req.req_id
        row = b.row_of[rid]
        toks = _row_tokens(b, rid)
        assert b.prompt_tokens(row).tolist() == req.prompt_token_ids
        assert _row_blocks(b, rid) == kv.get_block_ids(rid), rid
        n = so.num_scheduled_tokens.get(rid)
        if n is None:
            # Held but skipped this step: it may not have heard of its last token yet.
            assert toks == req.all_token_ids[: len(toks)]
            assert len(toks) >= req.num_tokens - 1
        else:
            assert toks == req.all_token_ids, rid
            assert b.num_computed[row] + n == req.num_computed_tokens, rid


def _run_random(seed: int, steps: int = 160) -> dict[str, int]:
    rng = random.Random(seed)
    bs = BS
    cfg = SchedulerConfig(
        num_blocks=rng.choice([14, 20, 40]),
        block_size=bs,
        max_num_seqs=6,
        max_num_batched_tokens=rng.choice([16, 32]),
        max_model_len=48,
        long_prefill_token_threshold=rng.choice([0, 8]),
        hash_seed=0,
    )
    sched = Scheduler(cfg)
    b = InputBatch(max_num_reqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len, block_size=bs)
    shared = [rng.randrange(1, 500) for _ in range(12)]
    counts = {"preempted": 0, "resumed": 0, "aborted": 0, "cache_hits": 0, "steps": 0}
    next_id = 0
    for _ in range(steps):
        if rng.random() < 0.35 or not sched.has_unfinished_requests():
            for _ in range(rng.randint(1, 3)):
                n = rng.randint(1, 30)
                prompt = [rng.randrange(1, 500) for _ in range(n)]
                if rng.random() < 0.5:
                    prompt = shared[: rng.randint(4, 12)] + prompt[: rng.randint(1, n)]
                sp = SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True, temperature=0.0)
                sched.add_request(Request(f"q{next_id}", prompt, sp))
                next_id += 1
        if sched.requests and rng.random() < 0.08:
            victim = rng.choice(list(sched.requests))
            sched.abort_requests([victim])
            counts["aborted"] += 1
        so = sched.schedule()
        counts["steps"] += 1
        for rid in so.finished_req_ids:
            if rid in sched.requests:
                counts["preempted"] += 1
        for nr in so.scheduled_new_reqs:
            counts["resumed"] += bool(nr.output_token_ids)
            counts["cache_hits"] += nr.num_computed_tokens > 0
        b.update(so)
        _check_against_scheduler(b, sched, so)
        sampled: list[str] = []
        if so.total_num_scheduled_tokens:
            step = b.prepare(so, CPU)
            reqs = {}
            for rid in step.req_ids:
                row = b.row_of[rid]
                reqs[rid] = (_row_tokens(b, rid), _row_blocks(b, rid), int(b.num_computed[row]))
            ids, pos, slots, qsl, seq_lens, sample = _reference_inputs(reqs, so.num_scheduled_tokens, step.req_ids, bs)
            assert step.input_ids.tolist() == ids
            assert step.positions.tolist() == pos
            assert step.slot_mapping.tolist() == slots
            assert step.query_start_loc.tolist() == qsl
            assert step.seq_lens.tolist() == seq_lens
            assert step.sample_mask == sample
            for rid, s in zip(step.req_ids, step.sample_mask):
                req = sched.requests[rid]
                assert s == (req.num_computed_tokens == req.num_tokens), rid
                if s:
                    sampled.append(rid)
        runner_output = ModelRunnerOutput(req_ids=sampled, sampled_token_ids=[[rng.randrange(1, 500)] for _ in sampled])
        sched.update_from_output(so, runner_output)
    # Drain so every block comes back.
    for _ in range(500):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        b.update(so)
        _check_against_scheduler(b, sched, so)
        sampled = []
        if so.total_num_scheduled_tokens:
            step = b.prepare(so, CPU)
            sampled = [r for r, s in zip(step.req_ids, step.sample_mask) if s]
        sched.update_from_output(so, ModelRunnerOutput(sampled, [[1] for _ in sampled]))
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_usable_blocks
    return counts


def test_random_scheduler_diffs_replayed_into_input_batch():
    totals: dict[str, int] = {}
    for seed in range(8):
        for k, v in _run_random(seed).items():
            totals[k] = totals.get(k, 0) + v
    # The runs exercised what matters (preemption with outputs, prefix hits, aborts).
    assert totals["preempted"] > 0, totals
    assert totals["resumed"] > 0, totals
    assert totals["cache_hits"] > 0, totals
    assert totals["aborted"] > 0, totals
