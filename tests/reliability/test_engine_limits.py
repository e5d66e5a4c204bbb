"""Admission bound, request timeouts and dead-segment sweeping, on an in-process engine."""

from __future__ import annotations

import asyncio
import os
import subprocess

import pytest

from aiolm import AsyncEngine, EngineBusyError, RequestTimeoutError, SamplingParams
from aiolm.ipc.stale import sweep_stale_segments
from engine_harness import ENGINE_ARGS, LoopThread

pytestmark = [pytest.mark.reliability, pytest.mark.slow]


@pytest.fixture(scope="module")
def small_engine():
    lt = LoopThread()
    engine = AsyncEngine(**{**ENGINE_ARGS, "max_num_seqs": 2, "max_waiting_requests": 3})
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
            async for out in engine.generate("Tell a long story:", SamplingParams(max_tokens=900, ignore_eos=True),
                                             timeout=1.0):
                got.append(out)
        idle = await _idle(engine)
        # The engine goes on serving.
        outs = [o async for o in engine.generate("Hi", SamplingParams(max_tokens=3, ignore_eos=True), timeout=60)]
        return got, idle, outs[-1]

    got, idle, last = lt.run(go(), timeout=120)
    assert got and idle == ((0, 0), 0.0)
    assert last.finished and len(last.outputs[0].token_ids) == 3


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
