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
