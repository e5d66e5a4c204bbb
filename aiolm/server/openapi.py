"""/openapi.json, generated from the pydantic models that parse requests (protocol.py)
and describe answers (output_models.py).

Every route the app serves is a path here (tests/server/test_server_endpoints.py walks both).
"""

from __future__ import annotations

import functools
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

import aiolm
from aiolm.server import output_models as out
from aiolm.server.anthropic_protocol import ANTHROPIC_POSTS, ANTHROPIC_REQUEST_MODELS, AnthropicErrorResponse
from aiolm.server.invocations import TASKS
from aiolm.server.pooling_protocol import POOLING_POSTS, POOLING_REQUEST_MODELS
from aiolm.server.protocol import REQUEST_MODELS, Limits, bounded

_REF = "#/components/schemas/{model}"
_STR = {"type": "string"}
_CHUNKS = "`data: {chunk}` events, then `data: [DONE]`"
_RESPONSE_EVENTS = (
    "`event: <type>` and `data: {event}` pairs, each event with `type` and `sequence_number`: "
    "response.created, response.in_progress, response.output_item.added, "
    "response.content_part.added, response.output_text.delta (many), response.output_text.done, "
    "response.content_part.done, response.output_item.done, then response.completed "
    "(response.incomplete when max_output_tokens cut the text; an `error` event if the engine "
    "failed); no [DONE]"
)
# (path, summary, answer model, what a stream carries) of each POST route
_POSTS: list[tuple[str, str, type[BaseModel], str | None]] = [
    ("/v1/chat/completions", "Create chat completion", out.ChatCompletion, _CHUNKS),
    ("/v1/completions", "Create completion", out.Completion, _CHUNKS),
    ("/v1/responses", "Create response", out.Response, _RESPONSE_EVENTS),
    ("/tokenize", "Tokenize", out.TokenizeResponse, None),
    ("/detokenize", "Detokenize", out.DetokenizeResponse, None),
]
_LORA_NOTE = (
    "With `--enable-lora --allow-runtime-lora-updating` (403 otherwise); answers `text/plain` "
    "as vLLM does: `Success: LoRA adapter '<name>' added successfully.` (or `removed`)."
)
_LORA_POSTS = [
    ("/v1/load_lora_adapter", "Load LoRA adapter"),
    ("/v1/unload_lora_adapter", "Unload LoRA adapter"),
]
_TASK_PATHS = frozenset(path for _, path in TASKS)
_GENERATION = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
_ANTHROPIC_NOTE = (
    " Anthropic's Messages API: the `anthropic` client works unchanged (`x-api-key` or a bearer token), "
    "and errors have Anthropic's shape."
)
_GENERATION_ONLY = "Generation servers only; a pooling server (`--runner pooling`) answers 400."
_POOLING_ONLY = "Pooling servers only (`--runner pooling`); a generation server answers 400."
# The body model of every POST route, generation's and pooling's.
ALL_REQUEST_MODELS = {**REQUEST_MODELS, **POOLING_REQUEST_MODELS, **ANTHROPIC_REQUEST_MODELS}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def _errors(*codes: int, shape: type[BaseModel] = out.ErrorResponse) -> dict[str, Any]:
    return {str(c): {"description": "error", "content": {"application/json": {"schema": _ref(shape)}}} for c in codes}


def _ok(schema: dict[str, Any], stream: str | None = None, media: str = "application/json") -> dict[str, Any]:
    """``stream``: what the ``text/event-stream`` answer to ``"stream": true`` carries."""
    content: dict[str, Any] = {media: {"schema": schema}}
    if stream:
        content["text/event-stream"] = {"schema": {"type": "string"}, "description": stream}
    return {"200": {"description": "OK", "content": content}}


def _post(
    summary: str, body: type[BaseModel], ok: type[BaseModel], stream: str | None, note: str | None = None
) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            **({"description": note} if note else {}),
            "operationId": summary.lower().replace(" ", "_").replace("(", "").replace(")", ""),
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(body)}}},
            "responses": {**_ok(_ref(ok), stream), **_errors(400, 401, 404, 413, 415, 503)},
        }
    }


def _invocations() -> dict[str, Any]:
    """SageMaker's one route (server/invocations.py): the body of one of the routes below, the
    first whose fields it has, answered as that route answers."""
    bodies = [ALL_REQUEST_MODELS[path] for _, path in TASKS]
    answers: list[type[BaseModel]] = [out.ChatCompletion, out.Completion]
    answers += [ok for path, _, _, ok in POOLING_POSTS if path in _TASK_PATHS]
    tasks = "; ".join(" + ".join(f"`{f}`" for f in fields) + f": {path}" for fields, path in TASKS)
    return {
        "post": {
            "summary": "Invocations (SageMaker)",
            "description": f"The task is the first whose fields the body has: {tasks}. Else 400.",
            "operationId": "invocations",
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"anyOf": [_ref(m) for m in bodies]}}},
            },
            "responses": {
                **_ok({"anyOf": [_ref(m) for m in dict.fromkeys(answers)]}, _CHUNKS),
                **_errors(400, 401, 404, 413, 415, 503),
            },
        }
    }


