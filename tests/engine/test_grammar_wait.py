"""A request waits for its grammar without holding up the others (the real engine and workers).

The worker compiles a new grammar in the background while the batch keeps
stepping, and the scheduler admits the request once the worker says it is
ready. The test times a stream's inter-token gaps while an expensive, never
seen JSON schema arrives next to it: before this wait state existed, the worker
compiled inside a step and every other request stalled for the whole compile.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest
from engine_harness import ENGINE_ARGS, LoopThread

from aiolm import AsyncEngine, OutputKind, SamplingParams
from aiolm.structured.spec import StructuredOutputs

pytestmark = pytest.mark.slow
xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")


@pytest.fixture(scope="module")
def served():
    """(the loop thread, an engine started on it) for the module."""
    lt = LoopThread()
    eng = AsyncEngine(**ENGINE_ARGS)
    try:
        lt.run(eng.start(), timeout=600)
        lt.run(start_compile_processes(eng), timeout=600)
        yield lt, eng
    finally:
        lt.run(eng.shutdown(), timeout=60)
        lt.close()


async def start_compile_processes(engine: AsyncEngine) -> None:
    """An engine's first grammar starts its compile processes, once, one after the other, each a
    few seconds of CPU (docs/reliability.md, "Big grammars"): start them all before the tests
    time a new grammar."""
    await engine.grammars.check(StructuredOutputs("regex", "[a-z]+"))
    pool = engine.grammars.pool
    deadline = time.monotonic() + 300
    while not (len(pool.procs) == pool.processes and all(p.ready for p in pool.procs)):
        assert time.monotonic() < deadline, pool.procs
        await asyncio.sleep(0.05)


def slow_schema() -> dict:
    """A short document whose grammar is slow to build: bounded repetitions of a character class
    (below xgrammar's limit for its compact form) give one token-mask state per position.
    A random key makes the text new to every cache."""

    def word(n: int) -> dict:
        return {"type": "string", "pattern": f"^[A-Z][a-z]{{1,{n}}}$"}

    words = {k: word(100 + i) for i, k in enumerate(("name", "city", "street", "country", "job"))}
    return {
        "type": "object",
        "properties": {
            **words,
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            f"x{uuid.uuid4().hex[:8]}": {"type": "boolean"},
        },
        "required": [*words, "age"],
        "additionalProperties": False,
    }


def compile_seconds(tokenizer, vocab_size: int, schema: dict) -> float:
    """How long this schema's grammar takes to compile here, on a compiler without a cache."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compiler.compile_json_schema('{"type": "object"}')  # first-use costs out of the timing
    t0 = time.perf_counter()
    compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    return time.perf_counter() - t0


def test_a_new_grammar_compiles_while_other_requests_stream(served):
    loop_thread, engine = served
    schema = slow_schema()
    probe = slow_schema()  # the same shape under another key: timed here, unseen by the engine
    compile_s = min(compile_seconds(engine.tokenizer, engine.source.config.vocab_size, probe) for _ in range(2))
    assert compile_s > 0.25, f"the schema compiles in {compile_s:.3f}s: too fast to show a stall"

    async def go():
        stamps: list[float] = []
        window: list[float] = []
        constrained: asyncio.Task | None = None

        async def run_constrained():
            params = SamplingParams(
                temperature=0.0, max_tokens=150, structured_outputs=StructuredOutputs("json", json.dumps(schema))
            )
            window.append(time.perf_counter())
            outs = [o async for o in engine.generate("A person as JSON:", params)]
            window.append(time.perf_counter())
            return outs[-1].outputs[0]

        plain = SamplingParams(temperature=0.0, max_tokens=600, ignore_eos=True, output_kind=OutputKind.DELTA)
        async for _ in engine.generate("Tell me a long story about a dragon.", plain):
            stamps.append(time.perf_counter())
            if len(stamps) == 5:
                constrained = asyncio.ensure_future(run_constrained())
            if constrained is not None and constrained.done():
                break
        assert constrained is not None and constrained.done(), "the plain stream ended before the constrained one"
        return stamps, window, constrained.result()

    stamps, (t_submit, t_done), out = loop_thread.run(go(), timeout=300)
    gaps = [b - a for a, b in zip(stamps, stamps[1:]) if b > t_submit and a < t_done]
    # The constrained request waited for two compiles (the engine's check, then the worker's),
    # so the plain stream had to keep going through both.
    assert t_done - t_submit > compile_s and len(gaps) >= 5, (t_done - t_submit, len(gaps))
    assert max(gaps) < 0.5 * compile_s, (
        f"the plain stream stalled {max(gaps):.3f}s while a {compile_s:.3f}s grammar compiled; gaps {sorted(gaps)[-5:]}"
    )
    assert out.finish_reason == "stop", out
    jsonschema.validate(json.loads(out.text), schema)


def test_aborting_a_request_that_waits_for_its_grammar_leaves_nothing_behind(served):
    loop_thread, engine = served
    params = SamplingParams(
        temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputs("json", json.dumps(slow_schema()))
    )

    async def go():
        task = asyncio.ensure_future(engine.generate("A person as JSON:", params).__anext__())
        deadline = time.monotonic() + 120
        while not engine.scheduler.awaiting_grammar:  # past the engine's check, compiling on the worker
            assert time.monotonic() < deadline and not task.done(), "never reached the grammar wait"
            await asyncio.sleep(0.005)
        assert engine.num_requests() == (0, 1) and engine.kv_cache_usage() == 0.0
        task.cancel()  # the consumer leaves: the request is aborted while it waits
        while engine.num_requests() != (0, 0):
            assert time.monotonic() < deadline, engine.num_requests()
            await asyncio.sleep(0.01)
        # The worker finishes that compile and reports it; the engine ignores it and serves on.
        out = [o async for o in engine.generate("Hello", SamplingParams(temperature=0.0, max_tokens=4))]
        return out[-1].outputs[0]

    out = loop_thread.run(go(), timeout=300)
    assert len(out.token_ids) >= 1
    assert engine.num_requests() == (0, 0) and engine.kv_cache_usage() == 0.0 and not engine.output.requests
