"""`aiolm bench serve`'s client against a scripted OpenAI-compatible server on 127.0.0.1:
it times what vLLM's benchmark client times (the first token at the first chunk with
choices, the end at the last such chunk, not at the stream's close), takes the model
from /v1/models when none is given, counts a stream that carries an error event or no
token as failed, and a run where nothing completed exits non-zero in one line."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from aiolm.bench.serve import BenchError, _pcts, run_load
from aiolm.bench.workload import random_workload

GAP = 0.15  # seconds between the scripted chunks


class Scripted(BaseHTTPRequestHandler):
    mode = "ok"
    models: list[str] = []  # the model each completion asked for

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        body = json.dumps({"object": "list", "data": [{"id": "scripted", "object": "model"}]}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        asked = json.loads(self.rfile.read(int(self.headers["content-length"])))
        Scripted.models.append(asked["model"])
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()

        def event(data: object) -> None:
            self.wfile.write(f"data: {json.dumps(data)}\n\n".encode())
            self.wfile.flush()

        if self.mode == "ok":
            for text in ("a", "", "b"):  # an empty text is still a token's chunk
                time.sleep(GAP)
                event({"choices": [{"index": 0, "text": text}]})
            time.sleep(2 * GAP)  # the usage chunk and [DONE] come late: not part of the latency
            event({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}})
        elif self.mode == "error":
            event({"error": {"message": "request timed out", "code": "request_timeout"}})
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def scripted():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Scripted.models = []
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _load(url: str, mode: str) -> dict:
    import asyncio

    Scripted.mode = mode
    return asyncio.run(run_load(url, "", random_workload(3, (4, 4), (3, 3)), float("inf"), 0))


def test_tokens_are_timed_at_their_chunks_and_the_model_is_the_servers(scripted):
    r = _load(scripted, "ok")
    assert r["completed"] == 3 and r["failed"] == 0 and r["output_tokens"] == 9
    assert Scripted.models == ["scripted"] * 3
    assert GAP * 0.9 <= r["ttft_s"]["p50"] < 2 * GAP
    # three chunks, GAP apart: the end is the last token's chunk, not the stream's close
    assert 3 * GAP * 0.9 <= r["e2e_s"]["max"] < 4.5 * GAP, r["e2e_s"]
    assert 0.9 * GAP <= r["itl_s"]["p50"] < 2 * GAP


@pytest.mark.parametrize("mode, why", [("error", "error event: request timed out"), ("empty", "without a token")])
def test_a_stream_with_an_error_or_no_token_is_a_failed_request(scripted, mode, why):
    r = _load(scripted, mode)
    assert r["completed"] == 0 and r["failed"] == 3 and why in r["errors"][0], r
    out = subprocess.run(
        [sys.executable, "-m", "aiolm", "bench", "serve", "--base-url", scripted, "--num-requests", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    last = out.stderr.splitlines()[-1]
    assert out.returncode == 1 and "no request completed at rate inf:" in last and why in last, out.stderr
    assert "Traceback" not in out.stderr


def test_percentiles_are_numpys():
    values = [1.0, 2.0, 3.0, 10.0]
    got = _pcts(values)
    assert [got["p50"], got["p90"], got["p99"]] == [float(x) for x in np.percentile(values, [50, 90, 99])]
    assert got["p50"] == 2.5 and got["max"] == 10.0


def test_no_server_is_one_line():
    import asyncio

    with pytest.raises(BenchError, match="cannot read http://127.0.0.1:9/v1/models"):
        asyncio.run(run_load("http://127.0.0.1:9", "", random_workload(1, (4, 4), (1, 1)), 1.0, 0))
