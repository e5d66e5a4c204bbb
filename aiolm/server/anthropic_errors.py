"""Errors in Anthropic's shape on the Messages API routes.

The ``anthropic`` client raises ``BadRequestError`` etc. by the status and reads
``{"type": "error", "error": {"type", "message"}}``; the OpenAI routes keep errors.py's
shape. Every error the server raises is an APIError whatever the route, so the app's
handlers and the middleware ask ``is_anthropic_path`` which body to write.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import Response

from aiolm.server.errors import APIError, json_response

_PREFIX = "/v1/messages"

# Anthropic's error types by status; any other 4xx is invalid_request_error, any 5xx api_error.
_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def is_anthropic_path(path: str) -> bool:
    return path == _PREFIX or path.startswith(_PREFIX + "/")


def error_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def anthropic_body(err: APIError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(err.status), "message": err.message}}


def anthropic_response(err: APIError) -> Response:
    return json_response(anthropic_body(err), err.status, err.headers)


def error_response(path: str, err: APIError) -> Response:
    """``err`` in the shape the route at ``path`` answers errors in."""
    return anthropic_response(err) if is_anthropic_path(path) else err.response()
