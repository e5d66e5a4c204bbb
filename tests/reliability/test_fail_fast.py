"""Admission control, request timeouts, priorities, and failing fast without recovery, on a real server.

`aiolm serve --no-worker-recovery` with 4 running seats, 8 waiting ones, a
request timeout and priorities allowed: twice the waiting bound at once gets 429
with Retry-After for the excess and answers for the rest; too many sequences get
400 naming the field; requests past the timeout end with 408 or an SSE error
event and leave no KV block; a waiting request of a lower priority value gets a
seat before waiting ones that came first; then a SIGKILLed worker ends every
stream with an error within 2 s and the server exits non-zero (so a supervisor
restarts it), leaving no segment or process behind.
"""

from __future__ import annotations

import asyncio
import inspect
import time

import httpx
import pytest
from reliability_helpers import (
    PROMPTS,
    assert_died_cleanly,
    gauges,
    greedy,
    kill_during_streams,
    stream_completion,
    wait_for_worker,
    wait_idle_gauges,
)
from server_helpers import ServerProcess, free_port, serve_cmd

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

SEATS, WAITING = 4, 8
# Every other request of this module finishes well within it; 1000 tokens cannot, on a CPU.
REQUEST_TIMEOUT = 12.0
IDLE = {"num_requests_running": 0.0, "num_requests_waiting": 0.0, "kv_cache_usage_perc": 0.0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    srv = ServerProcess(
        serve_cmd(
            port,
            "--no-worker-recovery",
            "--max-num-seqs",
            str(SEATS),
            "--max-waiting-requests",
            str(WAITING),
            "--max-seqs-per-request",
            "16",
            "--request-timeout",
            str(REQUEST_TIMEOUT),
            "--allow-request-priority",
        ),
        port,
        tmp_path_factory.mktemp("failfast") / "server.log",
    )
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.kill()


def test_twice_the_waiting_bound_at_once_gets_429_for_the_excess(server):
    n = 2 * WAITING

    async def go():
        async with httpx.AsyncClient(
            base_url=server.base_url, timeout=120, limits=httpx.Limits(max_connections=n)
        ) as c:
            return await asyncio.gather(
                *(c.post("/v1/completions", json=greedy(PROMPTS[i % 8], 24, ignore_eos=True)) for i in range(n))
            )

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


def test_retry_after_is_the_time_the_queue_ahead_takes_to_drain(server):
    """With the seats and the queue full, a 429's Retry-After is within 2x of the time until
    the sequences queued ahead of it (and it) would have seats, measured by the client."""
    tokens = 24  # every request here must finish within REQUEST_TIMEOUT, queueing included

    async def go():
        async with httpx.AsyncClient(
            base_url=server.base_url, timeout=120, limits=httpx.Limits(max_connections=SEATS + WAITING + 1)
        ) as c:

            async def timed(i: int) -> float:
                r = await c.post("/v1/completions", json=greedy(PROMPTS[i % 8], tokens, ignore_eos=True))
                assert r.status_code == 200, r.text
                return time.monotonic()

            await asyncio.gather(*(timed(i) for i in range(2 * SEATS)))  # service times measured
            flood = [asyncio.ensure_future(timed(i)) for i in range(SEATS + WAITING)]
            await _until(lambda: gauges(server.base_url)["num_requests_waiting"] == WAITING)
            refused = await c.post("/v1/completions", json=greedy("Hello", tokens, ignore_eos=True))
            t_refused = time.monotonic()
            return refused, t_refused, sorted(await asyncio.gather(*flood))

    refused, t_refused, finishes = asyncio.run(go())
    assert refused.status_code == 429, refused.text
    told = int(refused.headers["retry-after"])
    assert f"retry in about {told} s" in refused.json()["error"]["message"]
    # WAITING sequences ahead, then this one: that many departures from the full seats.
    drained = finishes[WAITING] - t_refused
    print(f"\n  Retry-After {told} s; the queue ahead drained in {drained:.1f} s")
    # Whole seconds: a drain of under a second is told 1.
    assert drained / 2 <= told <= max(2 * drained, drained + 1), (told, drained)
    assert wait_idle_gauges(server.base_url) == IDLE


def test_too_many_sequences_name_the_field(server):
    body = {**greedy("Hello", 4), "n": 4, "prompt": ["a", "b", "c", "d", "e"]}
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "n"
    # within --max-seqs-per-request but past what the seats and the queue hold together: it could
    # never be admitted, and its 429 was retried for good
    body = {**greedy("Hello", 4), "n": 1, "prompt": ["a"] * (SEATS + WAITING + 1)}
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and "--max-waiting-requests" in r.json()["error"]["message"], r.text


async def _until(check, timeout: float = 60.0) -> None:
    """Poll ``check`` (returning a bool, or an awaitable of one) until it is true."""
    deadline = time.monotonic() + timeout
    while True:
        ok = check()
        if inspect.isawaitable(ok):
            ok = await ok
        if ok:
            return
        assert time.monotonic() < deadline, f"not true within {timeout} s"
        await asyncio.sleep(0.02)


def _starts(c: httpx.AsyncClient, first: dict[str, float], name: str, body: dict) -> asyncio.Future:
    """A stream that notes in ``first`` when its first chunk arrived."""
    return asyncio.ensure_future(
        stream_completion(c, body, on_chunk=lambda res: first.setdefault(name, time.monotonic()))
    )


def test_requests_past_the_timeout_are_aborted_and_free_their_blocks(server):
    """Four long streams take the seats and a fifth request waits: all run past --request-timeout."""

    async def go():
        first: dict[str, float] = {}
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as c:
            t0 = time.monotonic()
            streams = [_starts(c, first, p, greedy(p, 1000, ignore_eos=True)) for p in PROMPTS[:SEATS]]
            await _until(lambda: len(first) == SEATS)
            waiting = await c.post("/v1/completions", json=greedy(PROMPTS[SEATS], 1000, ignore_eos=True))
            return t0, waiting, time.monotonic(), await asyncio.gather(*streams)

    t0, waiting, waiting_end, outs = asyncio.run(go())
    err = waiting.json()["error"]
    assert waiting.status_code == 408 and err["code"] == "request_timeout" and "timeout" in err["message"], err
    # Its own clock started later than the streams': it ends after them.
    assert REQUEST_TIMEOUT < waiting_end - t0 < REQUEST_TIMEOUT + 10, waiting_end - t0
    for o in outs:  # the stream had started: an in-band error event ends it
        assert o.status == 200 and o.chunks > 0 and o.finish_reason is None, o
        assert o.error is not None and o.error["code"] == "request_timeout", o
        assert REQUEST_TIMEOUT < o.ended_at - t0 < REQUEST_TIMEOUT + 5, o.ended_at - t0
    assert wait_idle_gauges(server.base_url) == IDLE


def test_a_lower_priority_value_gets_a_seat_before_earlier_waiting_requests(server):
    """With the seats taken, six requests of priority 5 wait, then one of priority -5 arrives: it is
    among the first SEATS admitted. First come, first served would admit it after four of them."""
    lows = 6

    async def waiting(n: int) -> bool:
        return (await asyncio.to_thread(gauges, server.base_url))["num_requests_waiting"] == n

    async def go():
        first: dict[str, float] = {}
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as c:
            tasks = [
                _starts(c, first, f"run{i}", greedy(p, 64, ignore_eos=True)) for i, p in enumerate(PROMPTS[:SEATS])
            ]
            await _until(lambda: len(first) == SEATS)
            tasks += [
                _starts(c, first, f"low{i}", greedy(PROMPTS[i], 8, ignore_eos=True, priority=5)) for i in range(lows)
            ]
            await _until(lambda: waiting(lows))
            t_high = time.monotonic()
            tasks.append(_starts(c, first, "high", greedy(PROMPTS[7], 8, ignore_eos=True, priority=-5)))
            return t_high, first, await asyncio.gather(*tasks)

    t_high, first, outs = asyncio.run(go())
    for o in outs:
        assert o.status == 200 and o.error is None and o.finish_reason == "length", o
    still_waiting = [first[f"low{i}"] for i in range(lows) if first[f"low{i}"] > t_high]
    assert len(still_waiting) >= SEATS, "the seats freed before the test could queue its requests"
    # Admitted in one step, the high one and up to SEATS - 1 low ones stream their first token together.
    ahead = sum(t < first["high"] for t in still_waiting)
    assert ahead <= SEATS - 1, f"{ahead} requests of priority 5 started before the one of priority -5"
    assert wait_idle_gauges(server.base_url) == IDLE


def test_killed_worker_without_recovery_fails_streams_and_exits_nonzero(server):
    pid = wait_for_worker(server.proc.pid)
    killed, outs = asyncio.run(kill_during_streams(server.base_url, pid, PROMPTS[:SEATS]))
    assert "worker recovery is off" in assert_died_cleanly(server, killed, outs)
