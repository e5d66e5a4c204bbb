"""/openapi.json, generated from the same field specs that validate requests.

Every route the app serves is a path here (tests/server/test_server_endpoints.py walks both).
"""

from __future__ import annotations

from typing import Any

import aiolm
from aiolm.server.protocol import (Limits, chat_request, completion_request, detokenize_request, responses_request,
                                   tokenize_request)

_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
_USAGE = {"type": "object", "properties": {k: {"type": "integer"} for k in
                                           ("prompt_tokens", "completion_tokens", "total_tokens")}}
_INT, _STR, _NULLABLE_STR = {"type": "integer"}, {"type": "string"}, {"type": ["string", "null"]}
_CHUNKS = "`data: {chunk}` events, then `data: [DONE]`"
_RESPONSE_EVENTS = ("`event: <type>` and `data: {event}` pairs, each event with `type` and `sequence_number`: "
                    "response.created, response.in_progress, response.output_item.added, "
                    "response.content_part.added, response.output_text.delta (many), response.output_text.done, "
                    "response.content_part.done, response.output_item.done, then response.completed "
                    "(response.incomplete when max_output_tokens cut the text; an `error` event if the engine "
                    "failed); no [DONE]")
_OUTPUT_TEXT = {"type": "object", "properties": {
    "type": {"type": "string", "enum": ["output_text"]}, "text": _STR,
    "annotations": {"type": "array", "maxItems": 0}, "logprobs": {"type": "array", "maxItems": 0}}}
_RESPONSE = {
    "type": "object", "required": ["id", "object", "created_at", "status", "model", "output", "usage"],
    "properties": {
        "id": _STR, "object": {"type": "string", "enum": ["response"]}, "created_at": _INT,
        "status": {"type": "string", "enum": ["completed", "incomplete", "failed", "in_progress"]},
        "error": {"type": ["object", "null"]},
        "incomplete_details": {"type": ["object", "null"], "properties": {
            "reason": {"type": "string", "enum": ["max_output_tokens"]}}},
        "instructions": _NULLABLE_STR, "max_output_tokens": {"type": ["integer", "null"]},
        "metadata": {"type": "object"}, "model": _STR, "temperature": {"type": "number"},
        "top_p": {"type": "number"}, "text": {"type": "object"}, "user": _NULLABLE_STR,
        "output": {"type": "array", "items": {"type": "object", "properties": {
            "id": _STR, "type": {"type": "string", "enum": ["message"]},
            "role": {"type": "string", "enum": ["assistant"]}, "status": _STR,
            "content": {"type": "array", "items": _OUTPUT_TEXT}}}},
        "usage": {"type": ["object", "null"], "properties": {
            "input_tokens": _INT, "output_tokens": _INT, "total_tokens": _INT,
            "input_tokens_details": {"type": "object", "properties": {"cached_tokens": _INT}},
            "output_tokens_details": {"type": "object", "properties": {"reasoning_tokens": _INT}}}},
    },
}
_MODEL = {"type": "object", "properties": {"id": _STR, "object": _STR, "created": _INT, "owned_by": _STR,
                                           "root": _STR, "parent": {"type": "null"}, "max_model_len": _INT}}
_TOKENIZER_INFO = {
    "type": "object", "required": ["tokenizer_class", "vocab_size", "max_model_len"],
    "description": "the tokenizer's configuration (tokenizer_config.json's keys, less file paths)",
    "properties": {"tokenizer_class": _STR, "vocab_size": _INT, "max_model_len": _INT,
                   "model_max_length": {"type": "number", "description": "the tokenizer's own limit"},
                   "chat_template": _NULLABLE_STR, **{k: _NULLABLE_STR for k in
                                                      ("bos_token", "eos_token", "pad_token", "unk_token")}},
}


def _errors(*codes: int) -> dict[str, Any]:
    return {str(c): {"description": "error", "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/Error"}}}} for c in codes}


