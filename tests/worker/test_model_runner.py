"""The model runner, driven by the real scheduler, reproduces transformers' greedy tokens.

The engine-style loop (schedule -> executor.execute -> update_from_output) runs
on an asyncio loop against a real worker process (MultiprocExecutor) and, as a
quicker sanity check, in process (LocalExecutor). Requests arrive at different
steps, are chunk-prefilled, share a prefix (prefix-cache hit), and a small KV
pool forces preemption and resumption; every request must still produce exactly
the tokens of a plain transformers greedy loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time

import pytest
import torch

from aiolm.config import RunnerConfig
from aiolm.core.request import Request
from aiolm.core.scheduler import Scheduler, SchedulerConfig
from aiolm.params import SamplingParams
from paged import hf_greedy

pytestmark = pytest.mark.slow

MAX_NEW = 24
BLOCK = 16
MAX_MODEL_LEN = 128
BLOCK_BYTES = 30 * 2 * BLOCK * 3 * 64 * 4  # every layer's K and V: 30 layers, 3 KV heads of 64, float32
KV_BLOCKS = 11  # 10 usable (+ the null block): four ~70-token requests cannot all fit
# One intra-op thread: on this shared 2-core box two OpenMP threads that wait on
# each other make every step several times slower (measured: 2-5 s vs 0.2 s).
THREADS = 1

BASE = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based inks and a wooden screw press into a "
    "practical system that could produce books quickly and cheaply. Within fifty years, "
    "presses were running in more than two hundred cities across Europe."
)
TEXTS = {
    "p0": BASE + " Explain why this mattered for science.",
    "p2": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "p1": BASE + " Name two later inventions it inspired.",
    "p3": "List three colours of the rainbow:",
}
# Step at which each request arrives: p1 comes once p0's prefix blocks are cached.
ARRIVAL = {"p0": 0, "p2": 1, "p1": 4, "p3": 6}


def _per_block_bytes(source) -> int:
    c = source.config
    return 2 * BLOCK * c.num_kv_heads * c.head_dim * c.num_layers * 4  # float32


def runner_config(source) -> RunnerConfig:
    return RunnerConfig(
        model=None,
        dtype="float32",
        max_num_seqs=8,
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK,
        kv_cache_memory=KV_BLOCKS * _per_block_bytes(source),
        num_threads=THREADS,
    )


@pytest.fixture(scope="module")
def prompts(tokenizer) -> dict[str, list[int]]:
    ids = {k: tokenizer(t, add_special_tokens=False)["input_ids"] for k, t in TEXTS.items()}
    assert len(os.path.commonprefix([ids["p0"], ids["p1"]])) >= 3 * BLOCK
    assert max(len(p) for p in ids.values()) + MAX_NEW <= MAX_MODEL_LEN
    return ids


@pytest.fixture(scope="module")
def expected(prompts, hf_reference) -> dict[str, list[int]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)  # 19 s instead of 48 s for the reference on a loaded machine
    try:
        return {k: hf_greedy(hf_reference, p, MAX_NEW) for k, p in prompts.items()}
    finally:
        torch.set_num_threads(threads)


async def drive(executor, prompts: dict[str, list[int]], params=None) -> dict:
    """The engine core's loop, with arrivals at fixed steps and bookkeeping for the asserts.
    ``params``: request id -> SamplingParams (default: greedy, MAX_NEW tokens)."""
    sched = Scheduler(
        SchedulerConfig(
            num_blocks=executor.num_blocks,
            block_size=BLOCK,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            long_prefill_token_threshold=32,
            max_model_len=MAX_MODEL_LEN,
            hash_seed=0,
        )
    )
    tokens: dict[str, list[int]] = {k: [] for k in prompts}
    cached: dict[str, int] = {}
    finish: dict[str, str] = {}
    stats = {"preempted": 0, "resumed_with_outputs": 0, "partial_prefills": 0, "steps": 0}
    step = 0
    while sched.has_unfinished_requests() or step <= max(ARRIVAL.values()):
        for rid, at in ARRIVAL.items():
            if at == step:
                sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
                sched.add_request(Request(rid, prompts[rid], params[rid] if params else sp))
        so = sched.schedule()
        stats["preempted"] += sum(1 for rid in so.finished_req_ids if rid in sched.requests)
        stats["resumed_with_outputs"] += sum(1 for nr in so.scheduled_new_reqs if nr.output_token_ids)
        runner_output = await executor.execute(so)
        for toks in runner_output.sampled_token_ids:
            if not toks:
                stats["partial_prefills"] += 1
        for out in sched.update_from_output(so, runner_output):
            assert out.error is None, out.error
            tokens[out.req_id].extend(out.new_token_ids)
            cached[out.req_id] = max(cached.get(out.req_id, 0), out.num_cached_tokens)
            if out.finished:
                finish[out.req_id] = out.finish_reason
        step += 1
        assert step < 1000, "the engine loop does not finish"
    stats["steps"] = step
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks
    return {"tokens": tokens, "cached": cached, "finish": finish, "stats": stats, "prefix": sched.prefix_cache_stats}


def _check_run(res: dict, expected: dict[str, list[int]]) -> None:
    assert res["finish"] == {k: "length" for k in expected}
    for rid, want in expected.items():
        assert res["tokens"][rid] == want, rid
    st = res["stats"]
    assert st["partial_prefills"] > 0, st  # chunked prefill happened
    assert st["preempted"] > 0, st  # the small pool forced preemption ...
    assert st["resumed_with_outputs"] > 0, st  # ... and a request resumed with its outputs
    assert res["prefix"].hits > 0
    assert res["cached"]["p1"] >= 3 * BLOCK  # p1 found p0's prefix blocks


@pytest.fixture(scope="module")
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def mp_executor(loop, real_source):
    from aiolm.executor.multiproc import MultiprocExecutor

    ex = MultiprocExecutor(runner_config(real_source), startup_timeout=300)
    loop.run_until_complete(ex.start())
    yield ex
    loop.run_until_complete(ex.shutdown())


def test_multiproc_executor_reports_kv_capacity(loop, mp_executor):
    infos = loop.run_until_complete(mp_executor.collective_rpc("kv_cache_info"))
    assert infos == [{"num_blocks": KV_BLOCKS, "block_size": BLOCK, "block_bytes": BLOCK_BYTES}]
    assert mp_executor.num_blocks == KV_BLOCKS and mp_executor.block_bytes == infos[0]["block_bytes"]


def test_multiproc_greedy_matches_transformers_with_chunking_prefix_hits_and_preemption(
    loop, mp_executor, prompts, expected
):
    t0 = time.monotonic()
    res = loop.run_until_complete(drive(mp_executor, prompts))
    print(f"multiproc run: {res['stats']} in {time.monotonic() - t0:.1f}s")
    _check_run(res, expected)
    assert mp_executor.is_alive()


def test_local_executor_same_scenario(loop, real_source, prompts, expected):
    """In process, the same; its decode steps (all greedy) take their tokens from the model's
    one call that ends with the argmax (sampled_tokens), and still give transformers' tokens."""
    from aiolm.executor.local import LocalExecutor

    ex = LocalExecutor(runner_config(real_source))
    ended_in_the_call = [0]

    async def run():
        await ex.start()
        try:
            assert ex.num_blocks == KV_BLOCKS
            assert await ex.collective_rpc("kv_cache_info") == [
                {"num_blocks": KV_BLOCKS, "block_size": BLOCK, "block_bytes": BLOCK_BYTES}
            ]
            model = ex.runner.model
            step = model.sample_step
            assert step is not None, "the embedded model's decode steps should end in its one call"

            def counted(*args):
                out = step(*args)
                ended_in_the_call[0] += out is not None
                return out

            model.sample_step = counted
            return await drive(ex, prompts)
        finally:
            await ex.shutdown()

    res = loop.run_until_complete(run())
    _check_run(res, expected)
    assert ended_in_the_call[0] > 0


