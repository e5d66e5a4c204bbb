"""Worker recovery on a real server: a short stop (a stall, no restart), SIGKILL, SIGSTOP (the
watchdog) and a step that raises.

One `aiolm serve` with recovery on (the default), a short --step-timeout and the
test-only fault hook (AIOLM_TEST_FAULT names a file; the worker raises in the next
step once it exists). Every fault happens while six greedy streams are decoding;
each stream must then finish with exactly the text of a fault-free run, /health
must say 503 "recovering" meanwhile and 200 after, a new request meanwhile gets
503 "recovering" with Retry-After, and nothing may pile up over the restarts
(worker processes, /dev/shm segments, fds, threads). The three faults spend the
restart budget: a fourth ends the engine, and the server exits non-zero. A stop
shorter than the step time limit is no fault: /health says 503 "stalled" within a
few seconds (the worker's heartbeat, aiolm/ipc/heartbeat.py) and 200 once it runs
again, and the streams go on with nothing restarted.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import pytest
from reliability_helpers import (
    ENGINE_SEGMENTS,
    PROMPTS,
    assert_died_cleanly,
    greedy,
    kill_during_streams,
    reference_texts,
    resources,
    shm_segments,
    streams_through_fault,
    wait_for_worker,
    worker_pids,
)
from server_helpers import ServerProcess, free_port, serve_cmd

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

STEP_TIMEOUT = 8.0
MAX_RESTARTS = 3  # the default: the module's three faults spend it
MAX_TOKENS = 40
STREAM_PROMPTS = PROMPTS[:6]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("recovery")
    port = free_port()
    srv = ServerProcess(
        serve_cmd(
            port,
            "--step-timeout",
            str(STEP_TIMEOUT),
            "--max-worker-restarts",
            str(MAX_RESTARTS),
            "--shutdown-timeout",
            "5",
        ),
        port,
        d / "server.log",
        env={"AIOLM_TEST_FAULT": str(d / "fault")},
    )
    srv.fault_file = d / "fault"
    try:
        srv.wait_ready()
        yield srv
    finally:
        pid = srv.proc.pid
        running = srv.proc.poll() is None  # not when the last test has ended the engine
        code = srv.stop()
        assert code == 0 or not running, f"server exited with {code} on SIGTERM:\n{srv.log()}"
        assert shm_segments(pid) == [], "ring segments left after exit"
        assert worker_pids(pid) == []


@pytest.fixture(scope="module")
def reference(server):
    return asyncio.run(reference_texts(server.base_url, STREAM_PROMPTS, MAX_TOKENS))


class HealthWatch:
    """Polls /health every 0.1 s in a thread; keeps (time, status, error code). At the first
    'recovering', it sends a new completion, plain and streamed, and keeps what they got."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.seen: list[tuple[float, int, str | None]] = []
        self.refused: list[tuple[int, str | None, dict]] = []  # (status, Retry-After, error)
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
                    if code == "recovering" and not self.refused:
                        self._new_requests(c)
                except httpx.HTTPError:
                    pass
                self._stop.wait(0.1)

    def _new_requests(self, c: httpx.Client) -> None:
        body = greedy("Hello", 4)
        r = c.post("/v1/completions", json=body)
        self.refused.append((r.status_code, r.headers.get("retry-after"), r.json().get("error")))
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            self.refused.append((r.status_code, r.headers.get("retry-after"), json.loads(r.read()).get("error")))

    def stop(self) -> list[tuple[float, int, str | None]]:
        self._stop.set()
        self._thread.join(10)
        return self.seen


def _streams_through(server: ServerProcess, fault, after_chunks: int = 8) -> tuple[float, list]:
    """Start the streams, call ``fault()`` once one has ``after_chunks`` chunks, await them all."""
    return asyncio.run(
        streams_through_fault(server.base_url, STREAM_PROMPTS, MAX_TOKENS, fault, after_chunks, timeout=300)
    )


def _log(server: ServerProcess) -> str:
    """The whole server log (``server.log()`` is its tail, mostly access-log lines here)."""
    server.log()  # flushes
    return server.log_path.read_text(errors="replace")


def _check_recovered(server, reference, outs, watch: HealthWatch, old_pid, t_fault: float = 0.0) -> int:
    watch_seen = watch.seen
    down = [t for t, s, _ in watch_seen if s == 503]
    if t_fault and down:
        print(
            f"\n  /health 503 from +{down[0] - t_fault:.1f} s to +{down[-1] - t_fault:.1f} s after the fault; "
            f"streams done +{max(o.ended_at for o in outs) - t_fault:.1f} s"
        )
    errors = [o.error for o in outs if o.error]
    assert not errors, f"streams failed: {errors}\n{server.log()}"
    assert [o.finish_reason for o in outs] == ["length"] * len(outs)
    assert [o.text for o in outs] == reference, "recovered streams differ from the fault-free greedy run"
    codes = [c for _, s, c in watch_seen if s == 503]
    assert "recovering" in codes, f"/health never said 'recovering': {watch_seen[-5:]}"
    assert watch_seen[-1][1] == 200, "/health not back to 200"
    # A request arriving meanwhile is told to come back, plain or streamed (no SSE stream opens).
    assert len(watch.refused) == 2, watch.refused
    for status, retry_after, error in watch.refused:
        assert status == 503 and retry_after is not None and int(retry_after) >= 1, (status, retry_after, error)
        assert error["code"] == "recovering" and "replacing failed workers" in error["message"], error
    new_pid = wait_for_worker(server.proc.pid, old=old_pid)
    assert len(shm_segments(server.proc.pid)) == ENGINE_SEGMENTS, shm_segments(server.proc.pid)
    return new_pid


