"""`aiolm serve --data-parallel-size 2`: two replica processes behind one API.

One real server whose replicas are engine processes of their own (one worker process
each) with worker recovery off. Both serve and repeats follow their cache; 64
concurrent OpenAI clients are all answered; a SIGKILLed replica process ends the
streams it had started within 2 s while the requests still queued on it finish on the
other, and nothing of it is left behind. Which replica served what is read from the
per-replica lines of /metrics.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from reliability_helpers import greedy, shm_segments, stream_completion
from server_helpers import START_TIMEOUT, ServerProcess, free_port, serve_cmd

from aiolm.ipc.wakeup import pid_alive
from procs import live_running, processes

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

# Long shared openings (several 16-token blocks), different endings.
OPENINGS = [
    "You are a careful assistant who answers questions about the sea and its animals. " * 3,
    "Here is a list of cities, rivers and mountains that every geography student should know: " * 3,
]
SEATS = 4  # --max-num-seqs per replica


def replica_pids(server_pid: int) -> list[int]:
    """The live replica processes of the server, by replica index."""
    found = {}
    for p in processes():
        if p.ppid == server_pid and b"aiolm.engine.replica" in p.cmdline and p.state != "Z":
            args = p.cmdline.split(b"\0")
            found[int(args[args.index(b"--index") + 1])] = p.pid
    return [found[i] for i in sorted(found)]


def workers_of(pids: list[int]) -> list[int]:
    return [w for pid in pids for w in live_running(b"aiolm.worker", pid)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    srv = ServerProcess(
        serve_cmd(
            port,
            "--data-parallel-size",
            "2",
            "--no-worker-recovery",
            "--max-num-seqs",
            str(SEATS),
            "--shutdown-timeout",
            "5",
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
    replicas = replica_pids(server.proc.pid)
    assert len(replicas) == 2 and len(workers_of(replicas)) == 2  # a process each, a worker each
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


def test_64_concurrent_openai_clients_are_all_answered(server):
    """64 clients at once (8 prompts, 8 clients each) through the openai package: every one
    gets its whole answer, and the same prompt the same greedy text wherever it ran."""
    prompts = [f"Question {i}: name a colour and a fruit." for i in range(8)]

    async def go():
        clients = [
            openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=300)
            for _ in range(64)
        ]
        model = (await clients[0].models.list()).data[0].id
        try:
            before = replica_metrics(server.base_url)
            outs = await asyncio.wait_for(
                asyncio.gather(
                    *(
                        c.completions.create(model=model, prompt=prompts[i % 8], max_tokens=8, temperature=0.0)
                        for i, c in enumerate(clients)
                    )
                ),
                300,
            )
            return before, outs
        finally:
            await asyncio.gather(*(c.close() for c in clients))

    before, outs = asyncio.run(go())
    assert len(outs) == 64 and all(o.choices[0].finish_reason in ("length", "stop") for o in outs)
    for i in range(8):
        texts = {outs[k].choices[0].text for k in range(i, 64, 8)}
        assert len(texts) == 1 and texts != {""}, (prompts[i], texts)
    routed = _delta(replica_metrics(server.base_url), before, "routed_total")
    assert sum(routed) == 64 and min(routed) >= 16, routed  # both replicas took a share


def test_a_killed_replica_process_ends_its_started_streams_and_its_queued_requests_finish_elsewhere(server):
    """16 streams on 2 x 4 seats: each replica runs 4 and queues 4. SIGKILL one replica
    process: the 4 it had started end with engine_dead within 2 s; the 4 still queued on it
    (no output yet) are resubmitted and finish on the other replica, which keeps serving."""
    url = server.base_url
    replicas = replica_pids(server.proc.pid)
    assert len(replicas) == 2

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            started = asyncio.Event()
            seen = {}

            def on_chunk(res):
                seen[id(res)] = res
                if sum(r.chunks >= 2 for r in seen.values()) >= 2 * SEATS:
                    started.set()

            tasks = [
                asyncio.ensure_future(
                    stream_completion(client, greedy(f"Long story {i}:", 48, ignore_eos=True), on_chunk=on_chunk)
                )
                for i in range(4 * SEATS)
            ]
            await asyncio.wait_for(started.wait(), 240)
            m = replica_metrics(url)
            orphans = workers_of(replicas[:1])
            killed = time.monotonic()
            os.kill(replicas[0], signal.SIGKILL)
            outs = await asyncio.wait_for(asyncio.gather(*tasks), 300)
            after = await client.post("/v1/completions", json=greedy("A new request:", 8, ignore_eos=True))
            return m, orphans, killed, outs, after

    m, orphans, killed, outs, after = asyncio.run(go())
    assert m["requests_running"] == [SEATS, SEATS], m  # full on both before the kill
    failed = [o for o in outs if o.error is not None]
    finished = [o for o in outs if o.error is None]
    assert len(failed) == SEATS and len(finished) == 3 * SEATS, outs
    for o in failed:
        assert o.error["code"] == "engine_dead", o.error
        assert o.chunks >= 2  # it had started: its tokens cannot be taken back
        assert o.ended_at - killed < 2.0, f"stream ended {o.ended_at - killed:.2f} s after the kill"
    assert all(o.finish_reason == "length" and o.chunks >= 1 for o in finished)
    after_routing = replica_metrics(url)
    assert after_routing["healthy"] == [0.0, 1.0], after_routing
    assert after_routing["requests_running"][0] == 0, after_routing  # not what it said before it died
    # The dead replica's own series stay, reading dead and idle, its counters kept.
    engine0 = {
        s.name: s.value
        for f in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text)
        for s in f.samples
        if s.labels.get("engine") == "0" and "finished_reason" not in s.labels
    }
    assert engine0["aiolm:engine_healthy"] == 0.0 and engine0["aiolm:num_requests_running"] == 0.0, engine0
    assert engine0["aiolm:prompt_tokens_total"] > 0, engine0
    # the queued four were routed again, to replica 1
    assert after_routing["routed_total"][1] - m["routed_total"][1] >= SEATS + 1, (m, after_routing)
    assert after.status_code == 200, after.text
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    assert server.proc.poll() is None  # one dead replica does not stop the server
    # The killed replica's worker saw its parent die, unlinked its rings and exited.
    assert len(orphans) == 1
    deadline = time.monotonic() + 30
    while pid_alive(orphans[0]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not pid_alive(orphans[0])
    assert shm_segments(replicas[0]) == [], shm_segments(replicas[0])
    assert server.stop() == 0, server.log()
    assert replica_pids(server.proc.pid) == [] and workers_of(replicas) == []
    assert all(shm_segments(pid) == [] for pid in (server.proc.pid, *replicas))
