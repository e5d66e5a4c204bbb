"""``--data-parallel-size 2``: the front end and its two replica processes, from the API.

One DataParallelEngine on the embedded model, its replicas engine processes of their own
(one worker process each). What it shows:

- routing by prefix affinity gets more of each prompt from the prefix cache than random
  routing of the same kind of workload (both measured here: the replicas' own prefix-cache
  counters, tokens hit over tokens queried);
- a refusal made in a replica (an adapter on an engine without LoRA) reaches the caller
  as the same ParamError, and the front end stays in service;
- leaving a stream early aborts the request in its replica (its KV blocks freed);
- a pooling model's replicas embed through the same link, equal to one engine's vectors;
- after shutdown no replica process, worker or shared-memory segment is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time

import pytest
from engine_harness import LoopThread, running

from aiolm import AsyncEngine, SamplingParams
from aiolm.config import EngineArgs
from aiolm.engine.data_parallel import DataParallelEngine
from aiolm.engine.router import Route, RouteStats
from aiolm.ipc.wakeup import pid_alive
from aiolm.lora.request import LoRARequest
from aiolm.params import ParamError
from aiolm.pooling.params import PoolingParams
from pooling_models import bert_embedder
from procs import live_running

ARGS = dict(
    data_parallel_size=2,
    max_model_len=512,
    kv_cache_memory=64 << 20,
    max_num_seqs=4,
    max_num_batched_tokens=512,
    max_waiting_requests=0,  # a replica is full at 4 live sequences
    num_threads=1,
)
TOPICS = ["rivers", "volcanoes", "birds", "bridges", "planets", "forests", "castles", "islands"]


class RandomRouter:
    """The baseline: each request to a live replica drawn at random (seeded)."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.stats = RouteStats([0] * n, [0] * n)

    def pick(self, token_ids: list[int], loads: list[int | None]) -> Route:
        return Route(self.rng.choice([i for i, load in enumerate(loads) if load is not None]), False)

    def record(self, route: Route) -> None:
        self.stats.routed[route.replica] += 1


@pytest.mark.parametrize(
    "over, why",
    [
        (dict(data_parallel_backend="threads"), "not supported; supported: mp, ray"),
        (dict(data_parallel_backend="ray", executor="ray"), "leave --distributed-executor-backend at mp"),
        (dict(ray_address="10.0.0.1:6379"), "ray_address is only used with"),
        (dict(ray_placement="spread"), "ray_placement is only used with"),
    ],
)
def test_data_parallel_flags_are_checked_before_anything_starts(over, why):
    with pytest.raises(ValueError, match=why):
        EngineArgs(**{"data_parallel_size": 2, **over})
    # the Ray flags belong to the Ray backend of replicas too
    EngineArgs(data_parallel_size=2, data_parallel_backend="ray", ray_address="10.0.0.1:6379", ray_placement="spread")


slow = pytest.mark.slow  # every test below: replica processes on the real model


@pytest.fixture(scope="module")
def dp():
    with running(DataParallelEngine(EngineArgs(**ARGS))) as (lt, engine):
        yield lt, engine


def _opening(topic: str, tag: str) -> str:
    return f"[{tag}] You are a patient teacher. Today's lesson is about {topic}; answer in one short line. " * 4


async def _hit_rate(engine: DataParallelEngine, tag: str) -> float:
    """Tokens served from the prefix cache over tokens looked up, for 8 openings x 3
    questions sent one at a time, the openings interleaved (each new to the replicas)."""
    await engine.refresh_metrics()
    before = [(r.status["prefix_hits"], r.status["prefix_queries"]) for r in engine.replicas]
    params = SamplingParams(temperature=0.0, max_tokens=1)
    for q in ("What is it?", "Why does it matter?", "Give one example."):
        for topic in TOPICS:
            async for _ in engine.generate(_opening(topic, tag) + q, params):
                pass
    await engine.refresh_metrics()
    after = [(r.status["prefix_hits"], r.status["prefix_queries"]) for r in engine.replicas]
    hits = sum(a[0] - b[0] for a, b in zip(after, before))
    queries = sum(a[1] - b[1] for a, b in zip(after, before))
    return hits / queries


