"""With recovery off, a dead worker fails every in-flight stream loudly and leaves nothing behind.

This engine is private to the module: the test kills its worker process.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
from engine_harness import ENGINE_ARGS, LoopThread, after_death

from aiolm import AsyncEngine, EngineDeadError, SamplingParams

pytestmark = pytest.mark.slow


def _worker_pids_for(ring_name: str) -> list[int]:
    """Live processes whose command line names this engine's request ring."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        if b"aiolm.worker" in cmd and ring_name.encode() in cmd and ") Z " not in stat:
            pids.append(int(proc.name))
    return pids


def test_killed_worker_fails_streams_refuses_requests_and_cleans_up():
    lt = LoopThread()
    engine = AsyncEngine(**ENGINE_ARGS, worker_recovery=False)
    try:
        lt.run(engine.start(), timeout=600)
        ex = engine.executor
        rings = [ex.requests.name, *(r.name for r in ex.responses)]
        assert all(Path("/dev/shm", n).exists() for n in rings)
        assert _worker_pids_for(rings[0]) == [ex.procs[0].pid]
        assert engine.is_healthy()

        async def in_flight():
            started = [asyncio.Event() for _ in range(3)]

            async def consume(i: int) -> float:
                params = SamplingParams(temperature=0.0 if i else 1.0, max_tokens=800, ignore_eos=True, n=1 + i % 2)
                try:
                    async for _ in engine.generate(f"Story number {i}:", params):
                        started[i].set()
                except EngineDeadError:
                    return time.monotonic()
                raise AssertionError("stream ended without EngineDeadError")

            tasks = [asyncio.ensure_future(consume(i)) for i in range(3)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
            killed = time.monotonic()
            ex.procs[0].kill()
            ends = await asyncio.wait_for(asyncio.gather(*tasks), 10)
            return [t - killed for t in ends]

        delays = lt.run(in_flight(), timeout=180)
        assert max(delays) < 2.0, f"streams failed {delays} s after the kill"
        assert not engine.is_healthy()
        assert engine.dead_reason and "worker" in engine.dead_reason

        # Death stops both actors and the executor, without a shutdown call.
        assert lt.run(after_death(engine, ex), timeout=30) == (False, False, True, (0, 0))
        assert engine.kv_cache_usage() == 0.0

        async def refused():
            with pytest.raises(EngineDeadError):
                async for _ in engine.generate("Hello", SamplingParams(max_tokens=2)):
                    pass
            with pytest.raises(EngineDeadError):
                await engine.add_request("Hello")
            await engine.abort("whatever")  # harmless on a dead engine

        lt.run(refused(), timeout=30)
        lt.run(engine.shutdown(), timeout=60)
        lt.run(engine.shutdown(), timeout=60)  # twice: harmless
        assert not engine.is_healthy()
        assert not [n for n in rings if Path("/dev/shm", n).exists()]
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"aiolm_{os.getpid()}_")]
        assert all(p.poll() is not None for p in ex.procs)
        assert _worker_pids_for(rings[0]) == []
    finally:
        try:
            lt.run(engine.shutdown(), timeout=60)
        finally:
            lt.close()


def test_a_shutdown_while_the_workers_restart_stops_both_sets():
    """A worker dies, and the engine shuts down while the replacement set is still loading:
    the shutdown cancels the restart midway, yet every process of both sets ends and every
    shared-memory segment goes (the new set was known only to the restart in progress)."""
    lt = LoopThread()
    engine = AsyncEngine(**{**ENGINE_ARGS, "pipeline_parallel_size": 2})  # two ranks: a stop takes > 1 s
    try:
        lt.run(engine.start(), timeout=600)
        old = engine.executor
        old.procs[1].kill()

        async def replacement_loading():
            for _ in range(600):
                new = [ex for ex in engine._starting if ex is not old and len(getattr(ex, "procs", ())) == 2]
                if new:
                    return new[0]
                await asyncio.sleep(0.05)
            raise AssertionError("no replacement set started within 30 s")

        new = lt.run(replacement_loading(), timeout=60)
        t0 = time.monotonic()
        lt.run(engine.shutdown(), timeout=60)
        assert time.monotonic() - t0 < 30
        assert [p.pid for p in [*old.procs, *new.procs] if p.poll() is None] == []
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"aiolm_{os.getpid()}_")]
    finally:
        try:
            lt.run(engine.shutdown(), timeout=60)
        finally:
            lt.close()
