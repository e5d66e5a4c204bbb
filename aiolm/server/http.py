"""Request plumbing the routes share: reading JSON bodies safely, the model check."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.requests import Request

from aiolm.server.context import ServingContext
from aiolm.server.errors import APIError, bad_request
from aiolm.server.middleware import LOG_EXTRA_KEY

_OFFLOAD_BYTES = 64 << 10  # parse bodies above this off the event loop


def context(request: Request) -> ServingContext:
    return request.app.state.ctx


def log_extra(request: Request, **fields: Any) -> None:
    """Fields for this request's access-log line."""
    extra = request.scope.get(LOG_EXTRA_KEY)
    if extra is not None:
        extra.update({k: v for k, v in fields.items() if v is not None})


async def read_json(request: Request, max_bytes: int) -> Any:
    """The body as JSON: 415 on a non-JSON content type, 413 over the limit, 400 if malformed."""
    ctype = request.headers.get("content-type")
    if ctype:
        main = ctype.split(";", 1)[0].strip().lower()
        if main != "application/json" and not main.endswith("+json"):
            raise APIError(415, f"Content-Type must be application/json, got {main!r}",
                           code="unsupported_media_type")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise APIError(413, f"the request body is over the {max_bytes}-byte limit", code="request_too_large",
                           headers={"connection": "close"})
    if not body.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        if len(body) > _OFFLOAD_BYTES:
            return await asyncio.to_thread(json.loads, body)
        return json.loads(body)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None


def check_model(ctx: ServingContext, model: str | None) -> None:
    """Like OpenAI: naming a model that is not served is a 404; omitting it is fine."""
    if model is not None and model != ctx.model_name:
        raise APIError(404, f"The model '{model}' does not exist; this server serves '{ctx.model_name}'.",
                       param="model", code="model_not_found")