def _ok(schema: dict[str, Any], stream: str | None = None, media: str = "application/json") -> dict[str, Any]:
    """``stream``: what the ``text/event-stream`` answer to ``"stream": true`` carries."""
    content = {media: {"schema": schema}}
    if stream:
        content["text/event-stream"] = {"schema": {"type": "string"}, "description": stream}
    return {"200": {"description": "OK", "content": content}}


def _post(summary: str, body_ref: str, ok: dict[str, Any], stream: str | None = None) -> dict[str, Any]:
    return {"post": {
        "summary": summary, "operationId": summary.lower().replace(" ", "_"),
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{body_ref}"}}}},
        "responses": {**_ok(ok, stream), **_errors(400, 401, 404, 413, 415, 503)},
    }}


def _get(summary: str, ok: dict[str, Any], media: str = "application/json", errors: tuple[int, ...] = (),
         params: tuple[str, ...] = ()) -> dict:
    """``params``: the path's ``{name}`` parameters."""
    op: dict[str, Any] = {"summary": summary, "operationId": summary.lower().replace(" ", "_"),
                          "responses": {**_ok(ok, media=media), **_errors(*errors)}}
    if params:
        op["parameters"] = [{"name": p, "in": "path", "required": True, "schema": _STR} for p in params]
    return {"get": op}


def _web_paths() -> dict[str, Any]:
    """The chat page (``--web-ui``) and its static files."""
    return {"/": _get("Chat page", _STR, media="text/html"),
            "/web/{path}": _get("Chat page files", _STR, media="application/octet-stream", errors=(404,),
                                params=("path",))}


def openapi_schema(limits: Limits, model_name: str, web_ui: bool = False) -> dict[str, Any]:
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
            "/v1/chat/completions": _post("Create chat completion", "ChatCompletionRequest", completion_like,
                                          _CHUNKS),
            "/v1/completions": _post("Create completion", "CompletionRequest", completion_like, _CHUNKS),
            "/v1/responses": _post("Create response", "ResponsesRequest", _RESPONSE, _RESPONSE_EVENTS),
            "/tokenize": _post("Tokenize", "TokenizeRequest", {"type": "object", "properties": {
                "count": {"type": "integer"}, "max_model_len": {"type": "integer"},
                "tokens": {"type": "array", "items": {"type": "integer"}},
                "token_strs": {"type": ["array", "null"], "items": _STR,
                               "description": "null unless 'return_token_strs'"}}}),
            "/detokenize": _post("Detokenize", "DetokenizeRequest", {"type": "object", "properties": {
                "prompt": {"type": "string"}}}),
            "/tokenizer_info": _get("Tokenizer info", _TOKENIZER_INFO, errors=(401,)),
            "/load": _get("Server load", {"type": "object", "properties": {"server_load": {
                "type": "integer", "description": "generation requests being served now"}}}),
            "/v1/models": _get("List models", {"type": "object", "properties": {
                "object": {"type": "string"}, "data": {"type": "array", "items": _MODEL}}}, errors=(401,)),
            "/v1/models/{model}": _get("Retrieve model", _MODEL, errors=(401, 404), params=("model",)),
            "/health": _get("Health", {"type": "object", "properties": {"status": _STR}}, errors=(503,)),
            "/ping": _get("Ping", {"type": "object", "properties": {"status": _STR}}, errors=(503,)),
            "/version": _get("Version", {"type": "object", "properties": {"version": {"type": "string"}}}),
            "/metrics": _get("Prometheus metrics", {"type": "string"}, media="text/plain"),
            "/openapi.json": _get("OpenAPI document", {"type": "object"}),
            **(_web_paths() if web_ui else {}),
        },
        "components": {
            "schemas": {
                "ChatCompletionRequest": chat_request(limits).schema(),
                "CompletionRequest": completion_request(limits).schema(),
                "TokenizeRequest": tokenize_request(limits).schema(),
                "DetokenizeRequest": detokenize_request(limits).schema(),
                "ResponsesRequest": responses_request(limits).schema(),
                "Error": _ERROR,
            },
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }
