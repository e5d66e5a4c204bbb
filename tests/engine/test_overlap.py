"""Overlap (async) scheduling end to end: the real model through real worker processes.

Two engines with the same small configuration serve the module, one scheduling
serially (``async_scheduling=False``) and one with overlap (two steps in flight),
which is the default. A 16 MiB KV cache and a
64-token step budget make the mixed workload hit chunked prefill, prefix-cache
hits and preemption; greedy outputs must match token for token, including stop
strings, n > 1, min_tokens, logprobs and a grammar. Aborts mid-flight and a worker
killed during an overlapped step must leave the other streams' text unchanged and
no KV block in use.
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import pytest
from engine_harness import ENGINE_ARGS, LoopThread

from aiolm import AsyncEngine, RequestOutput, SamplingParams
from aiolm.config import EngineArgs
from aiolm.structured.spec import StructuredOutputs

pytestmark = pytest.mark.slow

SMALL = dict(ENGINE_ARGS, max_model_len=256, kv_cache_memory=16 << 20, max_num_seqs=8, max_num_batched_tokens=64)
PREFIX = "You are a careful assistant. Answer briefly and precisely, and never repeat yourself. Here is the question: "
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Count from one to ten.",
    "Why is the sky blue?",
    "Write a haiku about autumn leaves.",
    "What does a compiler do?",
]


@pytest.fixture(scope="module")
def loop_thread():
    lt = LoopThread()
    yield lt
    lt.close()


def _start(loop_thread: LoopThread, overlap: bool) -> AsyncEngine:
    eng = AsyncEngine(**SMALL) if overlap else AsyncEngine(**SMALL, async_scheduling=False)
    loop_thread.run(eng.start(), timeout=600)
    preempted = [0]
    real = eng.scheduler._preempt

    def counting(req: Any) -> None:
        preempted[0] += 1
        real(req)

    eng.scheduler._preempt = counting  # type: ignore[method-assign]
    eng.preemptions = preempted  # type: ignore[attr-defined]
    return eng


@pytest.fixture(scope="module")
def engines(loop_thread):
    engs: dict[bool, AsyncEngine] = {}
    try:
        for overlap in (False, True):
            engs[overlap] = _start(loop_thread, overlap)
        yield engs
    finally:
        for eng in engs.values():
            loop_thread.run(eng.shutdown(), timeout=60)


async def final(
    engine: AsyncEngine, prompt: str, params: SamplingParams, request_id: str | None = None
) -> RequestOutput:
    last = None
    async for out in engine.generate(prompt, params, request_id=request_id):
        last = out
    assert last is not None and last.finished
    return last


def workload() -> list[tuple[str, SamplingParams]]:
    g = dict(temperature=0.0)
    # Half run to their limit (enough tokens to fill the KV cache), half may end on EOS.
    items = [
        (PREFIX + q, SamplingParams(max_tokens=64 if i % 2 else 48, ignore_eos=bool(i % 2), **g))
        for i, q in enumerate(QUESTIONS)
    ]
    items += [
        (PREFIX + "Tell me about the moon.", SamplingParams(max_tokens=40, stop=[" is", " was"], **g)),
        (PREFIX + "List some fruits.", SamplingParams(max_tokens=32, n=2, **g)),
        ("Once upon a time", SamplingParams(max_tokens=30, min_tokens=20, logprobs=2, **g)),
        (
            "Is water wet? Answer yes or no:",
            SamplingParams(
                max_tokens=8, structured_outputs=StructuredOutputs("grammar", 'root ::= " yes" | " no"'), **g
            ),
        ),
        ("1, 2, 3, 4,", SamplingParams(max_tokens=60, ignore_eos=True, **g)),
    ]
    return items


def summary(out: RequestOutput) -> list[tuple]:
    return [
        (
            c.text,
            list(c.token_ids),
            c.finish_reason,
            c.stop_reason,
            None if c.logprobs is None else [sorted(d) for d in c.logprobs],
        )
        for c in out.outputs
    ]


async def wait_idle(engine: AsyncEngine, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (engine.num_requests() == (0, 0) and engine.kv_cache_usage() == 0.0 and not engine.output.requests):
        assert loop.time() < deadline, f"not idle: {engine.num_requests()}, KV {engine.kv_cache_usage():.3f}"
        await asyncio.sleep(0.02)


def test_overlap_is_the_default_wherever_it_can_run(engines):
    assert engines[True].core.depth == 2 and engines[True].scheduler.config.async_scheduling
    assert engines[False].core.depth == 1 and not engines[False].scheduler.config.async_scheduling
    assert EngineArgs().overlap_scheduling(pooling=False)
    # what it cannot serve yet turns it off by default, and refuses it when asked for
    assert not EngineArgs().overlap_scheduling(pooling=True)
    assert not EngineArgs(speculative="ngram").overlap_scheduling(pooling=False)
    assert not EngineArgs(pipeline_parallel_size=2).overlap_scheduling(pooling=False)
    producer = '{"kv_connector": "TcpConnector", "kv_role": "kv_producer"}'
    consumer = '{"kv_connector": "TcpConnector", "kv_role": "kv_consumer"}'
    assert not EngineArgs(kv_transfer_config=producer).overlap_scheduling(pooling=False)
    assert EngineArgs(kv_transfer_config=consumer).overlap_scheduling(pooling=False)
    with pytest.raises(ValueError, match="speculative"):
        EngineArgs(speculative="ngram", async_scheduling=True)


def test_greedy_outputs_match_serial_scheduling(engines, loop_thread):
    items = workload()

    async def run(engine: AsyncEngine) -> list[list[tuple]]:
        outs = await asyncio.gather(*(final(engine, p, sp) for p, sp in items))
        await wait_idle(engine)
        return [summary(o) for o in outs]

    serial = loop_thread.run(run(engines[False]), timeout=600)
    overlap = loop_thread.run(run(engines[True]), timeout=600)
    for (prompt, _), a, b in zip(items, serial, overlap):
        assert b == a, prompt
    assert engines[True].preemptions[0] > 0 and engines[False].preemptions[0] > 0, "the KV cache never ran out"
    assert engines[True].scheduler.prefix_cache_stats.hits > 0
    assert serial[6][0][2:4] in (("stop", " is"), ("stop", " was")), serial[6]  # a stop string ended it
    assert {s[0][0] for s in serial[9:10]} <= {" yes", " no"}
    costs = engines[True].core.times.summary()["all_steps"]
    assert costs["steps"] > 0 and costs["forward"] > 0


def test_abort_mid_flight_leaves_the_others_unchanged_and_frees_every_block(engines, loop_thread):
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [PREFIX + q for q in QUESTIONS[:4]]

    async def run(engine: AsyncEngine, abort: bool) -> list[RequestOutput | None]:
        async def victim() -> int:
            n = 0
            async for out in engine.generate(PREFIX + "Describe the ocean.", sp, request_id="victim"):
                n = len(out.outputs[0].token_ids)
                if abort and n >= 3:
                    await engine.abort("victim")
            return n

        results = await asyncio.gather(victim(), *(final(engine, p, sp) for p in prompts))
        await wait_idle(engine)
        return results

    serial = loop_thread.run(run(engines[False], abort=False), timeout=600)
    overlap = loop_thread.run(run(engines[True], abort=True), timeout=600)
    assert 3 <= overlap[0] < 40
    for a, b in zip(serial[1:], overlap[1:]):
        assert summary(b) == summary(a)


def test_worker_killed_during_an_overlapped_step_recovers_with_the_same_text(engines, loop_thread):
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [PREFIX + q for q in QUESTIONS[2:6]]
    engine = engines[True]

    async def run(engine: AsyncEngine, kill: bool) -> list[RequestOutput]:
        async def first() -> RequestOutput:
            last = None
            async for out in engine.generate(prompts[0], sp):
                last = out
                if kill and len(out.outputs[0].token_ids) == 5:
                    os.kill(engine.executor.procs[0].pid, signal.SIGKILL)  # type: ignore[union-attr]
            assert last is not None
            return last

        outs = await asyncio.gather(first(), *(final(engine, p, sp) for p in prompts[1:]))
        await wait_idle(engine)
        return outs

    restarts = engine.supervisor.restarts
    serial = loop_thread.run(run(engines[False], kill=False), timeout=600)
    overlap = loop_thread.run(run(engine, kill=True), timeout=600)
    assert engine.supervisor.restarts == restarts + 1
    for a, b in zip(serial, overlap):
        assert summary(b) == summary(a)
