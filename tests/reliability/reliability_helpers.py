"""Helpers of the reliability suite: process and /dev/shm inspection, SSE clients, metrics."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from procs import live_running

PROMPTS = [f"Fact number {i} about the ocean:" for i in range(8)]


# -- processes and resources ------------------------------------------------------------


def worker_pids(server_pid: int) -> list[int]:
    """Live (not zombie) ``aiolm.worker`` children of the server."""
    return live_running(b"aiolm.worker", server_pid)


def wait_for_worker(server_pid: int, old: int | None = None, timeout: float = 120.0) -> int:
    """The server's one worker pid, once it is not ``old``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = [p for p in worker_pids(server_pid) if p != old]
        if len(pids) == 1:
            return pids[0]
        time.sleep(0.2)
    raise AssertionError(f"no single new worker of {server_pid} within {timeout} s: {worker_pids(server_pid)}")


@dataclass
class Resources:
    rss_mb: float
    fds: int
    threads: int
    shm: list[str] = field(default_factory=list)


def resources(pid: int) -> Resources:
    status = Path(f"/proc/{pid}/status").read_text()
    rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    threads = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("Threads:"))
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return Resources(rss / 1024, fds, threads, shm_segments(pid))


# A single-rank engine's segments: the request ring, the response ring, the heartbeats.
ENGINE_SEGMENTS = 3


def shm_segments(pid: int) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"aiolm_{pid}_"))


def gauges(base_url: str) -> dict[str, float]:
    """The engine gauges of /metrics (running, waiting, KV usage)."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        for name in ("aiolm:num_requests_running", "aiolm:num_requests_waiting", "aiolm:kv_cache_usage_perc"):
            if line.startswith(name + "{") or line.startswith(name + " "):
                out[name.split(":")[1]] = float(line.rsplit(" ", 1)[1])
    return out


def wait_idle_gauges(base_url: str, timeout: float = 30.0) -> dict[str, float]:
    """Gauges once running, waiting and KV usage are all 0 (or the last seen, after ``timeout``)."""
    deadline = time.monotonic() + timeout
    g = gauges(base_url)
    while time.monotonic() < deadline and any(
        g.get(k, 1.0) != 0.0 for k in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    ):
        time.sleep(0.2)
        g = gauges(base_url)
    return g


# -- streaming clients ----------------------------------------------------------------------


@dataclass
class StreamResult:
    text: str = ""
    finish_reason: str | None = None
    error: dict[str, Any] | None = None
    chunks: int = 0
    disconnected: bool = False
    status: int = 0
    ended_at: float = 0.0


async def stream_completion(
    client: httpx.AsyncClient, body: dict[str, Any], disconnect_after: int | None = None, on_chunk: Any = None
) -> StreamResult:
    """POST /v1/completions with stream=true; leave after ``disconnect_after`` chunks if given."""
    res = StreamResult()
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        res.status = r.status_code
        if r.status_code != 200:
            res.error = json.loads(await r.aread()).get("error")
            res.ended_at = time.monotonic()
            return res
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                res.error = obj["error"]
                continue
            res.chunks += 1
            for c in obj["choices"]:
                res.text += c.get("text") or ""
                res.finish_reason = c.get("finish_reason") or res.finish_reason
            if on_chunk is not None:
                on_chunk(res)
            if disconnect_after is not None and res.chunks >= disconnect_after:
                res.disconnected = True
                break
    res.ended_at = time.monotonic()
    return res


def greedy(prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **extra}


async def reference_texts(base_url: str, prompts: list[str], max_tokens: int) -> list[str]:
    """Fault-free greedy texts, generated together (the same batch shape as the runs compared)."""
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        outs = await asyncio.gather(
            *(stream_completion(client, greedy(p, max_tokens, ignore_eos=True)) for p in prompts)
        )
    assert all(o.finish_reason == "length" and not o.error for o in outs), outs
    return [o.text for o in outs]


# -- engine death ---------------------------------------------------------------------------


async def streams_through_fault(
    base_url: str,
    prompts: list[str],
    max_tokens: int,
    fault: Any,
    after_chunks: int = 4,
    timeout: float = 60.0,
    return_exceptions: bool = False,
) -> tuple[float, list]:
    """One greedy stream per prompt; ``fault()`` (in a thread) once one has ``after_chunks`` chunks.
    (fault time, each stream's StreamResult, or with ``return_exceptions`` the exception of one
    cut off by the server going away)."""
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout) as client:
        started = asyncio.Event()

        def on_chunk(res: StreamResult) -> None:
            if res.chunks >= after_chunks:
                started.set()

        tasks = [
            asyncio.ensure_future(stream_completion(client, greedy(p, max_tokens, ignore_eos=True), on_chunk=on_chunk))
            for p in prompts
        ]
        await asyncio.wait_for(started.wait(), 120)
        t_fault = time.monotonic()
        await asyncio.to_thread(fault)
        outs = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=return_exceptions), timeout)
    return t_fault, outs


async def kill_during_streams(base_url: str, pid: int, prompts: list[str], max_tokens: int = 400) -> tuple[float, list]:
    """SIGKILL worker ``pid`` while the streams decode (see streams_through_fault)."""
    return await streams_through_fault(
        base_url, prompts, max_tokens, lambda: os.kill(pid, signal.SIGKILL), return_exceptions=True
    )


def assert_died_cleanly(server: Any, killed: float, outs: list) -> str:
    """Every stream ended with ``engine_dead`` within 2 s of the kill, the server (run with
    --exit-on-engine-death, the default) exited non-zero, and left no segment or worker. The log."""
    for o in outs:
        if isinstance(o, BaseException):  # the server went away after the error event: also an end
            continue
        assert o.error is not None and o.error["code"] == "engine_dead", o
        assert o.finish_reason is None
        assert o.ended_at - killed < 2.0, f"stream ended {o.ended_at - killed:.2f} s after the kill"
    assert any(not isinstance(o, BaseException) for o in outs)
    try:
        code = server.proc.wait(60)
    except Exception as e:
        raise AssertionError(f"server still running 60 s after its engine died:\n{server.log()}") from e
    log = server.log()
    assert code != 0, log
    assert "the engine is dead" in log
    assert shm_segments(server.proc.pid) == []
    assert worker_pids(server.proc.pid) == []
    return log
