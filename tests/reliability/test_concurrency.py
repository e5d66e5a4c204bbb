"""300 concurrent streaming clients on a real server, a third of them leaving early.

The others must get exactly the greedy text of a quiet run; afterwards the
running/waiting gauges and KV usage are 0, and a second round leaves the server's
fds, threads, RSS and /dev/shm segments where the first round left them.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from reliability_helpers import (PROMPTS, greedy, reference_texts, resources, stream_completion,
                                 wait_idle_gauges)
from server_helpers import ServerProcess, free_port, serve_cmd

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

CLIENTS = 300
MAX_TOKENS = 8  # short answers: 300 clients on two shared cores


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    srv = ServerProcess(serve_cmd(port, "--shutdown-timeout", "5"), port,
                        tmp_path_factory.mktemp("concurrency") / "server.log")
    with srv.serving():
        yield srv


def _round(base_url: str, seed: int) -> list:
    rng = random.Random(seed)
    leave = {i: rng.randint(1, MAX_TOKENS - 2) for i in range(CLIENTS) if i % 3 == 0}

    async def go():
        limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:
            return await asyncio.gather(*(
                stream_completion(client, greedy(PROMPTS[i % len(PROMPTS)], MAX_TOKENS, ignore_eos=True),
                                  disconnect_after=leave.get(i)) for i in range(CLIENTS)))

    outs = asyncio.run(go())
    for i, o in enumerate(outs):
        assert o.status == 200 and o.error is None, (i, o)
        assert o.disconnected == (i in leave), (i, o)
    return outs


def test_300_streams_with_disconnects_complete_correctly_and_leave_nothing(server):
    reference = asyncio.run(reference_texts(server.base_url, PROMPTS, MAX_TOKENS))
    t0 = time.monotonic()
    outs = _round(server.base_url, seed=1)
    print(f"\n  {CLIENTS} clients ({sum(o.disconnected for o in outs)} leaving early) in "
          f"{time.monotonic() - t0:.1f} s")
    for i, o in enumerate(outs):
        if not o.disconnected:
            assert o.finish_reason == "length", (i, o)
            assert o.text == reference[i % len(PROMPTS)], (i, o.text, reference[i % len(PROMPTS)])
    g = wait_idle_gauges(server.base_url)
    assert g == {"num_requests_running": 0.0, "num_requests_waiting": 0.0, "kv_cache_usage_perc": 0.0}, g
    first = resources(server.proc.pid)

    _round(server.base_url, seed=2)
    g = wait_idle_gauges(server.base_url)
    assert g == {"num_requests_running": 0.0, "num_requests_waiting": 0.0, "kv_cache_usage_perc": 0.0}, g
    second = resources(server.proc.pid)
    print(f"\n  after round 1: {first}\n  after round 2: {second}")
    assert second.fds <= first.fds + 2, (first, second)
    assert second.threads <= first.threads, (first, second)
    assert second.shm == first.shm and len(second.shm) == 2, (first, second)
    assert second.rss_mb < first.rss_mb + 64, (first, second)
    assert "Traceback" not in server.log_path.read_text(errors="replace")
