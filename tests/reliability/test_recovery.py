"""Worker recovery on a real server: SIGKILL, SIGSTOP (the watchdog) and a step that raises.

One `aiolm serve` with recovery on (the default), a short --step-timeout and the
test-only fault hook (AIOLM_TEST_FAULT names a file; the worker raises in the next
step once it exists). Every fault happens while six greedy streams are decoding;
each stream must then finish with exactly the text of a fault-free run, /health
must say 503 "recovering" meanwhile and 200 after, and nothing may pile up over
the restarts (worker processes, /dev/shm segments, fds, threads).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import httpx
import pytest

from reliability_helpers import (PROMPTS, greedy, reference_texts, resources, shm_segments, stream_completion,
                                 wait_for_worker, worker_pids)
from server_helpers import ServerProcess, free_port, serve_cmd

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

STEP_TIMEOUT = 8.0
MAX_TOKENS = 40
STREAM_PROMPTS = PROMPTS[:6]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("recovery")
    port = free_port()
    srv = ServerProcess(serve_cmd(port, "--step-timeout", str(STEP_TIMEOUT), "--max-worker-restarts", "5",
                                  "--shutdown-timeout", "5"),
                        port, d / "server.log", env={"AIOLM_TEST_FAULT": str(d / "fault")})
    srv.fault_file = d / "fault"
    try:
        srv.wait_ready()
        yield srv
    finally:
        pid = srv.proc.pid
        code = srv.stop()
        assert code == 0, f"server exited with {code}:\n{srv.log()}"
        assert shm_segments(pid) == [], "ring segments left after exit"
        assert worker_pids(pid) == []


@pytest.fixture(scope="module")
def reference(server):
    return asyncio.run(reference_texts(server.base_url, STREAM_PROMPTS, MAX_TOKENS))


class HealthWatch:
    """Polls /health every 0.1 s in a thread; keeps (time, status, error code)."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.seen: list[tuple[float, int, str | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=5) as c:
            while not self._stop.is_set():
                try:
                    r = c.get("/health")
                    code = r.json().get("error", {}).get("code") if r.status_code != 200 else None
                    self.seen.append((time.monotonic(), r.status_code, code))
                except httpx.HTTPError:
                    pass
                self._stop.wait(0.1)

    def stop(self) -> list[tuple[float, int, str | None]]:
        self._stop.set()
        self._thread.join(10)
        return self.seen


def _streams_through(server: ServerProcess, fault, after_chunks: int = 8) -> tuple[float, list]:
    """Start the streams, call ``fault()`` once one has ``after_chunks`` chunks, await them all."""

    async def go():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as client:
            fired = asyncio.Event()

            def on_chunk(res):
                if res.chunks >= after_chunks:
                    fired.set()

            tasks = [asyncio.ensure_future(stream_completion(client, greedy(p, MAX_TOKENS, ignore_eos=True),
                                                             on_chunk=on_chunk)) for p in STREAM_PROMPTS]
            await asyncio.wait_for(fired.wait(), 120)
            t_fault = time.monotonic()
            await asyncio.to_thread(fault)
            outs = await asyncio.wait_for(asyncio.gather(*tasks), 300)
            return t_fault, outs

    return asyncio.run(go())


def _log(server: ServerProcess) -> str:
    """The whole server log (``server.log()`` is its tail, mostly access-log lines here)."""
    server.log()  # flushes
    return server.log_path.read_text(errors="replace")


def _check_recovered(server, reference, outs, watch_seen, old_pid, t_fault: float = 0.0) -> int:
    down = [t for t, s, _ in watch_seen if s == 503]
    if t_fault and down:
        print(f"\n  /health 503 from +{down[0] - t_fault:.1f} s to +{down[-1] - t_fault:.1f} s after the fault; "
              f"streams done +{max(o.ended_at for o in outs) - t_fault:.1f} s")
    errors = [o.error for o in outs if o.error]
    assert not errors, f"streams failed: {errors}\n{server.log()}"
    assert [o.finish_reason for o in outs] == ["length"] * len(outs)
    assert [o.text for o in outs] == reference, "recovered streams differ from the fault-free greedy run"
    codes = [c for _, s, c in watch_seen if s == 503]
    assert "recovering" in codes, f"/health never said 'recovering': {watch_seen[-5:]}"
    assert watch_seen[-1][1] == 200, "/health not back to 200"
    new_pid = wait_for_worker(server.proc.pid, old=old_pid)
    assert len(shm_segments(server.proc.pid)) == 2, shm_segments(server.proc.pid)  # one request + one response ring
    return new_pid


def test_sigkill_during_decoding_recovers_with_the_same_text(server, reference):
    pid = wait_for_worker(server.proc.pid)
    server.before = resources(server.proc.pid)
    watch = HealthWatch(server.base_url)
    t_fault, outs = _streams_through(server, lambda: os.kill(pid, signal.SIGKILL))
    seen = watch.stop()
    _check_recovered(server, reference, outs, seen, pid, t_fault)
    assert "restarting the workers (restart 1)" in _log(server)


def test_stopped_worker_is_caught_by_the_watchdog(server, reference):
    pid = wait_for_worker(server.proc.pid)
    watch = HealthWatch(server.base_url)
    t_fault, outs = _streams_through(server, lambda: os.kill(pid, signal.SIGSTOP))
    seen = watch.stop()
    _check_recovered(server, reference, outs, seen, pid, t_fault)
    first_503 = next(t for t, s, _ in seen if s == 503 and t > t_fault)
    # The watchdog fires once a step has waited --step-timeout (checked every 0.5 s).
    assert first_503 - t_fault < STEP_TIMEOUT + 3.0, f"hung worker noticed {first_503 - t_fault:.1f} s after SIGSTOP"
    assert "is hung" in _log(server)
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(") ")[1][0] == "Z"


def test_step_exception_is_reported_with_its_traceback_and_recovered(server, reference):
    pid = wait_for_worker(server.proc.pid)
    watch = HealthWatch(server.base_url)
    t_fault, outs = _streams_through(server, lambda: server.fault_file.touch())
    seen = watch.stop()
    _check_recovered(server, reference, outs, seen, pid, t_fault)
    log = _log(server)
    assert "worker 0 failed in a step: InjectedFault" in log, log
    assert "Traceback (most recent call last)" in log and "_injected_fault" in log


def test_no_growth_over_the_restarts(server):
    after = resources(server.proc.pid)
    before = server.before
    print(f"\n  server before the faults: {before}\n  after three restarts:     {after}")
    # Three worker sets were replaced: nothing may grow with them.
    assert after.fds <= before.fds + 2, (before, after)
    assert after.threads <= before.threads + 2, (before, after)
    assert len(after.shm) == len(before.shm) == 2, (before, after)
    assert after.rss_mb < before.rss_mb + 150, (before, after)
    assert len(worker_pids(server.proc.pid)) == 1