@slow
def test_replicas_are_processes_of_their_own(dp):
    _, engine = dp
    pids = [r.status["pid"] for r in engine.replicas]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert [live_running(b"aiolm.engine.replica", os.getpid()).count(p) for p in pids] == [1, 1]
    assert all(len(live_running(b"aiolm.worker", p)) == 1 for p in pids)  # its own worker each


@slow
def test_prefix_affinity_beats_random_routing(dp):
    lt, engine = dp
    followed = engine.router.stats.affinity[:]
    affinity = lt.run(_hit_rate(engine, "a"), timeout=300)
    followed = [a - b for a, b in zip(engine.router.stats.affinity, followed)]
    assert sum(followed) == 2 * len(TOPICS), followed  # every repeat went where its opening was
    router = engine.router
    engine.router = RandomRouter(len(engine.replicas))  # type: ignore[assignment]
    try:
        random_rate = lt.run(_hit_rate(engine, "b"), timeout=300)
    finally:
        engine.router = router
    print(f"prefix-cache hit rate: affinity {affinity:.3f}, random {random_rate:.3f}")
    # Affinity: every repeat of an opening finds it on its replica; random: about half miss.
    assert affinity > 0.5 and affinity > random_rate + 0.1, (affinity, random_rate)


@slow
def test_a_full_replica_passes_the_request_to_one_with_room(dp):
    """Four streams with opening A fill one replica's seats (no waiting room), three with
    opening B take the other's; a fifth A, routed to A's replica by affinity (4 live is
    within the slack of 3), is refused there (429) and runs on the other; only there is
    it counted as routed."""
    lt, engine = dp
    a, b = _opening("lighthouses", "full"), _opening("harbours", "full")

    async def go():
        params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        states = [await engine.add_request(p + f"Part {i}.", params) for i, p in enumerate([a, a, b, a, b, a, b])]
        holders = [engine.stream(state) for state in states]
        for h in holders:
            await anext(h)  # each has started: all seven hold seats
        routed = engine.router.stats.routed[:]
        outs = [o async for o in engine.generate(a + "Part 7.", SamplingParams(temperature=0.0, max_tokens=2))]
        after = engine.router.stats.routed[:]
        for h in holders:
            await h.aclose()
        for state in states:
            await engine.abort(state.req_id)
        return [state.replica for state in states], outs, routed, after

    where, outs, routed, after = lt.run(go(), timeout=300)
    home = where[0]
    assert where == [home, home, 1 - home, home, 1 - home, home, 1 - home], where
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 2
    assert [x - y for x, y in zip(after, routed)] == [int(i != home) for i in range(2)], (home, routed, after)


@slow
def test_a_replicas_refusal_reaches_the_caller_as_itself(dp):
    lt, engine = dp

    async def go():
        lora = LoRARequest("nope", 1, "/nonexistent")
        with pytest.raises(ParamError) as e:
            await engine.add_request("Hi", SamplingParams(max_tokens=1), request_id="refused", lora_request=lora)
        params = SamplingParams(max_tokens=2, temperature=0.0)
        outs = [o async for o in engine.generate("Hi", params, request_id="refused")]  # its id is free at once
        return e.value, outs

    error, outs = lt.run(go(), timeout=120)
    assert error.param == "lora_request" and "--enable-lora" in error.message
    assert outs[-1].finished and engine.is_healthy()


@slow
def test_leaving_a_stream_early_frees_its_blocks_in_the_replica(dp):
    lt, engine = dp

    async def go():
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        got = 0
        async for _ in engine.generate("Tell me a long story about the sea.", params):
            got += 1
            if got == 3:
                break
        for _ in range(100):
            await engine.refresh_metrics()
            if all(r.status["running"] == 0 and r.status["kv_usage"] == 0.0 for r in engine.replicas):
                break
            await asyncio.sleep(0.05)
        return [(r.status["running"], r.status["waiting"], r.status["kv_usage"]) for r in engine.replicas]

    assert lt.run(go(), timeout=120) == [(0, 0, 0.0), (0, 0, 0.0)]
    assert all(not r.requests for r in engine.replicas)


