"""The Ray executor on a private local Ray cluster: parity, a killed actor, clean shutdown.

One engine, ``--executor ray --tensor-parallel-size 3`` on the embedded model, lives
through two worker sets, each with another split of the transports (the split is
read from AIOLM_RAY_REMOTE_RANKS whenever a set starts; "remote" ranks get their
steps through Ray calls, as ranks on another node do):

1. ranks 0-1 on the shm rings, rank 2 through Ray (all-reduce: gloo, the group
   "spans nodes"): greedy tokens equal the local executor's; then rank 0's actor
   process is SIGKILLed while streams decode (seen by its pid within 2 s);
2. the replacement set, every rank on the rings (shm all-reduce): the streams
   finish with the fault-free text, and a later batch too.

Ranks on other nodes for real, and a node lost under them, are tests/engine/test_ray_cluster.py's.
Finally shutdown kills every actor and removes every placement group, and stopping
the cluster leaves no Ray process (the cluster's processes are recognised by its
own temporary directory) and no shared memory.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from engine_harness import RAY_ARGS, RAY_MAX_NEW, RAY_PROMPTS, LoopThread, our_segments  # noqa: E402

from aiolm import AsyncEngine, SamplingParams  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ARGS = RAY_ARGS
PROMPTS = RAY_PROMPTS
MAX_NEW = RAY_MAX_NEW


def _processes_mentioning(text: str) -> list[str]:
    """Live processes with ``text`` in their command line or environment (Ray's workers
    rename themselves, but inherit RAY_TMPDIR from the raylet)."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            env = Path(f"/proc/{d}/environ").read_bytes().decode(errors="replace")
            state = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if (text in cmd or text in env) and state != "Z":
            found.append(f"{d}: {cmd[:160]}")
    return found


def _pid_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


async def _greedy(engine, prompts=PROMPTS, started: list[asyncio.Event] | None = None) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)

    async def one(i: int, prompt: str) -> list[int]:
        final = None
        async for out in engine.generate(prompt, params):
            final = out
            if started is not None:
                started[i].set()
        assert final is not None
        return list(final.outputs[0].token_ids)

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


@pytest.fixture(scope="module")
def ray_env():
    """A short private temp dir for the cluster (Ray's socket paths must stay short), a
    small cluster, and the transport split of the first worker set."""
    tmp = tempfile.mkdtemp(prefix="aiolm-ray-", dir="/tmp")
    saved = {
        k: os.environ.get(k) for k in ("RAY_TMPDIR", "AIOLM_RAY_NUM_CPUS", "AIOLM_RAY_REMOTE_RANKS", "RAY_ADDRESS")
    }
    os.environ.update(RAY_TMPDIR=tmp, AIOLM_RAY_NUM_CPUS="3", AIOLM_RAY_REMOTE_RANKS="1")
    os.environ.pop("RAY_ADDRESS", None)
    try:
        yield tmp
    finally:
        from aiolm.executor import ray_cluster

        ray_cluster.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(tmp, ignore_errors=True)


async def _kill_while_streaming(engine, kill) -> tuple[list[list[int]], float]:
    """Greedy PROMPTS; ``kill()`` once every stream has a token; (tokens, seconds the
    executor took to notice the death)."""
    started = [asyncio.Event() for _ in PROMPTS]
    task = asyncio.ensure_future(_greedy(engine, started=started))
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 300)
    old = engine.executor
    t0 = time.monotonic()
    kill(old)
    while old.is_alive() and time.monotonic() - t0 < 10:
        await asyncio.sleep(0.02)
    noticed = time.monotonic() - t0
    return await asyncio.wait_for(task, 600), noticed


def test_tp3_ray_matches_the_local_executor_survives_a_killed_actor_and_cleans_up(ray_reference, ray_env):
    assert all(len(t) == MAX_NEW for t in ray_reference)
    before = our_segments()
    lt = LoopThread()
    engine = AsyncEngine(executor="ray", tensor_parallel_size=3, **ARGS)
    seen_pids: list[int] = []
    try:
        lt.run(engine.start(), timeout=600)
        ex = engine.executor
        assert (ex.world_size, ex.num_local, ex.all_reduce) == (3, 2, "gloo")
        seen_pids += [r.pid for r in ex.ranks]
        assert lt.run(_greedy(engine), timeout=600) == ray_reference

        restarts = engine.supervisor.restarts  # 0, unless a step outlasted the watchdog

        def kill_and_recover(kill, remote_next: int, max_notice: float):
            """Kill while streaming; the streams end with the fault-free tokens on the next
            set, whose transport split is ``remote_next``."""
            os.environ["AIOLM_RAY_REMOTE_RANKS"] = str(remote_next)
            before = engine.supervisor.restarts
            tokens, noticed = lt.run(_kill_while_streaming(engine, kill), timeout=900)
            assert noticed < max_notice, f"the executor noticed the killed actor after {noticed:.2f} s"
            assert tokens == ray_reference
            assert engine.supervisor.restarts == before + 1 and engine.is_healthy()
            seen_pids.extend(r.pid for r in engine.executor.ranks)
            return engine.executor

        # 1 -> 2: SIGKILL of rank 0's process (seen by its pid); the next set is all shm rings.
        ex = kill_and_recover(lambda old: os.kill(old.ranks[0].pid, signal.SIGKILL), 0, 2.0)
        assert (ex.num_local, ex.all_reduce) == (3, "shm")
        assert engine.supervisor.restarts == restarts + 1
        assert lt.run(_greedy(engine), timeout=600) == ray_reference
    finally:
        lt.run(engine.shutdown(), timeout=120)
        lt.close()

    # Every actor of every set is gone, and so is every placement group.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(_pid_gone(p) for p in seen_pids):
        time.sleep(0.2)
    assert all(_pid_gone(p) for p in seen_pids), [p for p in seen_pids if not _pid_gone(p)]
    states = {pg["state"] for pg in ray.util.placement_group_table().values()}
    assert states <= {"REMOVED"}, states
    assert our_segments() == before, "shared memory left behind"

    # Stopping the cluster leaves none of its processes (raylet, GCS, agents, workers).
    from aiolm.executor import ray_cluster

    ray_cluster.shutdown()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _processes_mentioning(ray_env):
        time.sleep(0.5)
    assert not _processes_mentioning(ray_env), _processes_mentioning(ray_env)