def test_seeded_draws_are_the_same_whether_a_step_ends_in_the_models_call_or_not(loop, real_source, prompts):
    """Decode steps whose rows draw (temperature, top-k, top-p, min-p) end in the model's one
    call, which takes the sampler's uniform numbers from the request's own generator; asking
    for logprobs sends every step through compute_logits and the sampler instead. Seeded
    requests get the same tokens both ways, through chunking, prefix hits and preemption."""
    from aiolm.executor.local import LocalExecutor

    kinds = [
        dict(temperature=1.0),
        dict(temperature=0.8, top_k=40),
        dict(temperature=0.7, top_p=0.9),
        dict(temperature=1.1, top_k=30, top_p=0.95, min_p=0.05),
    ]

    def params(logprobs):
        return {
            rid: SamplingParams(
                **kinds[i % len(kinds)], seed=100 + i, max_tokens=MAX_NEW, ignore_eos=True, logprobs=logprobs
            )
            for i, rid in enumerate(sorted(prompts))
        }

    async def run(logprobs):
        ex = LocalExecutor(runner_config(real_source))
        ended_in_the_call = [0]
        await ex.start()
        try:
            model = ex.runner.model
            step = model.sample_step

            def counted(*args):
                out = step(*args)
                ended_in_the_call[0] += out is not None
                return out

            model.sample_step = counted
            res = await drive(ex, prompts, params(logprobs))
        finally:
            await ex.shutdown()
        return res, ended_in_the_call[0]

    (in_call, taken), (outside, not_taken) = (loop.run_until_complete(run(lp)) for lp in (None, 0))
    assert taken > 0 and not_taken == 0
    assert outside["stats"]["preempted"] > 0 and outside["stats"]["partial_prefills"] > 0
    assert in_call["tokens"] == outside["tokens"]
    assert all(len(t) == MAX_NEW for t in in_call["tokens"].values())


