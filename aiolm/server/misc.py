"""The small endpoints: models, health, version, tokenize/detokenize, tokenizer info, load, metrics."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

import aiolm
from aiolm.metrics import CONTENT_TYPE
from aiolm.params import ParamError
from aiolm.server.errors import APIError, bad_request, json_response
from aiolm.server.generation import tokenize as encode
from aiolm.server.http import check_model, context, read_json
from aiolm.server.protocol import DetokenizeRequest, TokenizeRequest, param_error, parse
from aiolm.server.tools import template_messages


def _model_card(request: Request) -> dict:
    ctx = context(request)
    engine = ctx.engine
    return {
        "id": ctx.model_name,
        "object": "model",
        "created": ctx.created,
        "owned_by": "aiolm",
        "root": ctx.model_name,
        "parent": None,
        "max_model_len": engine.max_model_len,
    }


async def list_models(request: Request) -> Response:
    return json_response({"object": "list", "data": [_model_card(request)]})


async def get_model(request: Request) -> Response:
    ctx = context(request)
    name = request.path_params["model"]
    if name != ctx.model_name:
        raise APIError(404, f"The model '{name}' does not exist.", param="model", code="model_not_found")
    return json_response(_model_card(request))


async def health(request: Request) -> Response:
    engine = context(request).engine
    if engine.is_healthy():
        return json_response({"status": "ok"})
    recovering = engine.recovering
    if recovering is not None:
        return APIError(
            503,
            f"unhealthy: recovering from a worker failure: {recovering}",
            code="recovering",
            type="server_error",
            headers={"retry-after": "5"},
        ).response()
    stalled = engine.stalled
    if stalled is not None:
        return APIError(503, f"unhealthy: stalled: {stalled}", code="stalled", type="server_error").response()
    reason = engine.dead_reason or "the engine is not running"
    return APIError(503, f"unhealthy: {reason}", code="engine_dead", type="server_error").response()


async def version(request: Request) -> Response:
    return json_response({"version": aiolm.__version__})


async def metrics(request: Request) -> Response:
    """The engine's own registry (aiolm/metrics.py): the same series an embedding app exposes;
    with data parallelism, one series per replica (label ``engine``) and the routing lines."""
    engine = context(request).engine
    expert_load = getattr(engine, "expert_load", None)  # a mixture of experts' routing counts, fetched fresh
    if expert_load is not None:
        await expert_load()
    text = engine.metrics.render()
    per_replica = getattr(engine, "render_replica_metrics", None)  # engine/data_parallel.py
    if per_replica is not None:
        text += per_replica().encode()
    return Response(text, media_type=CONTENT_TYPE)


async def tokenize(request: Request) -> Response:
    ctx = context(request)
    req = parse(TokenizeRequest, await read_json(request, ctx.settings.max_request_bytes), ctx.settings.limits)
    check_model(ctx, req.model)
    engine = ctx.engine
    if req.messages is not None:
        if req.prompt is not None:
            raise bad_request("give exactly one of 'prompt' or 'messages'", param="prompt")
        msgs = template_messages(req.messages)
        try:
            text = await engine.render_chat_async(msgs, add_generation_prompt=req.add_generation_prompt)
        except ParamError as e:
            raise param_error(e) from None
        ids = await encode(engine, text, False)
    elif req.prompt is not None:
        ids = await encode(engine, req.prompt, req.add_special_tokens)
    else:
        raise bad_request("give exactly one of 'prompt' or 'messages'", param="prompt")
    strs = engine.token_strings(ids) if req.return_token_strs else None  # vLLM's: null unless asked
    return json_response({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": strs})


async def detokenize(request: Request) -> Response:
    ctx = context(request)
    req = parse(DetokenizeRequest, await read_json(request, ctx.settings.max_request_bytes), ctx.settings.limits)
    check_model(ctx, req.model)
    vocab = ctx.engine.vocab_size
    for i, t in enumerate(req.tokens):
        if t >= vocab:
            raise bad_request(f"token id {t} is outside the vocabulary [0, {vocab})", param=f"tokens[{i}]")
    return json_response({"prompt": ctx.engine.decode(req.tokens)})


async def tokenizer_info(request: Request) -> Response:
    """vLLM's GET /tokenizer_info, plus the context length the server enforces (``max_model_len``:
    the tokenizer's ``model_max_length`` is often a placeholder)."""
    engine = context(request).engine
    return json_response({**engine.tokenizer_info(), "max_model_len": engine.max_model_len})


async def load(request: Request) -> Response:
    """vLLM's GET /load: generation requests being served now, for a load balancer to read."""
    return json_response({"server_load": context(request).server_load})
