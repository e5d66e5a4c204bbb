"""Admission control, and failing fast without recovery, on a real server.

`aiolm serve --no-worker-recovery` with 4 running seats and 8 waiting ones:
twice the waiting bound at once gets 429 with Retry-After for the excess and
answers for the rest; request-shape limits get 400 naming the field; then a
SIGKILLed worker ends every stream with an error within 2 s and the server exits
non-zero (so a supervisor restarts it), leaving no segment or process behind.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from reliability_helpers import PROMPTS, greedy, shm_segments, stream_completion, wait_for_worker, worker_pids
from server_helpers import ServerProcess, free_port, serve_cmd

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

SEATS, WAITING = 4, 8


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    srv = ServerProcess(serve_cmd(port, "--no-worker-recovery", "--max-num-seqs", str(SEATS),
                                  "--max-waiting-requests", str(WAITING), "--max-seqs-per-request", "16"),
                        port, tmp_path_factory.mktemp("failfast") / "server.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.kill()


def test_twice_the_waiting_bound_at_once_gets_429_for_the_excess(server):
    n = 2 * WAITING

    async def go():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120,
                                     limits=httpx.Limits(max_connections=n)) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=greedy(PROMPTS[i % 8], 48, ignore_eos=True))
                                          for i in range(n)))

    rs = asyncio.run(go())
    ok = [r for r in rs if r.status_code == 200]
    busy = [r for r in rs if r.status_code == 429]
    assert len(ok) + len(busy) == n, [r.status_code for r in rs]
    # The bound admits SEATS running + WAITING waiting sequences; all arrive long before one can finish.
    assert len(ok) >= SEATS + WAITING and busy, [r.status_code for r in rs]
    for r in busy:
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "too_many_requests"
    for r in ok:
        assert r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("body, field", [
    ({"priority": 3}, "priority"),
    ({"n": 4, "prompt": ["a", "b", "c", "d", "e"]}, "n"),
])
def test_request_shape_limits_name_the_field(server, body, field):
    r = httpx.post(server.base_url + "/v1/completions", json={**greedy("Hello", 4), **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_killed_worker_without_recovery_fails_streams_and_exits_nonzero(server):
    pid = wait_for_worker(server.proc.pid)

    async def go():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            started = asyncio.Event()

            def on_chunk(res):
                if res.chunks >= 4:
                    started.set()

            tasks = [asyncio.ensure_future(stream_completion(client, greedy(p, 400, ignore_eos=True),
                                                             on_chunk=on_chunk)) for p in PROMPTS[:SEATS]]
            await asyncio.wait_for(started.wait(), 120)
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            outs = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
            return killed, outs

    killed, outs = asyncio.run(go())
    for o in outs:
        if isinstance(o, BaseException):  # the server went away after the error event: also an end
            continue
        assert o.error is not None and o.error["code"] == "engine_dead", o
        assert o.finish_reason is None
        assert o.ended_at - killed < 2.0, f"stream ended {o.ended_at - killed:.2f} s after the kill"
    assert any(not isinstance(o, BaseException) for o in outs)
    try:
        code = server.proc.wait(60)
    except Exception:
        raise AssertionError(f"server still running 60 s after its engine died:\n{server.log()}")
    assert code != 0, server.log()
    assert "the engine is dead" in server.log()
    assert shm_segments(server.proc.pid) == []
    assert worker_pids(server.proc.pid) == []