def test_cpu_bfloat16_keeps_a_float16_kv_cache_with_twice_the_blocks_where_the_cpu_has_them(real_source):
    """bfloat16 matmuls on a CPU: float32 activations, the KV cache in float16, so the same
    kv_cache_memory holds twice the blocks (and a decode step reads half the bytes). A CPU
    without bfloat16 matmuls (AVX2 only) runs the model in float32, its cache too."""
    from aiolm.platforms.cpu import bfloat16_matmuls
    from aiolm.worker.model_runner import ModelRunner

    runner = ModelRunner(dataclasses.replace(runner_config(real_source), dtype="bfloat16"))
    if not bfloat16_matmuls():
        assert runner.dtype == runner.kv_dtype == torch.float32 and runner.num_blocks == KV_BLOCKS
        return
    assert runner.dtype == torch.float32 and runner.kv_dtype == torch.float16
    assert {c.dtype for c in runner.kv_caches} == {torch.float16}
    assert runner.num_blocks == 2 * KV_BLOCKS


def test_a_pooling_request_finished_in_a_step_with_nothing_to_run_is_let_go(tmp_path):
    """A chunked embedding prompt aborted between chunks ends in a step that runs no tokens:
    its pooling state stayed in the worker (one vector per such request, for good)."""
    from aiolm.core.step import CachedRequestData, NewRequestData, SchedulerOutput
    from aiolm.pooling.params import PoolingParams
    from aiolm.worker.model_runner import ModelRunner
    from pooling_models import qwen3_embedder

    path = qwen3_embedder(tmp_path / "embedder")
    cfg = RunnerConfig(
        model=str(path), dtype="float32", max_num_seqs=4, max_model_len=128, block_size=16,
        kv_cache_memory=2_000_000, num_threads=1, runner="pooling",
    )  # fmt: skip
    runner = ModelRunner(cfg)

    def step(n: int, new: list[NewRequestData], scheduled: dict[str, int], finished: set[str]) -> SchedulerOutput:
        return SchedulerOutput(n, new, CachedRequestData(), scheduled, sum(scheduled.values()), finished)

    prompt = NewRequestData(
        "r", list(range(3, 43)), [], SamplingParams(max_tokens=1), [0, 1, 2], 0, PoolingParams(task="embed")
    )
    runner.execute(step(1, [prompt], {"r": 16}, set()))  # the first chunk of 40 tokens
    assert list(runner.pooling) == ["r"]
    runner.execute(step(2, [], {}, {"r"}))  # aborted: the finish comes in an empty step
    assert runner.pooling == {} and not runner.batch.row_of
