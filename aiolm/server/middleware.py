"""Pure-ASGI middleware: request ids and access logs, body-size limit, body-read
timeout, API-key auth, a failed start's reason.

The errors they answer have the shape of the route asked (anthropic_errors.py).

Pure ASGI (not BaseHTTPMiddleware) so streaming responses pass through
untouched and the disconnect watcher sees the real ``receive`` channel.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from aiolm.server.anthropic_errors import error_response
from aiolm.server.errors import APIError
from aiolm.timeouts import wait_for

log = logging.getLogger(__name__)
access_log = logging.getLogger("aiolm.access")
_ID_OK = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")

REQUEST_ID_KEY = "aiolm.request_id"
LOG_EXTRA_KEY = "aiolm.log"  # handlers add fields here (model, tokens, ...) for the access log


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", []):
        if k.lower() == name:
            return v.decode("latin-1")
    return None


class RequestContextMiddleware:
    """Gives each request an id (the client's ``X-Request-Id`` if sane), echoes it in
    the response, and writes one JSON access-log line when the response ends."""

    def __init__(self, app: ASGIApp, access_log_enabled: bool = True) -> None:
        self.app = app
        self.enabled = access_log_enabled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = _header(scope, b"x-request-id")
        rid = given if given and _ID_OK.match(given) else uuid.uuid4().hex
        scope[REQUEST_ID_KEY] = rid
        extra: dict[str, Any] = {}
        scope[LOG_EXTRA_KEY] = extra
        start = time.perf_counter()
        status = 0
        sent = 0

        async def send_wrapper(message: Message) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", rid.encode("latin-1")))
                message = {**message, "headers": headers}
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            if self.enabled:
                client = scope.get("client")
                line = {
                    "event": "http_request",
                    "request_id": rid,
                    "method": scope.get("method"),
                    "path": scope.get("path"),
                    "status": status or 500,
                    "duration_ms": round(1e3 * (time.perf_counter() - start), 2),
                    "bytes_out": sent,
                    "client": f"{client[0]}:{client[1]}" if client else None,
                    "user_agent": _header(scope, b"user-agent"),
                    **extra,
                }
                access_log.info(json.dumps(line, ensure_ascii=False, default=str))


class InternalErrorMiddleware:
    """An exception no handler turned into an answer, before the response started: a logged
    JSON 500 naming its type, sent inside the request-id middleware (so it carries the id and
    is logged with its size) and ending the request, not the connection. Starlette's own
    handler for ``Exception`` runs outermost and re-raises, which closes a keep-alive
    connection under the client's next request. Once a response has started it cannot be
    replaced: the exception goes on."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_wrapper(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except Exception as exc:
            if started:
                raise
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"), exc_info=exc)
            err = APIError(500, f"internal server error: {type(exc).__name__}", type="server_error")
            await error_response(scope.get("path", ""), err)(scope, receive, send)


class BodyLimitMiddleware:
    """413 as soon as the declared Content-Length is over the limit (the JSON reader
    enforces the same limit on bodies without one)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            length = _header(scope, b"content-length")
            if length is not None:
                try:
                    n = int(length)
                except ValueError:
                    err = APIError(400, "invalid Content-Length header")
                    await error_response(scope.get("path", ""), err)(scope, receive, send)
                    return
                if n > self.max_bytes:
                    err = APIError(
                        413,
                        f"the request body is {n} bytes; the limit is {self.max_bytes}",
                        code="request_too_large",
                        headers={"connection": "close"},
                    )
                    await error_response(scope.get("path", ""), err)(scope, receive, send)
                    return
        await self.app(scope, receive, send)


class BodyTimeoutMiddleware:
    """408 when a request body does not arrive whole within ``timeout`` seconds.

    A slow client (slowloris) would otherwise hold a connection and a handler
    forever, a byte at a time. The deadline covers the whole body, not each
    chunk, so trickling cannot extend it; once the body is in, ``receive`` is
    passed through untouched (the disconnect watcher waits on it for as long
    as a response streams).
    """

    def __init__(self, app: ASGIApp, timeout: float) -> None:
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.timeout <= 0:
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        body_done = False

        async def timed_receive() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            left = deadline - loop.time()
            try:
                message = await wait_for(receive(), max(left, 0.0))
            except asyncio.TimeoutError:
                raise APIError(
                    408,
                    f"the request body did not arrive within {self.timeout:g} s",
                    code="request_timeout",
                    headers={"connection": "close"},
                ) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        await self.app(scope, timed_receive, send)


OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/openapi.json", "/ping", "/load", "/"})
# The chat page's static files: the page must load before it can ask for the key.
OPEN_PREFIXES = ("/web/",)


def _is_open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


class AuthMiddleware:
    """``Authorization: Bearer <key>`` (OpenAI's clients) or ``x-api-key: <key>`` (Anthropic's)
    on everything but the probes, the schema and the chat page."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") != "OPTIONS" and not _is_open(scope.get("path", "")):
            if not (self._bearer_ok(scope) or self._x_api_key_ok(scope)):
                err = APIError(
                    401,
                    "missing or invalid API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')",
                    code="invalid_api_key",
                    headers={"www-authenticate": "Bearer"},
                )
                await error_response(scope.get("path", ""), err)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _bearer_ok(self, scope: Scope) -> bool:
        # RFC 7235: the scheme is case-insensitive and one or more spaces end it.
        scheme, _, token = (_header(scope, b"authorization") or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip(" ").encode("latin-1"), self.expected)

    def _x_api_key_ok(self, scope: Scope) -> bool:
        key = _header(scope, b"x-api-key")
        return key is not None and hmac.compare_digest(key.strip(" ").encode("latin-1"), self.expected)


class StartupFailureMiddleware:
    """Hands the ASGI server a failed start's reason in one line (``reason()``, set by the
    lifespan) in place of Starlette's traceback, which buries it under thirty lines of our
    frames (``--log-level debug`` logs the traceback too)."""

    def __init__(self, app: ASGIApp, reason: Callable[[], str | None]) -> None:
        self.app = app
        self.reason = reason

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        async def reporting(message: Message) -> None:
            why = self.reason()
            if message["type"] == "lifespan.startup.failed" and why is not None:
                message = {**message, "message": why}
            await send(message)

        await self.app(scope, receive, reporting)
