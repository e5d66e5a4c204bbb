"""A request whose steps are in two worker failures is failed, not requeued a third time.

Whatever in a request breaks the workers (an input no check foresaw) would otherwise be
recomputed into every new worker set until the restart budget is spent and the engine
ends for everyone. One `aiolm serve` with the test-only fault hook (AIOLM_TEST_FAULT names
a file; the worker raises in the next step once it exists): one long stream runs through
two faults. It ends with an error naming the failures, the engine stays up (two restarts
of three allowed), and a request after it is served whole.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from reliability_helpers import greedy, wait_for_worker
from server_helpers import ServerProcess, free_port, serve_cmd

pytestmark = [pytest.mark.reliability, pytest.mark.slow]


def _fault(srv: ServerProcess, pid: int) -> int:
    """Raise in the worker's next step; wait for its replacement and the server's health."""
    srv.fault_file.touch()
    new = wait_for_worker(srv.proc.pid, old=pid)
    deadline = time.monotonic() + 120
    while httpx.get(srv.base_url + "/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, srv.log()
        time.sleep(0.2)
    return new


def test_a_request_in_two_worker_failures_is_failed_and_the_engine_serves_on(tmp_path):
    port = free_port()
    srv = ServerProcess(
        serve_cmd(port, "--max-worker-restarts", "3", "--shutdown-timeout", "5"),
        port,
        tmp_path / "server.log",
        env={"AIOLM_TEST_FAULT": str(tmp_path / "fault")},
    )
    srv.fault_file = tmp_path / "fault"
    events: list[dict] = []
    first = threading.Event()

    def stream() -> None:
        body = {**greedy("Once upon a time", 800, ignore_eos=True), "stream": True}
        with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    first.set()

    with srv.serving("suspect-requests server"):
        pid = wait_for_worker(srv.proc.pid)
        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(120), srv.log()
        pid = _fault(srv, pid)  # the stream is requeued and resumes
        n = len(events)
        deadline = time.monotonic() + 120
        while len(events) == n and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(events) > n, "the stream did not resume after the first failure"
        _fault(srv, pid)  # its second: it fails
        t.join(120)
        assert "error" in events[-1], events[-3:]
        assert "worker failures" in events[-1]["error"]["message"], events[-1]
        r = httpx.post(srv.base_url + "/v1/completions", json=greedy("Hello", 8), timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
        log = srv.log_path.read_text()
        assert "restarting the workers (restart 2)" in log and "restart 3)" not in log
