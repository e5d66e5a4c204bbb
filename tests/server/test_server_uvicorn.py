"""The app under uvicorn's own command line via the ``create_app()`` factory: one log line per request."""

from __future__ import annotations

import shlex
import signal
import sys

import httpx
from server_helpers import LIGHT_ENGINE_FLAGS, ServerProcess, free_port


def test_each_request_is_logged_once_under_uvicorn(tmp_path):
    port = free_port()
    env = {"AIOLM_ARGS": shlex.join(LIGHT_ENGINE_FLAGS)}
    cmd = [
        sys.executable,
        "-m",
        "uvicorn",
        "--factory",
        "aiolm.server:create_app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    srv = ServerProcess(cmd, port, tmp_path / "server.log", env)
    try:
        srv.wait_ready()
        for _ in range(3):
            assert httpx.get(srv.base_url + "/v1/models", timeout=10).status_code == 200
    finally:
        code = srv.stop()
    # uvicorn's own command line re-raises SIGTERM after its graceful shutdown.
    assert code in (0, -signal.SIGTERM), srv.log_path.read_text()[-3000:]
    log = srv.log_path.read_text()
    lines = [ln for ln in log.splitlines() if "/v1/models" in ln]
    assert len(lines) == 3 and all('"event": "http_request"' in ln for ln in lines), log[-3000:]


def test_streams_past_the_shutdown_timeout_end_with_an_error_event(tmp_path):
    """SIGTERM with streams that cannot finish within --shutdown-timeout: each ends with an
    in-band 'shutting down' error and [DONE] (uvicorn cut them mid-chunk at the same moment,
    before the drain could say why), a short one finishes whole, and the server exits 0."""
    import json
    import threading
    import time

    from server_helpers import serve_cmd

    port = free_port()
    srv = ServerProcess(serve_cmd(port, "--shutdown-timeout", "2"), port, tmp_path / "server.log")
    results: dict[str, list[str]] = {}

    def stream(name: str, max_tokens: int) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=60) as r:
            results[name] = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]

    try:
        srv.wait_ready()
        threads = [threading.Thread(target=stream, args=(f"long{i}", 900)) for i in range(2)]
        threads.append(threading.Thread(target=stream, args=("short", 8)))
        for t in threads:
            t.start()
        time.sleep(1.0)  # every stream has begun
        t0 = time.monotonic()
        code = srv.stop(timeout=30)
        took = time.monotonic() - t0
        for t in threads:
            t.join(30)
    finally:
        srv.kill()
    assert code == 0 and took < 2 + 5, (code, took, srv.log_path.read_text()[-3000:])
    short = [json.loads(e) for e in results["short"][:-1]]
    assert results["short"][-1] == "[DONE]" and short[-1]["choices"][0]["finish_reason"] == "length"
    for name in ("long0", "long1"):
        events = results[name]
        assert events[-1] == "[DONE]", events[-3:]
        last = json.loads(events[-2])
        assert last["error"]["code"] == "shutting_down", last
    assert "Exception in ASGI application" not in srv.log_path.read_text()


def test_a_model_that_cannot_work_is_one_line_under_uvicorn():
    """create_app() checks the model and its flags before anything starts, as `aiolm serve`
    does (it was a lifespan traceback of about thirty lines)."""
    import os
    import subprocess

    cmd = [sys.executable, "-m", "uvicorn", "--factory", "aiolm.server:create_app", "--port", str(free_port())]
    for env, words in (
        ({"AIOLM_MODEL": "/no/such/model.gguf"}, "no such file or directory"),
        ({"AIOLM_ARGS": "--tensor-parallel-size 2"}, "tensor_parallel_size 2 cannot split"),
    ):
        out = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and words in out.stderr, out.stderr
        assert "Traceback" not in out.stderr, out.stderr
