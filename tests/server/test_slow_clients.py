"""The connection guard of `aiolm serve` (aiolm/server/slow_clients.py) on real sockets: partial
headers are cut off after --header-timeout, a slow body is not (it has its own limit), a kept-alive
connection is timed again for its next request, and connections past --max-connections are
closed as they open. First against uvicorn serving a small app, then against `aiolm serve`."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from server_helpers import free_port
from uvicorn.protocols.http.h11_impl import H11Protocol

from aiolm.server.slow_clients import guarded

HEADER_TIMEOUT = 1.0
MAX_CONNECTIONS = 8


async def _echo_app(scope, receive, send):
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    reply = b"got " + str(len(body)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(reply)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": reply})


@pytest.fixture(scope="module")
def guarded_server():
    port = free_port()
    config = uvicorn.Config(
        _echo_app,
        host="127.0.0.1",
        port=port,
        lifespan="off",
        log_level="warning",
        http=guarded(H11Protocol, HEADER_TIMEOUT, MAX_CONNECTIONS),
    )
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(srv.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield port
    srv.should_exit = True
    thread.join(10)


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    return s


def _reply(s: socket.socket) -> bytes:
    """One whole response (this app's carry a content-length)."""
    s.settimeout(5)
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < int(
        data.split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0]
    ):
        chunk = s.recv(4096)
        assert chunk, f"closed mid-response: {data!r}"
        data += chunk
    return data


def _closed_after(s: socket.socket, limit: float) -> float:
    """Seconds until the server closes ``s`` (reads EOF or a reset), failing past ``limit``."""
    t0 = time.monotonic()
    s.settimeout(limit)
    try:
        while s.recv(4096):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the connection was still open after {limit} s")
    return time.monotonic() - t0


def test_partial_headers_are_cut_off_after_the_timeout(guarded_server):
    s = _connect(guarded_server)
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    took = _closed_after(s, HEADER_TIMEOUT + 3)
    assert HEADER_TIMEOUT - 0.2 < took < HEADER_TIMEOUT + 1.5, took
    s.close()
    silent = _connect(guarded_server)  # a connection that sends nothing at all
    assert _closed_after(silent, HEADER_TIMEOUT + 3) < HEADER_TIMEOUT + 1.5
    silent.close()


def test_headers_within_the_timeout_and_a_slow_body_are_served(guarded_server):
    s = _connect(guarded_server)
    for piece in (b"POST / HTTP/1.1\r\n", b"Host: x\r\n", b"Content-Length: 3\r\n\r\n"):
        s.sendall(piece)
        time.sleep(HEADER_TIMEOUT / 4)
    for byte in b"abc":  # the body trickles for longer than the header timeout
        time.sleep(HEADER_TIMEOUT * 0.6)
        s.sendall(bytes([byte]))
    reply = _reply(s)
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"got 3"), reply
    s.close()


def test_a_kept_alive_connection_is_timed_again_for_its_next_request(guarded_server):
    s = _connect(guarded_server)
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _reply(s).startswith(b"HTTP/1.1 200")
    time.sleep(HEADER_TIMEOUT * 1.5)  # idle (uvicorn's keep-alive timeout is 5 s): still open
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _reply(s).startswith(b"HTTP/1.1 200")
    s.sendall(b"GET / HTTP/1.1\r\nHo")  # the next request's headers stop
    assert _closed_after(s, HEADER_TIMEOUT + 3) < HEADER_TIMEOUT + 1.5
    s.close()


def test_connections_past_the_cap_are_closed_as_they_open(guarded_server):
    held = [_connect(guarded_server) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)  # all accepted
        extra = _connect(guarded_server)
        assert _closed_after(extra, 2.0) < 1.0
        extra.close()
        for s in held:  # the first MAX_CONNECTIONS were kept (until their header timeout)
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1)
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)
    with httpx.Client(timeout=5) as c:  # room again once they left
        assert c.get(f"http://127.0.0.1:{guarded_server}/").status_code == 200


def test_aiolm_serve_closes_slow_header_connections_and_keeps_serving(server):
    """The real server (default --header-timeout 10): 300 connections stopping in their headers are
    all closed soon after it, while a normal request meanwhile is answered."""
    port = server.port
    slow = []
    for _ in range(300):
        s = _connect(port)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
        slow.append(s)
    t0 = time.monotonic()
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    try:
        for s in slow:
            _closed_after(s, max(1.0, 10.0 + 5.0 - (time.monotonic() - t0)))
    finally:
        for s in slow:
            s.close()
    assert time.monotonic() - t0 > 8.0  # not before the timeout


@pytest.mark.parametrize("hard, cap", [(8192, 2048), (1024, 512)])
def test_the_open_file_limit_is_raised_to_hold_the_cap_or_the_cap_lowered(hard, cap):
    """Under ``ulimit -n 1024`` the default cap of 2048 never applied: accept() failed first and
    clients were reset with nothing logged. The soft limit is raised toward the hard one; where
    that cannot hold the cap, the cap is lowered to fit, with a warning."""
    import os
    import resource
    import subprocess
    import sys

    now = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if now != resource.RLIM_INFINITY and now < hard and os.geteuid() != 0:
        pytest.skip(f"the hard open-file limit here is {now}")
    code = (
        "import logging, resource; logging.basicConfig(); "
        f"resource.setrlimit(resource.RLIMIT_NOFILE, (1024, {hard})); "
        "from aiolm.server.slow_clients import connections_allowed; "
        "print(connections_allowed(2048), resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    allowed, soft = map(int, out.stdout.split())
    assert allowed == cap and soft == min(hard, 2048 + 512)
    assert ("at most 512 connections" in out.stderr) == (cap < 2048), out.stderr