def test_a_short_stop_is_a_stall_not_a_failure(server, reference):
    """SIGSTOP for less than the step time limit, then SIGCONT: /health says 503 "stalled" within
    5 s of the stop, naming the worker, and 200 after SIGCONT; the streams finish with the
    fault-free text and no worker was replaced."""
    pid = wait_for_worker(server.proc.pid)
    watch = HealthWatch(server.base_url)
    times: dict[str, float] = {}

    def stop_then_continue() -> None:
        os.kill(pid, signal.SIGSTOP)
        times["stop"] = time.monotonic()
        deadline = times["stop"] + 5.0
        while time.monotonic() < deadline and not any(c == "stalled" for _, _, c in watch.seen):
            time.sleep(0.05)
        time.sleep(1.0)  # still stopped a while after /health said so
        os.kill(pid, signal.SIGCONT)
        times["cont"] = time.monotonic()

    try:
        _, outs = _streams_through(server, stop_then_continue)
    finally:
        os.kill(pid, signal.SIGCONT)  # whatever failed above, never leave the worker stopped
    time.sleep(0.5)
    seen = watch.stop()
    assert times["cont"] - times["stop"] < STEP_TIMEOUT - 1.0, "the stop ran into the step time limit"
    stalled = [t for t, s, c in seen if s == 503 and c == "stalled"]
    assert stalled, f"/health never said 'stalled': {seen[-5:]}"
    assert stalled[0] - times["stop"] < 5.0, f"/health said 'stalled' {stalled[0] - times['stop']:.1f} s after SIGSTOP"
    assert all(c == "stalled" for _, s, c in seen if s != 200), seen  # never recovering, never dead
    back = [t for t, s, _ in seen if s == 200 and t > times["cont"]]
    assert back and back[0] - times["cont"] < 3.0, "/health not back to 200 soon after SIGCONT"
    errors = [o.error for o in outs if o.error]
    assert not errors, f"streams failed: {errors}\n{server.log()}"
    assert [o.text for o in outs] == reference, "streams through a stall differ from the fault-free greedy run"
    log = _log(server)
    assert f"stalled: worker 0 (pid {pid}) has not beaten for" in log, log
    assert "no longer stalled" in log and "restarting the workers" not in log
    assert wait_for_worker(server.proc.pid) == pid  # the same worker, running again


def test_sigkill_during_decoding_recovers_with_the_same_text(server, reference):
    pid = wait_for_worker(server.proc.pid)
    server.before = resources(server.proc.pid)
    watch = HealthWatch(server.base_url)
    t_fault, outs = _streams_through(server, lambda: os.kill(pid, signal.SIGKILL))
    watch.stop()
    _check_recovered(server, reference, outs, watch, pid, t_fault)
    assert "restarting the workers (restart 1)" in _log(server)


def test_stopped_worker_is_caught_by_the_watchdog(server, reference):
    pid = wait_for_worker(server.proc.pid)
    watch = HealthWatch(server.base_url)
    t_fault, outs = _streams_through(server, lambda: os.kill(pid, signal.SIGSTOP))
    seen = watch.stop()
    _check_recovered(server, reference, outs, watch, pid, t_fault)
    first_503 = next(t for t, s, _ in seen if s == 503 and t > t_fault)
    # /health says "stalled" within seconds; the step time limit (--step-timeout, plus what the
    # measured rate predicts for a decode step) then replaces the stopped worker.
    assert first_503 - t_fault < 5.0, f"stopped worker noticed {first_503 - t_fault:.1f} s after SIGSTOP"
    recovering = next(t for t, s, c in seen if c == "recovering" and t > t_fault)
    assert recovering - t_fault < STEP_TIMEOUT + 4.0, f"replaced {recovering - t_fault:.1f} s after SIGSTOP"
    assert f"worker 0 (pid {pid}) stopped: no heartbeat for" in _log(server)
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(") ")[1][0] == "Z"


def test_step_exception_is_reported_with_its_traceback_and_recovered(server, reference):
    pid = wait_for_worker(server.proc.pid)
    watch = HealthWatch(server.base_url)
    t_fault, outs = _streams_through(server, lambda: server.fault_file.touch())
    watch.stop()
    _check_recovered(server, reference, outs, watch, pid, t_fault)
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
    assert len(after.shm) == len(before.shm) == ENGINE_SEGMENTS, (before, after)
    assert after.rss_mb < before.rss_mb + 150, (before, after)
    assert len(worker_pids(server.proc.pid)) == 1


def test_a_fault_past_the_restart_budget_ends_the_engine_and_the_server(server):
    """After MAX_RESTARTS restarts within the window, the next fault is not recovered: every stream
    ends with engine_dead, and the server (--exit-on-engine-death, the default) exits non-zero,
    leaving no worker or segment."""
    for _ in range(MAX_RESTARTS):  # run on its own, this test spends the budget first
        if _log(server).count("restarting the workers (restart ") >= MAX_RESTARTS:
            break
        pid = wait_for_worker(server.proc.pid)
        os.kill(pid, signal.SIGKILL)
        wait_for_worker(server.proc.pid, old=pid)
        server.wait_ready()
    assert _log(server).count("restarting the workers (restart ") == MAX_RESTARTS
    pid = wait_for_worker(server.proc.pid)
    killed, outs = asyncio.run(kill_during_streams(server.base_url, pid, STREAM_PROMPTS))
    assert_died_cleanly(server, killed, outs)
    assert f"{MAX_RESTARTS} restarts within 600 s already" in _log(server)
