"""Request plumbing the routes share: reading JSON bodies safely, the model check."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any, TypeVar

from starlette.requests import Request

from aiolm.lora.request import LoRARequest
from aiolm.server import client_json
from aiolm.server.context import ServingContext
from aiolm.server.errors import APIError, bad_request, clip, listed
from aiolm.server.middleware import LOG_EXTRA_KEY

T = TypeVar("T")
_OFFLOAD_BYTES = 64 << 10  # parse bodies above this off the event loop
_BODY_BYTES = "aiolm.body_bytes"  # the scope key read_json leaves the body's size under


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
            raise APIError(415, f"Content-Type must be application/json, got {main!r}", code="unsupported_media_type")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise APIError(
                413,
                f"the request body is over the {max_bytes}-byte limit",
                code="request_too_large",
                headers={"connection": "close"},
            )
    request.scope[_BODY_BYTES] = len(body)
    if not body.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        value = (
            await asyncio.to_thread(client_json.loads, body) if len(body) > _OFFLOAD_BYTES else client_json.loads(body)
        )
    except client_json.TooDeep as e:
        raise bad_request(f"the request body is {e}", code="invalid_json") from None
    except ValueError as e:  # UnicodeDecodeError is a ValueError
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if _may_hold_surrogates(body):
        where = lone_surrogate_path(value)  # recursion bounded by client_json.MAX_DEPTH
        if where is not None:
            raise bad_request(
                f"'{where}' contains a lone UTF-16 surrogate, which is not valid Unicode text",
                param=where,
                code="invalid_unicode",
            )
    return value


async def off_loop_if_big(request: Request, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, in a thread when the request's body was big: checking a schema or tools of
    megabytes (walks, dumps, validation) takes the loop hundreds of milliseconds; a small one
    costs less inline than a thread's hand-off."""
    if request.scope.get(_BODY_BYTES, 0) > _OFFLOAD_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def _may_hold_surrogates(body: bytes | bytearray) -> bool:
    """Surrogates reach json.loads only as \\uD800-\\uDFFF escapes or as their UTF-8 bytes
    (decoded with 'surrogatepass'); bodies without either skip the walk."""
    return b"\\ud" in body or b"\\uD" in body or _RAW_SURROGATE.search(body) is not None


_RAW_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")


def lone_surrogate_path(value: Any, path: str = "") -> str | None:
    """The path (``messages[0].content``) of the first string or key holding a lone surrogate.

    A valid pair was already joined into one code point by json.loads, so any code point
    left in U+D800-U+DFFF is unpaired and would fail every UTF-8 encode downstream."""
    if isinstance(value, str):
        return (path or "body") if _SURROGATE.search(value) else None
    if isinstance(value, list):
        for i, v in enumerate(value):
            found = lone_surrogate_path(v, f"{path}[{i}]")
            if found is not None:
                return found
    elif isinstance(value, dict):
        for k, v in value.items():
            if _SURROGATE.search(k):  # name the key in escapes: it cannot be encoded as it is
                k = k.encode("utf-8", "backslashreplace").decode()
                return f"{path}.{k}" if path else k
            key_path = f"{path}.{k}" if path else k
            found = lone_surrogate_path(v, key_path)
            if found is not None:
                return found
    return None


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_model(ctx: ServingContext, model: str | None) -> LoRARequest | None:
    """The LoRA adapter the request's ``model`` names (None: the base model). Like OpenAI:
    naming a model that is not served is a 404; omitting it is fine."""
    if model is None or model == ctx.model_name:
        return None
    lora = ctx.engine.lora(model)
    if lora is not None:
        return lora
    names = [ctx.model_name, *(a.lora_name for a in ctx.engine.list_loras())]
    served = listed(names, quote=lambda n: f"'{n}'")
    raise APIError(
        404,
        f"The model '{clip(model)}' does not exist; this server serves {served}.",
        param="model",
        code="model_not_found",
    )