@slow
def test_a_request_cancelled_while_its_replica_adds_it_ends_there_and_frees_its_id(dp):
    """Cancelled after the add left the front end, before the replica answered: the replica
    aborts it once added and says so, the front end forgets it, and its id serves again."""
    lt, engine = dp

    async def go():
        params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
        task = asyncio.ensure_future(engine.add_request("A long tale:", params, request_id="early"))
        for _ in range(2000):
            if any("early" in r.requests for r in engine.replicas):
                break
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if not any("early" in r.requests for r in engine.replicas):
                break
            await asyncio.sleep(0.02)
        held = [("early" in r.requests) for r in engine.replicas]
        again = [o async for o in engine.generate("Hi", SamplingParams(max_tokens=2), request_id="early")]
        await engine.refresh_metrics()
        return held, again, [r.status["running"] for r in engine.replicas]

    held, again, running = lt.run(go(), timeout=120)
    assert held == [False, False]
    assert again[-1].finished and again[-1].request_id == "early"
    assert running == [0, 0]


@slow
def test_a_request_cancelled_while_its_replica_refuses_it_frees_its_id(dp):
    """Cancelled after the add left the front end, and the replica refuses it (before the
    abort arrives, or after): the front end's entry still goes (it was kept for good, a
    phantom load on the replica and an id never free again)."""
    lt, engine = dp

    async def go():
        lora = LoRARequest("nope", 1, "/nonexistent")  # the replica refuses it: no --enable-lora
        held = []
        for i in range(5):
            rid = f"refused-{i}"
            task = asyncio.ensure_future(engine.add_request("Hi", SamplingParams(max_tokens=2), rid, lora_request=lora))
            for _ in range(2000):
                if any(rid in r.requests for r in engine.replicas):
                    break
                await asyncio.sleep(0)
            for _ in range(i):  # a little later each time: the refusal may be on its way back
                await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, ParamError):
                await task
            for _ in range(200):
                if not any(rid in r.requests for r in engine.replicas):
                    break
                await asyncio.sleep(0.02)
            held.append(any(rid in r.requests for r in engine.replicas))
        return held

    assert lt.run(go(), timeout=120) == [False] * 5
    assert all(not r.requests for r in engine.replicas)


async def _vector(engine, text: str) -> list[float]:
    outs = [out async for out in engine.encode(text, PoolingParams())]
    assert len(outs) == 1
    return outs[0].outputs.data


@slow
def test_pooling_replicas_embed_as_one_engine_does(tmp_path):
    folder = str(bert_embedder(tmp_path / "bert"))
    texts = [f"sentence number {i} about the sea" for i in range(6)]

    async def go():
        async with AsyncEngine(EngineArgs(model=folder, runner="pooling", executor="local")) as one:
            ref = [await _vector(one, t) for t in texts]
        engine = DataParallelEngine(EngineArgs(model=folder, runner="pooling", data_parallel_size=2, num_threads=1))
        async with engine:
            got = await asyncio.gather(*(_vector(engine, t) for t in texts))
            with pytest.raises(ParamError, match="--runner pooling"):
                await engine.add_request("Hi", SamplingParams(max_tokens=1))
            await engine.refresh_metrics()
            served = [r.status["stats"]["prompt_tokens"] for r in engine.replicas]
        return ref, got, served

    lt = LoopThread()
    try:
        ref, got, served = lt.run(go(), timeout=300)
    finally:
        lt.close()
    for a, b in zip(ref, got):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5
    assert min(served) > 0, served  # both replicas pooled some


@slow
def test_shutdown_leaves_no_process_or_segment(dp):
    """Last in this file: shuts the shared engine down (the fixture's shutdown then finds
    nothing left to do)."""
    lt, engine = dp
    pids = [r.status["pid"] for r in engine.replicas]
    workers = [w for p in pids for w in live_running(b"aiolm.worker", p)]
    assert len(workers) == 2
    lt.run(engine.shutdown(), timeout=120)
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in pids + workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(p) for p in pids + workers)
    left = [n for n in os.listdir("/dev/shm") if any(n.startswith(f"aiolm_{p}_") for p in [os.getpid(), *pids])]
    assert left == []
    assert not engine.is_healthy() and engine.dead_reason == "engine shut down"
