"""aiolm/structured on its own: the compile pool's sharing, stopping and requeueing, on the
real model's vocabulary and real compile processes, and the compiler's messages cleaned."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest

from aiolm.structured.backend import clean_message

pytest.importorskip("xgrammar")


def big_schema(n: int, tag: str = "p") -> dict:
    return {"type": "object", "properties": {f"{tag}{i}": {"type": "integer"} for i in range(n)}}


def test_clean_message_keeps_the_message_only():
    raw = {
        '[11:36:14] /project/cpp/json_schema_converter.cc:5082: Unsupported type "integr"\n': (
            'Unsupported type "integr"'
        ),
        "[11:36:14] /project/cpp/json_schema_converter.cc:5077: Check failed: (error.empty()) is false: "
        "Failed to parse JSON: syntax error at line 1 near: x\n": (
            "Failed to parse JSON: syntax error at line 1 near: x"
        ),
        "[01:02:03] /workspace/cpp/grammar_parser.cc:820: EBNF parser error at line 1, column 10: "
        'Rule "a" is not defined\nStack trace:\n  [bt] (0) libxgrammar.so(+0x1234)\n': (
            'EBNF parser error at line 1, column 10: Rule "a" is not defined'
        ),
        "plain words": "plain words",
    }
    for text, want in raw.items():
        assert clean_message(text) == want
    assert len(clean_message("x" * 5000)) == 1003


def test_the_pool_shares_stops_and_requeues_compiles(real_source):
    """A Validator of two processes (one slow lane), on this test's own loop: requests share a
    compile, which stops when the last one leaves (at once when it is big, at its first second
    when it is young); a second big grammar is stopped and queued while the slow lane is taken,
    and starts again once the lane is free; a grammar whose process dies twice is refused."""
    from aiolm.params import ParamError
    from aiolm.structured.compile_pool import SLOW_AFTER_S
    from aiolm.structured.spec import StructuredOutputs
    from aiolm.structured.validator import Validator

    def spec(tag: str) -> StructuredOutputs:
        return StructuredOutputs("json", json.dumps(big_schema(2000, tag)))

    async def settled(pool, timeout: float = 120.0) -> None:
        """Until the pool has both processes started and ready."""
        deadline = time.monotonic() + timeout
        while not (len(pool.procs) == 2 and all(p.ready for p in pool.procs)):
            assert time.monotonic() < deadline, pool.procs
            await asyncio.sleep(0.05)

    def running(pool, s: StructuredOutputs):
        return next((p for p in pool.procs if p.job is not None and p.job.spec == s), None)

    async def run():
        v = Validator("xgrammar", compile_timeout=60, processes=2)
        v.configure(real_source.path, real_source.config.vocab_size)
        first_grammars: list[int] = []  # the engine's cue to its workers, once, when the pool starts
        v.on_first_grammar = lambda: first_grammars.append(len(v._jobs))  # before the first job
        try:
            await v.check(StructuredOutputs("regex", "[a-z]+"))
            pool = v.pool
            assert first_grammars == [0]
            await settled(pool)
            # shared, then abandoned: a big compile stops when its last request leaves
            a = spec("a")
            first, second = (asyncio.ensure_future(v.check(a)) for _ in range(2))
            await asyncio.sleep(SLOW_AFTER_S + 0.3)
            p = running(pool, a)
            assert p is not None and p.job.waiters == 2 and p.job.slow
            assert [q for q in pool.procs if q.job is not None] == [p]  # one compile, on one process
            first.cancel()
            await asyncio.sleep(0.2)
            assert running(pool, a) is p
            second.cancel()
            await asyncio.sleep(0)
            assert p not in pool.procs and p.doomed and not v._jobs and len(v._verdicts) == 1  # the regex's
            await settled(pool)
            # young: it may finish, and stops at its first second when nobody came back for it
            b = spec("b")
            young = asyncio.ensure_future(v.check(b))
            await asyncio.sleep(0.2)
            young.cancel()
            await asyncio.sleep(0.1)
            p = running(pool, b)
            assert p is not None and p.job.waiters == 0
            await asyncio.sleep(SLOW_AFTER_S)
            assert p.doomed and not v._jobs
            await settled(pool)
            # the slow lane taken: the second big grammar is stopped and queued, then restarted
            c, d = spec("c"), spec("d")
            tc = asyncio.ensure_future(v.check(c))
            await asyncio.sleep(SLOW_AFTER_S + 0.2)
            td = asyncio.ensure_future(v.check(d))
            await asyncio.sleep(SLOW_AFTER_S + 0.3)
            assert running(pool, c).job.slow and running(pool, d) is None
            assert [j.spec for j in pool._slow] == [d]
            tc.cancel()  # frees the lane: d starts on the first process ready
            deadline = time.monotonic() + 120
            while running(pool, d) is None:
                assert time.monotonic() < deadline and not td.done()
                await asyncio.sleep(0.05)
            assert running(pool, d).job.slow and not pool._slow
            td.cancel()
            # a process that dies under a grammar is replaced, and the grammar tried once more, then refused
            e = spec("e")
            te = asyncio.ensure_future(v.check(e))
            for _ in range(2):
                deadline = time.monotonic() + 120
                while (p := running(pool, e)) is None:
                    assert time.monotonic() < deadline and not te.done()
                    await asyncio.sleep(0.05)
                os.kill(p.pid, signal.SIGKILL)
                while p in pool.procs:
                    await asyncio.sleep(0.01)
            with pytest.raises(ParamError, match="the grammar compiler failed on this grammar"):
                await te
            await settled(pool)
            await v.check(StructuredOutputs("regex", "[0-9]+"))  # and the pool still serves
            assert first_grammars == [0]
        finally:
            await v.close()
        assert not pool.procs and not pool._tasks

    asyncio.run(run())


def test_jobs_left_with_no_process_after_a_failed_start_get_one(real_source):
    """A second process fails to start (killed while starting), then the first dies under a
    grammar: the grammar, requeued with no process left, gets a new one and compiles (it waited
    for good, until some other grammar came)."""
    from aiolm.structured.spec import StructuredOutputs
    from aiolm.structured.validator import Validator

    async def until(cond, what: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.01)

    async def run():
        v = Validator("xgrammar", compile_timeout=60, processes=2)
        v.configure(real_source.path, real_source.config.vocab_size)
        try:
            await v.check(StructuredOutputs("regex", "[a-z]+"))
            pool = v.pool
            await until(lambda: len(pool.procs) == 2 and pool.procs[1].pid is not None, "no second start")
            first, second = pool.procs
            spec = StructuredOutputs("json", json.dumps(big_schema(600, "f")))
            task = asyncio.ensure_future(v.check(spec))
            await until(lambda: first.job is not None, "the grammar never ran")
            if second.ready:
                pytest.skip("the second process was ready before it could be killed while starting")
            os.kill(second.pid, signal.SIGKILL)
            await until(lambda: pool._start_error is not None and second not in pool.procs, "no failed start")
            if first.job is None:
                pytest.skip("the grammar compiled before its process could be killed")
            os.kill(first.pid, signal.SIGKILL)
            await until(lambda: first not in pool.procs, "the dead process stayed")
            await asyncio.wait_for(task, 120)  # compiled on a process started for it
        finally:
            await v.close()

    asyncio.run(run())
