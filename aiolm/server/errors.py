"""OpenAI-shaped errors: every failure the API reports has the same body.

``{"error": {"message", "type", "param", "code"}}`` is what OpenAI clients parse
(the Python client raises ``BadRequestError`` etc. from it), so every path that
answers with an error, including 404/405/413 and a dead engine, goes through here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from starlette.responses import Response

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


def clip(text: str, most: int = 100) -> str:
    """A client's string as an error message quotes it: at most ``most`` characters of it."""
    return text if len(text) <= most else f"{text[:most]}... ({len(text)} characters)"


def listed(names: Sequence[str], quote: Callable[[str], str] = repr, most: int = 8) -> str:
    """Names an error message lists: the first ``most`` of them, clipped and quoted, and a count
    of the rest (a client may send hundreds of thousands)."""
    out = ", ".join(quote(clip(n)) for n in names[:most])
    return out + (f" and {len(names) - most} more" if len(names) > most else "")


class APIError(Exception):
    """A request the server refuses; carries everything the error body needs."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> Response:
        return json_response(self.body(), self.status, self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# A model may write "\udc00" in a tool call's JSON: json.loads keeps such a lone surrogate,
# which has no UTF-8 encoding, so a response holding it raw could not be sent.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def escape_lone_surrogates(text: str) -> str:
    """JSON text with each lone surrogate written as its ``\\u`` escape (the same JSON)."""
    return _LONE_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def dumps(obj: Any) -> str:
    """Compact JSON; NaN/Infinity are never valid JSON, so they fail here, not in a client."""
    return escape_lone_surrogates(json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False))


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(obj), status, headers, media_type="application/json")
