"""The small endpoints: models, health, version, tokenize/detokenize, tokenizer info, load, metrics."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

import aiolm
from aiolm.lora.request import LoRARequest
from aiolm.metrics import CONTENT_TYPE
from aiolm.params import ParamError
from aiolm.server.errors import APIError, bad_request, clip, json_response
from aiolm.server.generation import tokenize as encode
from aiolm.server.http import check_model, context, read_json
from aiolm.server.protocol import (
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    param_error,
    parse,
)
from aiolm.server.tools import check_continuation, checked_tools, image_urls, render_chat_prompt


def _model_card(request: Request, lora: LoRARequest | None = None) -> dict:
    """The base model's card, or a LoRA adapter's (``parent``: the base model, as vLLM's)."""
    ctx = context(request)
    engine = ctx.engine
    return {
        "id": ctx.model_name if lora is None else lora.lora_name,
        "object": "model",
        "created": ctx.created,
        "owned_by": "aiolm",
        "root": ctx.model_name if lora is None else lora.lora_path,
        "parent": None if lora is None else ctx.model_name,
        "max_model_len": engine.max_model_len,
    }


async def list_models(request: Request) -> Response:
    adapters = context(request).engine.list_loras()
    cards = [_model_card(request), *(_model_card(request, a) for a in adapters)]
    return json_response({"object": "list", "data": cards})


async def get_model(request: Request) -> Response:
    ctx = context(request)
    name = request.path_params["model"]
    lora = ctx.engine.lora(name) if name != ctx.model_name else None
    if name != ctx.model_name and lora is None:
        raise APIError(404, f"The model '{clip(name)}' does not exist.", param="model", code="model_not_found")
    return json_response(_model_card(request, lora))


def _runtime_lora(request: Request) -> None:
    if not context(request).settings.allow_runtime_lora_updating:
        raise APIError(
            403,
            "loading and unloading LoRA adapters at run time is off on this server "
            "(start it with --enable-lora --allow-runtime-lora-updating)",
            code="lora_updating_disabled",
            type="permission_error",
        )


async def load_lora_adapter(request: Request) -> Response:
    """vLLM's POST /v1/load_lora_adapter: the folder is checked before the name is served."""
    ctx = context(request)
    _runtime_lora(request)
    req = parse(LoadLoRAAdapterRequest, await read_json(request, ctx.settings.max_request_bytes), ctx.settings.limits)
    try:
        await ctx.engine.load_lora(req.lora_name, req.lora_path, req.load_inplace)
    except ParamError as e:
        raise param_error(e) from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    """vLLM's POST /v1/unload_lora_adapter: new requests naming it get a 404; those already
    in finish with it."""
    ctx = context(request)
    _runtime_lora(request)
    req = parse(UnloadLoRAAdapterRequest, await read_json(request, ctx.settings.max_request_bytes), ctx.settings.limits)
    lora = ctx.engine.lora(req.lora_name)
    if lora is None:
        raise APIError(
            404, f"no LoRA adapter named '{req.lora_name}' is loaded", param="lora_name", code="lora_not_found"
        )
    if req.lora_int_id is not None and req.lora_int_id != lora.lora_int_id:
        raise bad_request(
            f"adapter '{req.lora_name}' has id {lora.lora_int_id}, not {req.lora_int_id}", param="lora_int_id"
        )
    await ctx.engine.remove_lora(req.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


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
    refresh = getattr(engine, "refresh_metrics", None)  # data-parallel replicas' families, fetched fresh
    if refresh is not None:
        await refresh()
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
        check_continuation(req)
        urls = image_urls(req.messages)
        if urls and not engine.takes_images:
            raise bad_request("this model takes no images: send text content only", param=urls[0][1])
        text = await render_chat_prompt(engine, req, checked_tools(req.tools)[1] if req.tools else None)
        if urls:  # the ids a chat completion would run: each image's placeholders expanded
            try:
                ids = (await engine.prompt_with_images(text, urls, "messages"))["prompt_token_ids"]
            except ParamError as e:
                raise param_error(e) from None
        else:  # vLLM's default for messages: the template writes the special tokens itself
            ids = await encode(engine, text, req.add_special_tokens and "add_special_tokens" in req.model_fields_set)
    elif req.prompt is not None:
        for name in ("tools", "continue_final_message"):
            if getattr(req, name):
                raise bad_request(f"'{name}' applies to 'messages', not to 'prompt'", param=name)
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