def _get(
    summary: str,
    ok: dict[str, Any],
    media: str = "application/json",
    errors: tuple[int, ...] = (),
    params: tuple[str, ...] = (),
) -> dict[str, Any]:
    """``params``: the path's ``{name}`` parameters."""
    op: dict[str, Any] = {
        "summary": summary,
        "operationId": summary.lower().replace(" ", "_"),
        "responses": {**_ok(ok, media=media), **_errors(*errors)},
    }
    if params:
        op["parameters"] = [{"name": p, "in": "path", "required": True, "schema": _STR} for p in params]
    return {"get": op}


def _web_paths() -> dict[str, Any]:
    """The chat page (``--web-ui``) and its static files."""
    return {
        "/": _get("Chat page", _STR, media="text/html"),
        "/web/{path}": _get("Chat page files", _STR, media="application/octet-stream", errors=(404,), params=("path",)),
    }


def _open(schema: Any) -> None:
    """Drop ``additionalProperties: false`` everywhere: a lenient server ignores unknown fields."""
    if isinstance(schema, dict):
        if schema.get("additionalProperties") is False:
            del schema["additionalProperties"]
        for v in schema.values():
            _open(v)
    elif isinstance(schema, list):
        for v in schema:
            _open(v)


@functools.cache
def component_schemas(limits: Limits) -> dict[str, Any]:
    """Every request and answer model, nested ones lifted out of ``$defs``, by class name
    (cached per limits: the result is shared, never mutated)."""
    requests = [bounded(m, limits) for m in dict.fromkeys(ALL_REQUEST_MODELS.values())]
    answers: list[type[BaseModel]] = [
        out.ErrorResponse,
        AnthropicErrorResponse,
        *(ok for _, _, ok, _ in _POSTS),
        *(ok for _, _, _, ok, _ in ANTHROPIC_POSTS),
        *dict.fromkeys(ok for _, _, _, ok in POOLING_POSTS),
        out.TokenizerInfo,
        out.ModelList,
        out.ServerLoad,
        out.Status,
        out.Version,
    ]
    keyed: list[tuple[type[BaseModel], Any]] = [(m, "validation") for m in requests]
    keyed += [(m, "serialization") for m in answers]
    _, top = models_json_schema(keyed, ref_template=_REF)
    schemas: dict[str, Any] = dict(top.get("$defs", {}))
    if limits.lenient:
        _open(schemas)
    return schemas


def openapi_schema(limits: Limits, model_name: str, web_ui: bool = False) -> dict[str, Any]:
    paths: dict[str, Any] = {
        path: _post(summary, REQUEST_MODELS[path], ok, stream, _GENERATION_ONLY if path in _GENERATION else None)
        for path, summary, ok, stream in _POSTS
    }
    paths.update({path: _post(summary, body, ok, None, _POOLING_ONLY) for path, summary, body, ok in POOLING_POSTS})
    for path, summary in _LORA_POSTS:
        op = _post(summary, REQUEST_MODELS[path], out.Status, None, _LORA_NOTE)
        op["post"]["responses"]["200"] = {"description": "OK", "content": {"text/plain": {"schema": _STR}}}
        op["post"]["responses"].update(_errors(403))
        paths[path] = op
    for path, summary, body, ok, stream in ANTHROPIC_POSTS:
        op = _post(summary, body, ok, stream, _GENERATION_ONLY + _ANTHROPIC_NOTE)
        op["post"]["responses"].update(_errors(400, 401, 404, 413, 415, 503, shape=AnthropicErrorResponse))
        paths[path] = op
    paths["/invocations"] = _invocations()
    paths.update(
        {
            "/tokenizer_info": _get("Tokenizer info", _ref(out.TokenizerInfo), errors=(401,)),
            "/load": _get("Server load", _ref(out.ServerLoad)),
            "/v1/models": _get("List models", _ref(out.ModelList), errors=(401,)),
            "/v1/models/{model}": _get("Retrieve model", _ref(out.ModelCard), errors=(401, 404), params=("model",)),
            "/health": _get("Health", _ref(out.Status), errors=(503,)),
            "/ping": {
                **_get("Ping", _ref(out.Status), errors=(503,)),
                "post": _get("Ping (POST)", _ref(out.Status), errors=(503,))["get"],
            },
            "/version": _get("Version", _ref(out.Version)),
            "/metrics": _get("Prometheus metrics", {"type": "string"}, media="text/plain"),
            "/openapi.json": _get("OpenAPI document", {"type": "object"}),
            **(_web_paths() if web_ui else {}),
        }
    )
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "aiolm",
            "version": aiolm.__version__,
            "description": f"OpenAI-compatible API serving '{model_name}'.",
        },
        "paths": paths,
        "components": {
            "schemas": component_schemas(limits),
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
        },
        "security": [{"bearer": []}, {"x-api-key": []}],
    }
