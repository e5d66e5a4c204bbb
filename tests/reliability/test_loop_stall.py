"""Nothing a client sends stalls the event loop: probes against an in-process server.

The server (uvicorn + AsyncEngine with real worker processes) runs on an event
loop in a thread of this process, with a 5 ms ticker on the same loop measured
as tests/engine/test_async_engine.py measures it (wall lag, the loop thread's
run-queue wait and its CPU time per tick). The probes run in a separate process
(probe_client.py): stop strings at the cap that 8 streams' text keeps nearly matching, 64
stop strings, stop lists past each cap (400), 20 logprobs on 64 streams, a
4 MB chat body, and a body that never finishes arriving (408).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from engine_harness import ENGINE_ARGS, LoopThread, thread_schedstat
from server_helpers import ROOT, free_port

from aiolm.params import MAX_STOP_STRING_CHARS

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

PERIOD = 0.005
STALL = 0.050
BODY_TIMEOUT = 2.0


def test_client_controlled_work_never_stalls_the_loop():
    import uvicorn

    from aiolm import AsyncEngine
    from aiolm.server.app import build_app
    from aiolm.server.settings import ServerSettings

    lt = LoopThread()
    port = free_port()
    app = build_app(AsyncEngine(**ENGINE_ARGS), ServerSettings(body_timeout=BODY_TIMEOUT, access_log=False))
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="on", log_level="warning", log_config=None)
    )
    ticks: list[tuple[float, float, float, float]] = []  # (time, wall lag, run-queue wait, on-CPU time)
    done = asyncio.Event()

    async def ticker():
        while not done.is_set():
            t, s0 = time.perf_counter(), thread_schedstat()
            await asyncio.sleep(PERIOD)
            t1, s1 = time.perf_counter(), thread_schedstat()
            rq, cpu = (s1[1] - s0[1], s1[0] - s0[0]) if s0 and s1 else (0.0, 0.0)
            ticks.append((time.time(), t1 - t - PERIOD, rq, cpu))

    async def start() -> asyncio.Task:
        task = asyncio.ensure_future(server.serve())
        while not server.started:
            if task.done():
                task.result()  # start-up failed: raise its error
            await asyncio.sleep(0.05)
        asyncio.ensure_future(ticker())
        return task

    async def stop(task: asyncio.Task) -> None:
        done.set()
        server.should_exit = True
        await asyncio.wait_for(task, 90)

    serving = None
    try:
        serving = lt.run(start(), timeout=300)
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).with_name("probe_client.py")), f"http://127.0.0.1:{port}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        res = json.loads(proc.stdout)
    finally:
        try:
            if serving is not None:
                lt.run(stop(serving), timeout=120)
        finally:
            lt.close()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"aiolm_{os.getpid()}_")]

    # Every probe got its answer or its 400.
    the = " the" * res["stop_at_cap_tokens"]
    for r in res["stop_at_cap"]:
        assert r["status"] == 200 and r["finish_reason"] == "length" and r["text"] == the, r
    assert len(the) > MAX_STOP_STRING_CHARS  # the hold-back window was full
    for r in res["stop_64"]:
        assert r["status"] == 200 and r["finish_reason"] == "length", r
    for k, r in res["stop_over_cap"].items():
        assert r == {"status": 400, "param": "stop"}, (k, r)
    for r in res["logprobs_64"]:
        assert r["status"] == 200 and r["finish_reason"] == "length" and r["full_logprobs"] == 16, r
    assert res["chat_4mb"]["status"] == 400 and res["chat_4mb"]["bytes"] > 4_000_000, res["chat_4mb"]
    assert res["chat_4mb"]["error"]["param"] == "messages", res["chat_4mb"]
    assert res["slow_body"]["status_line"].startswith("HTTP/1.1 408"), res["slow_body"]
    assert res["slow_body"]["seconds"] < BODY_TIMEOUT + 3, res["slow_body"]

    # The loop was never busy for STALL at a stretch.
    def probe_at(t: float) -> str:
        return next((name for name, a, b in res["marks"] if a <= t <= (b or a + 1e9)), "-")

    worst = sorted(ticks, key=lambda x: x[1], reverse=True)[:5]
    net = sorted((wall - rq for _, wall, rq, _ in ticks), reverse=True)
    report = (
        f"{len(ticks)} ticks; longest on-CPU {1e3 * max(c for *_, c in ticks):.1f} ms, longest lag net of "
        f"run-queue wait {1e3 * net[0]:.1f} ms; worst wall lags (probe, wall lag, run-queue, cpu ms): "
        f"{[(probe_at(t), *(round(1e3 * x, 1) for x in v)) for t, *v in worst]}"
    )
    print(report)
    assert len(ticks) > 200, report
    # One tick may run long on its own (a full garbage collection of what the probes made:
    # a 58 ms tick once, in stop_64's window); work a client controls would show again and again.
    assert sum(cpu >= STALL for *_, cpu in ticks) <= 1, report
    # Wall lag net of run-queue wait also counts GIL waits behind the server's own threads
    # (tokenizing, templates, JSON off the loop); a VM losing its CPU (steal) shows as
    # neither, so two ticks over the whole run may exceed it.
    assert sum(x >= STALL for x in net) <= 2, report
