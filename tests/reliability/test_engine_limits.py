"""Admission bound, request timeouts, a spent restart budget and dead-segment sweeping, on an in-process engine.

The engine has recovery on with a budget of 0 restarts, so the module's last test
(a killed worker) takes the give-up path of a spent budget without waiting for a
restart first; tests/reliability/test_recovery.py spends a real budget of three.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import pytest
from engine_harness import ENGINE_ARGS, LoopThread, after_death

from aiolm import AsyncEngine, EngineBusyError, EngineDeadError, RequestTimeoutError, SamplingParams
from aiolm.ipc.stale import sweep_stale_segments

pytestmark = [pytest.mark.reliability, pytest.mark.slow]


@pytest.fixture(scope="module")
def small_engine():
    lt = LoopThread()
    engine = AsyncEngine(**{**ENGINE_ARGS, "max_num_seqs": 2, "max_waiting_requests": 3, "max_worker_restarts": 0})
    try:
        lt.run(engine.start(), timeout=600)
        yield lt, engine
    finally:
        try:
            lt.run(engine.shutdown(), timeout=120)
        finally:
            lt.close()


async def _idle(engine: AsyncEngine) -> tuple[tuple[int, int], float]:
    for _ in range(200):
        if engine.num_requests() == (0, 0) and engine.kv_cache_usage() == 0.0:
            break
        await asyncio.sleep(0.05)
    return engine.num_requests(), engine.kv_cache_usage()


def test_admission_is_bounded_by_seats_plus_waiting(small_engine):
    lt, engine = small_engine
    long = SamplingParams(max_tokens=200, ignore_eos=True)

    async def go():
        states = [await engine.add_request(f"Count {i}:", long) for i in range(5)]  # 2 seats + 3 waiting
        with pytest.raises(EngineBusyError) as e:
            await engine.add_request("one too many", long)
        assert e.value.retry_after > 0
        for st in states:
            await engine.abort(st.req_id)
        return await _idle(engine)

    assert lt.run(go(), timeout=120) == ((0, 0), 0.0)

    async def n_counts():  # n sequences count as n
        first = await engine.add_request("a", SamplingParams(max_tokens=200, ignore_eos=True, n=4))
        with pytest.raises(EngineBusyError):
            await engine.add_request("b", SamplingParams(max_tokens=200, ignore_eos=True, n=2))
        await engine.abort(first.req_id)
        return await _idle(engine)

    assert lt.run(n_counts(), timeout=120) == ((0, 0), 0.0)


def test_a_request_past_its_timeout_is_aborted_and_its_blocks_freed(small_engine):
    lt, engine = small_engine

    async def go():
        got = []
        with pytest.raises(RequestTimeoutError):
            async for out in engine.generate(
                "Tell a long story:", SamplingParams(max_tokens=900, ignore_eos=True), timeout=1.0
            ):
                got.append(out)
        idle = await _idle(engine)
        # The engine goes on serving.
        outs = [o async for o in engine.generate("Hi", SamplingParams(max_tokens=3, ignore_eos=True), timeout=60)]
        return got, idle, outs[-1]

    got, idle, last = lt.run(go(), timeout=120)
    assert got and idle == ((0, 0), 0.0)
    assert last.finished and len(last.outputs[0].token_ids) == 3


def test_a_spent_restart_budget_ends_in_a_clean_death(small_engine):
    """Recovery is on but no restart is left: the engine dies, stopping both actors and the
    executor by itself; /health's source says why. Last in the module: the engine stays dead."""
    lt, engine = small_engine
    ex = engine.executor
    rings = [ex.requests.name, *(r.name for r in ex.responses)]

    async def go():
        started = asyncio.Event()

        async def consume() -> float:
            try:
                async for _ in engine.generate("Tell a long story:", SamplingParams(max_tokens=800, ignore_eos=True)):
                    started.set()
            except EngineDeadError:
                return time.monotonic()
            raise AssertionError("stream ended without EngineDeadError")

        task = asyncio.ensure_future(consume())
        await asyncio.wait_for(started.wait(), 120)
        killed = time.monotonic()
        ex.procs[0].kill()
        return await asyncio.wait_for(task, 10) - killed

    assert lt.run(go(), timeout=180) < 2.0
    assert lt.run(after_death(engine, ex), timeout=30) == (False, False, True, (0, 0))
    healthy, why = engine.health()
    assert not healthy and engine.recovering is None and "0 restarts within" in why, why
    assert engine.kv_cache_usage() == 0.0
    assert ex.procs[0].poll() is not None and not [n for n in rings if Path("/dev/shm", n).exists()]
    with pytest.raises(EngineDeadError):
        lt.run(engine.add_request("Hello"), timeout=30)


def test_segments_of_dead_creators_are_swept(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    mine = f"aiolm_{os.getpid()}_00aa11bb22cc"
    stale = f"aiolm_{dead.pid}_00aa11bb22cc"
    other = "not_aiolm_123_abc"
    for name in (mine, stale, other):
        (tmp_path / name).write_bytes(b"x")
    assert sweep_stale_segments(str(tmp_path)) == [stale]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine, other])
