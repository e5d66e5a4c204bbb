"""/openapi.json, generated from the same field specs that validate requests."""

from __future__ import annotations

from typing import Any

import aiolm
from aiolm.server.protocol import Limits, chat_request, completion_request, detokenize_request, tokenize_request

_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
_USAGE = {"type": "object", "properties": {k: {"type": "integer"} for k in
                                           ("prompt_tokens", "completion_tokens", "total_tokens")}}


def _errors(*codes: int) -> dict[str, Any]:
    return {str(c): {"description": "error", "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/Error"}}}} for c in codes}


def _ok(schema: dict[str, Any], stream: bool = False, media: str = "application/json") -> dict[str, Any]:
    content = {media: {"schema": schema}}
    if stream:
        content["text/event-stream"] = {"schema": {"type": "string"},
                                        "description": "`data: {chunk}` events, then `data: [DONE]`"}
    return {"200": {"description": "OK", "content": content}}


def _post(summary: str, body_ref: str, ok: dict[str, Any], stream: bool = False) -> dict[str, Any]:
    return {"post": {
        "summary": summary, "operationId": summary.lower().replace(" ", "_"),
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{body_ref}"}}}},
        "responses": {**_ok(ok, stream), **_errors(400, 401, 404, 413, 415, 503)},
    }}


def _get(summary: str, ok: dict[str, Any], media: str = "application/json", errors: tuple[int, ...] = ()) -> dict:
    return {"get": {"summary": summary, "operationId": summary.lower().replace(" ", "_"),
                    "responses": {**_ok(ok, media=media), **_errors(*errors)}}}


def openapi_schema(limits: Limits, model_name: str) -> dict[str, Any]:
    choice = {"type": "object", "properties": {"index": {"type": "integer"},
                                               "finish_reason": {"type": ["string", "null"]}}}
    completion_like = {"type": "object", "required": ["id", "object", "created", "model", "choices"],
                       "properties": {"id": {"type": "string"}, "object": {"type": "string"},
                                      "created": {"type": "integer"}, "model": {"type": "string"},
                                      "choices": {"type": "array", "items": choice}, "usage": _USAGE}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "aiolm", "version": aiolm.__version__,
                 "description": f"OpenAI-compatible API serving '{model_name}'."},
        "paths": {
            "/v1/chat/completions": _post("Create chat completion", "ChatCompletionRequest", completion_like, True),
            "/v1/completions": _post("Create completion", "CompletionRequest", completion_like, True),
            "/tokenize": _post("Tokenize", "TokenizeRequest", {"type": "object", "properties": {
                "count": {"type": "integer"}, "max_model_len": {"type": "integer"},
                "tokens": {"type": "array", "items": {"type": "integer"}}}}),
            "/detokenize": _post("Detokenize", "DetokenizeRequest", {"type": "object", "properties": {
                "prompt": {"type": "string"}}}),
            "/v1/models": _get("List models", {"type": "object", "properties": {
                "object": {"type": "string"}, "data": {"type": "array", "items": {"type": "object"}}}}, errors=(401,)),
            "/health": _get("Health", {"type": "object"}, errors=(503,)),
            "/version": _get("Version", {"type": "object", "properties": {"version": {"type": "string"}}}),
            "/metrics": _get("Prometheus metrics", {"type": "string"}, media="text/plain"),
        },
        "components": {
            "schemas": {
                "ChatCompletionRequest": chat_request(limits).schema(),
                "CompletionRequest": completion_request(limits).schema(),
                "TokenizeRequest": tokenize_request(limits).schema(),
                "DetokenizeRequest": detokenize_request(limits).schema(),
                "Error": _ERROR,
            },
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }
