"""Many clients on one real server: 300 concurrent streams, then thousands of short requests.

300 streaming clients, a third of them leaving early: the others must get exactly
the greedy text of a quiet run, and afterwards the running/waiting gauges and KV
usage are 0. Then 2000 more requests, 64 at a time (mostly non-streaming with
max_tokens=1, some streams leaving after their first chunk), must leave the
server's RSS, fds, threads and /dev/shm segments, and its worker's, where a
warm-up left them.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import httpx
import pytest
from reliability_helpers import (
    ENGINE_SEGMENTS,
    PROMPTS,
    greedy,
    reference_texts,
    resources,
    stream_completion,
    wait_for_worker,
    wait_idle_gauges,
)
from server_helpers import ServerProcess, SharedServer

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

CLIENTS = 300
MAX_TOKENS = 8  # short answers: 300 clients on two shared cores
SHORT_REQUESTS = 2000
PARALLEL = 64
WORDS = [
    "Hi",
    "Hello",
    "Yes",
    "No",
    "Why",
    "Ocean",
    "Blue",
    "Sun",
]  # one token each: the model's work per request is least
IDLE = {"num_requests_running": 0.0, "num_requests_waiting": 0.0, "kv_cache_usage_perc": 0.0}


@pytest.fixture(scope="module")
def server(open_servers: SharedServer) -> ServerProcess:
    """The shared server without a key (tests/conftest.py): what these tests check is relative
    to a warm-up or a quiet run on it, and its whole log must hold no traceback."""
    return open_servers.get()


def _round(base_url: str, seed: int) -> list:
    rng = random.Random(seed)
    leave = {i: rng.randint(1, MAX_TOKENS - 2) for i in range(CLIENTS) if i % 3 == 0}

    async def go():
        limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:
            return await asyncio.gather(
                *(
                    stream_completion(
                        client,
                        greedy(PROMPTS[i % len(PROMPTS)], MAX_TOKENS, ignore_eos=True),
                        disconnect_after=leave.get(i),
                    )
                    for i in range(CLIENTS)
                )
            )

    outs = asyncio.run(go())
    for i, o in enumerate(outs):
        assert o.status == 200 and o.error is None, (i, o)
        assert o.disconnected == (i in leave), (i, o)
    return outs


def test_300_streams_with_disconnects_complete_correctly_and_leave_nothing(server):
    reference = asyncio.run(reference_texts(server.base_url, PROMPTS, MAX_TOKENS))
    t0 = time.monotonic()
    outs = _round(server.base_url, seed=1)
    print(f"\n  {CLIENTS} clients ({sum(o.disconnected for o in outs)} leaving early) in {time.monotonic() - t0:.1f} s")
    for i, o in enumerate(outs):
        if not o.disconnected:
            assert o.finish_reason == "length", (i, o)
            assert o.text == reference[i % len(PROMPTS)], (i, o.text, reference[i % len(PROMPTS)])
    assert wait_idle_gauges(server.base_url) == IDLE
    assert "Traceback" not in server.log_path.read_text(errors="replace")


def _short_requests(base_url: str, n: int) -> None:
    """``n`` requests, PARALLEL at a time: nine in ten non-streaming with max_tokens=1, every tenth
    a 3-token stream, half of those leaving after the first chunk (so connections come and go)."""

    async def one(c: httpx.AsyncClient, i: int) -> tuple[int, Any]:
        if i % 10:
            r = await c.post("/v1/completions", json=greedy(WORDS[i % len(WORDS)], 1))
            return i, (r.status_code, r.json())
        return i, await stream_completion(
            c, greedy(WORDS[i % len(WORDS)], 3, ignore_eos=True), disconnect_after=1 if i % 20 == 0 else None
        )

    async def go() -> list[tuple[int, Any]]:
        # Several small pools: httpx's work per request grows with its pool, and the client
        # shares the cores with the server.
        clients = [
            httpx.AsyncClient(base_url=base_url, timeout=300, limits=httpx.Limits(max_connections=PARALLEL // 4))
            for _ in range(4)
        ]
        gate = asyncio.Semaphore(PARALLEL)

        async def gated(i: int) -> tuple[int, Any]:
            async with gate:
                return await one(clients[i % 4], i)

        try:
            return await asyncio.gather(*(gated(i) for i in range(n)))
        finally:
            for c in clients:
                await c.aclose()

    for i, out in asyncio.run(go()):
        if i % 10:
            status, body = out
            assert status == 200, (i, body)
            assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 1, body
        else:
            assert out.status == 200 and out.error is None and out.disconnected == (i % 20 == 0), (i, out)
            assert out.disconnected or out.finish_reason == "length", (i, out)


def test_thousands_of_requests_leave_no_growth(server):
    _short_requests(server.base_url, 2 * PARALLEL)  # warm-up: first-use allocations of these paths
    assert wait_idle_gauges(server.base_url) == IDLE
    worker = wait_for_worker(server.proc.pid)
    before, worker_before = resources(server.proc.pid), resources(worker)
    t0 = time.monotonic()
    _short_requests(server.base_url, SHORT_REQUESTS)
    took = time.monotonic() - t0
    assert wait_idle_gauges(server.base_url) == IDLE
    after, worker_after = resources(server.proc.pid), resources(worker)
    print(
        f"\n  {SHORT_REQUESTS} requests in {took:.1f} s\n  server before: {before}\n  server after:  {after}"
        f"\n  worker before: {worker_before}\n  worker after:  {worker_after}"
    )
    assert after.fds <= before.fds + 2, (before, after)
    assert after.threads <= before.threads, (before, after)
    assert after.shm == before.shm and len(after.shm) == ENGINE_SEGMENTS, (before, after)
    assert after.rss_mb < before.rss_mb + 32, (before, after)
    assert (worker_after.fds, worker_after.threads) == (worker_before.fds, worker_before.threads)
    assert worker_after.rss_mb < worker_before.rss_mb + 32, (worker_before, worker_after)
    assert "Traceback" not in server.log_path.read_text(errors="replace")


def test_priority_without_allow_request_priority_is_a_400_naming_it(server):
    for path, body in (
        ("/v1/completions", greedy("Hello", 4)),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}),
    ):
        r = httpx.post(server.base_url + path, json={**body, "priority": 3}, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "priority" and "--allow-request-priority" in err["message"], err
