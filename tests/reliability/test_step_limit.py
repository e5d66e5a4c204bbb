"""The step time limit follows the step's size: a long prompt's prefill step, many times the
--step-timeout floor, runs to the end on a real server, where a fixed limit would have declared
the worker hung (the short-stop and SIGSTOP cases are in test_recovery.py)."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest
from server_helpers import ServerProcess, free_port, serve_cmd

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

FLOOR = 1.0  # --step-timeout: the limit of a step that the measured rate predicts to be instant


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    srv = ServerProcess(
        serve_cmd(
            port,
            "--step-timeout",
            str(FLOOR),
            "--max-model-len",
            "2048",
            "--max-num-batched-tokens",
            "2048",
            "--no-enable-prefix-caching",
        ),
        port,
        tmp_path_factory.mktemp("step_limit") / "server.log",
    )
    try:
        srv.wait_ready()
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()


def test_a_long_prefill_step_is_not_a_hang(server):
    with httpx.Client(base_url=server.base_url, timeout=300) as c:
        # A few short steps first, so the rate is measured (the first steps get a fixed allowance).
        r = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        # one 2000-token step: long enough to outlast 1.5 floors on a fast machine
        prompt = np.random.default_rng(0).integers(100, 40000, size=2000).tolist()
        t0 = time.monotonic()
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0})
        took = time.monotonic() - t0
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 2000
    log = server.log_path.read_text(errors="replace")
    assert "is hung" not in log and "restarting the workers" not in log, log
    # It did run past the floor: a fixed limit of FLOOR seconds would have replaced the worker.
    assert took > 1.5 * FLOOR, f"the prefill took {took:.2f} s; the test needs a step longer than the floor"
