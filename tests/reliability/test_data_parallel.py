"""`aiolm serve --data-parallel-size 2`: both replicas serve, repeats follow their cache,
and a dead replica's streams end within 2 s while the other replica keeps serving.

One real server with two replicas (one worker process each) and worker recovery off,
so a killed worker makes its replica dead (the rules of docs/reliability.md, per
replica). Which replica served what is read from the per-replica lines of /metrics.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from reliability_helpers import greedy, shm_segments, stream_completion, worker_pids
from server_helpers import START_TIMEOUT, ServerProcess, free_port, serve_cmd

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

# Long shared openings (several 16-token blocks), different endings.
OPENINGS = [
    "You are a careful assistant who answers questions about the sea and its animals. " * 3,
    "Here is a list of cities, rivers and mountains that every geography student should know: " * 3,
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    srv = ServerProcess(
        serve_cmd(
            port, "--data-parallel-size", "2", "--no-worker-recovery", "--max-num-seqs", "8", "--shutdown-timeout", "5"
        ),
        port,
        tmp_path_factory.mktemp("dp") / "server.log",
    )
    try:
        srv.wait_ready(max(START_TIMEOUT, 480.0))  # two replicas start side by side on shared cores
        yield srv
    finally:
        srv.kill()


def replica_metrics(base_url: str) -> dict[str, list[float]]:
    """``name -> [replica 0 value, replica 1 value]`` of the aiolm:dp_replica_* lines."""
    out: dict[str, list[float]] = {}
    for line in httpx.get(base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("aiolm:dp_replica_"):
            name, value = line.rsplit(" ", 1)
            metric, label = name.split("{")
            i = int(label.split('"')[1])
            out.setdefault(metric[len("aiolm:dp_replica_") :], [0.0, 0.0])[i] = float(value)
    return out


def _delta(after: dict[str, list[float]], before: dict[str, list[float]], name: str) -> list[float]:
    return [a - b for a, b in zip(after[name], before[name])]


def _complete(base_url: str, prompt: str) -> str:
    r = httpx.post(base_url + "/v1/completions", json=greedy(prompt, 6, ignore_eos=True), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_both_replicas_serve_and_repeated_prompts_go_to_the_replica_that_cached_them(server):
    url = server.base_url
    assert len(worker_pids(server.proc.pid)) == 2
    before = replica_metrics(url)

    async def burst():
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            return await asyncio.gather(
                *(stream_completion(c, greedy(f"Short prompt {i}:", 24, ignore_eos=True)) for i in range(6))
            )

    outs = asyncio.run(burst())
    assert all(o.finish_reason == "length" and not o.error for o in outs), outs
    routed = _delta(replica_metrics(url), before, "routed_total")
    assert min(routed) >= 2 and sum(routed) == 6, routed  # spread by load
    # The engines' own series: one family each, a sample per replica (label ``engine``).
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text)}
    gen = [s for s in families["aiolm:generation_tokens"].samples if s.name.endswith("_total")]
    assert sorted(s.labels["engine"] for s in gen) == ["0", "1"], gen
    assert sum(s.value for s in gen) >= 6 * 24 and min(s.value for s in gen) >= 2 * 24, gen

    for opening in OPENINGS:
        m0 = replica_metrics(url)
        first = _complete(url, opening + "Question one?")
        m1 = replica_metrics(url)
        home = _delta(m1, m0, "routed_total").index(1.0)
        for ending in ["Question two?", "Question three?"]:
            text = _complete(url, opening + ending)
            m2 = replica_metrics(url)
            assert _delta(m2, m1, "routed_total")[home] == 1.0, (home, m1, m2)
            assert _delta(m2, m1, "affinity_routed_total")[home] == 1.0
            hits = _delta(m2, m1, "prefix_cache_hits_total")
            assert hits[home] >= 2 * 16 and hits[1 - home] == 0, hits  # the opening's blocks, on home only
            assert text
            m1 = m2
        assert _complete(url, opening + "Question one?") == first  # same greedy text on its replica


def test_a_killed_replica_ends_its_streams_within_2s_and_the_other_keeps_serving(server):
    url = server.base_url
    pids = worker_pids(server.proc.pid)
    assert len(pids) == 2

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            started = [asyncio.Event() for _ in range(4)]

            def mark(i):
                def on_chunk(res):
                    if res.chunks >= 3:
                        started[i].set()

                return on_chunk

            tasks = [
                asyncio.ensure_future(
                    stream_completion(client, greedy(f"Long story {i}:", 160, ignore_eos=True), on_chunk=mark(i))
                )
                for i in range(4)
            ]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 180)
            running = replica_metrics(url)["requests_running"]
            killed = time.monotonic()
            os.kill(pids[0], signal.SIGKILL)
            outs = await asyncio.wait_for(asyncio.gather(*tasks), 300)
            after = await client.post("/v1/completions", json=greedy("A new request:", 8, ignore_eos=True))
            return running, killed, outs, after

    running, killed, outs, after = asyncio.run(go())
    assert sum(running) == 4 and min(running) >= 1, running  # spread by load before the kill
    healthy = replica_metrics(url)["healthy"]
    assert sorted(healthy) == [0.0, 1.0], healthy
    dead = healthy.index(0.0)
    failed = [o for o in outs if o.error is not None]
    finished = [o for o in outs if o.error is None]
    assert len(failed) == running[dead] and len(finished) == running[1 - dead], (running, outs)
    for o in failed:
        assert o.error["code"] == "engine_dead", o.error
        assert o.ended_at - killed < 2.0, f"stream ended {o.ended_at - killed:.2f} s after the kill"
    assert all(o.finish_reason == "length" for o in finished)
    assert after.status_code == 200, after.text  # routed to the live replica
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    assert server.proc.poll() is None  # one dead replica does not stop the server
    assert server.stop() == 0, server.log()
    assert shm_segments(server.proc.pid) == [] and worker_pids(server.proc.pid) == []
