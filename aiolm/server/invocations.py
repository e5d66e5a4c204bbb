"""SageMaker's ``POST /invocations``, as vLLM serves it: one route for every task, which the
body's own fields choose. The body then goes to that route's handler as it came, so the
answer, its streaming and its errors are exactly that route's."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.requests import Request
from starlette.types import Message

from aiolm.server.errors import bad_request
from aiolm.server.http import context, read_json

Endpoint = Callable[[Request], Awaitable[Any]]

# (the fields that name the task, the route that serves it), first match wins, in vLLM's order
TASKS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("messages",), "/v1/chat/completions"),
    (("prompt",), "/v1/completions"),
    (("input",), "/v1/embeddings"),
    (("text_1", "text_2"), "/score"),
    (("query", "documents"), "/rerank"),
)


def route_for(body: Mapping[str, Any]) -> str | None:
    """The route whose request ``body`` is, by its fields; None when it is none of them."""
    return next((path for fields, path in TASKS if all(f in body for f in fields)), None)


def endpoint(handlers: Mapping[str, Endpoint]) -> Endpoint:
    """The /invocations handler over ``handlers`` (route path -> its handler)."""

    async def invocations(request: Request) -> Any:
        body = await read_json(request, context(request).settings.max_request_bytes)
        path = route_for(body) if isinstance(body, dict) else None
        if path is None:
            expected = ", ".join(" + ".join(f"'{f}'" for f in fields) + f" ({p})" for fields, p in TASKS)
            raise bad_request(f"/invocations cannot tell the task from this body; it needs one of: {expected}")
        raw = json.dumps(body).encode()
        replayed = False

        async def receive() -> Message:
            # the body once, then the connection's own messages (a client leaving mid-stream)
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await request.receive()

        return await handlers[path](Request(request.scope, receive))

    return invocations
