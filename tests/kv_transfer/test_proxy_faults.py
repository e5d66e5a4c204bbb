"""`aiolm proxy` when its decode instance fails: a real proxy process in front of a fake
decode instance on 127.0.0.1 that streams one event and then drops the connection, and
then is gone. The client gets JSON errors and in-band stream errors, never a plain-text
500 or a stream cut mid-chunk; the proxy's health follows its decode instances'."""

from __future__ import annotations

import json
import socket
import sys
import threading
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_helpers import ServerProcess, free_port  # noqa: E402

FIRST = {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": "Hello", "finish_reason": None}]}


class BreakingDecode:
    """Answers /health with 200; a POST with a chunked event stream cut off after one event."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            data = b""
            while b"\r\n\r\n" not in data:
                got = conn.recv(65536)
                if not got:
                    return
                data += got
            head, _, rest = data.partition(b"\r\n\r\n")
            length = next(
                (
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                ),
                0,
            )
            while len(rest) < length:
                rest += conn.recv(65536)
            if head.startswith(b"GET /health"):
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
                return
            body = json.loads(rest) if head.startswith(b"POST") else {}
            if body.get("prompt") == "busy":  # a refusal with the headers a client backs off by
                error = b'{"error":{"message":"the engine is full","code":"too_many_requests"}}'
                conn.sendall(
                    b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nRetry-After: 7\r\n"
                    + b"X-Request-Id: busy-1\r\nSet-Cookie: a=1; Expires=Wed, 21 Oct 2026 07:28:00 GMT\r\n"
                    + b"Set-Cookie: b=2\r\nContent-Length: "
                    + str(len(error)).encode()
                    + b"\r\n\r\n"
                    + error
                )
                return
            if body.get("stream"):
                # one whole event, then (prompt "break") half of the next one
                event = f"data: {json.dumps(FIRST)}\n\n".encode()
                if body.get("prompt") == "break":
                    event += b'data: {"id": "cmpl-1", "cho'
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                    + f"{len(event):x}\r\n".encode()
                    + event
                    + b"\r\n"
                )
            # anything else: the connection drops without an answer

    def close(self) -> None:
        self.server.close()


def test_a_failing_decode_instance_is_a_502_or_an_error_event(tmp_path):
    decode = BreakingDecode()
    dead = f"http://127.0.0.1:{free_port()}"  # a prefill instance that is not there: the decode one computes
    port = free_port()
    cmd = [sys.executable, "-m", "aiolm", "proxy", "--prefill", dead, "--decode", decode.url, "--port", str(port)]
    proxy = ServerProcess(cmd, port, tmp_path / "proxy.log")
    body = {"model": "m", "prompt": "Hi", "max_tokens": 4}
    try:
        with proxy.serving("proxy"):
            with httpx.stream(
                "POST", proxy.base_url + "/v1/completions", json={**body, "stream": True}, timeout=30
            ) as r:
                assert r.status_code == 200
                events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
            assert json.loads(events[0]) == FIRST
            assert "the decode instance" in json.loads(events[1])["error"]["message"]
            assert events[2:] == ["[DONE]"]
            with httpx.stream(
                "POST", proxy.base_url + "/v1/completions", json={**body, "prompt": "break", "stream": True}, timeout=30
            ) as r:
                events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
            # the half event is not relayed: an SSE client would take it for a whole one
            assert json.loads(events[0]) == FIRST
            assert "the decode instance" in json.loads(events[1])["error"]["message"]
            assert events[2:] == ["[DONE]"]
            r = httpx.post(proxy.base_url + "/v1/completions", json={**body, "prompt": "busy"}, timeout=30)
            assert r.status_code == 429 and r.headers["retry-after"] == "7" and r.headers["x-request-id"] == "busy-1"
            assert r.headers.get_list("set-cookie") == ["a=1; Expires=Wed, 21 Oct 2026 07:28:00 GMT", "b=2"]
            assert r.json()["error"]["code"] == "too_many_requests"
            r = httpx.post(proxy.base_url + "/v1/completions", json=body, timeout=30)  # dropped unanswered
            assert r.status_code == 502 and r.json()["error"]["code"] == "bad_gateway"
            decode.close()  # gone
            r = httpx.get(proxy.base_url + "/v1/models", timeout=30)
            assert r.status_code == 502 and decode.url in r.json()["error"]["message"]
            r = httpx.get(proxy.base_url + "/health", timeout=30)
            assert r.status_code == 503
        assert "Exception in ASGI application" not in proxy.log()
    finally:
        decode.close()
