"""POST /v1/chat/completions."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from aiolm.engine.client import EngineClient
from aiolm.params import OutputKind
from aiolm.server.errors import bad_request, json_response
from aiolm.server.generation import (
    Generation,
    Prompt,
    check_lengths,
    engine_error,
    tokenize,
    usage,
)
from aiolm.server.http import check_model, context, log_extra, read_json
from aiolm.server.logprobs import chat_logprobs, prompt_logprobs_json
from aiolm.server.protocol import (
    ChatCompletionRequest,
    StreamOptions,
    check_unsupported_chat,
    parse,
    sampling_params,
    structured_spec,
)
from aiolm.server.sse import EventStream, until_disconnect
from aiolm.server.tools import (
    StreamState,
    ToolPlan,
    call_deltas,
    check_continuation,
    plan_tools,
    read_output,
    render_chat_prompt,
    tool_calls_json,
)


async def create_chat_completion(request: Request) -> Response | EventStream:
    ctx = context(request)
    body = await read_json(request, ctx.settings.max_request_bytes)
    req = parse(ChatCompletionRequest, body, ctx.settings.limits)
    lora = check_model(ctx, req.model)
    check_unsupported_chat(req)
    structured, structured_param = structured_spec(req)
    plan = plan_tools(req, ctx.settings.tool_call_parser)
    if plan.enforced is not None:
        if structured is not None:
            raise bad_request(
                f"'{structured_param}' and 'tool_choice' both constrain the output; give one", param=structured_param
            )
        structured, structured_param = plan.enforced, "tools"
    check_continuation(req)
    engine = ctx.engine
    max_tokens: int | None
    if req.max_completion_tokens is not None:
        max_tokens, mt_param = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, mt_param = req.max_tokens, "max_tokens"
    top_n = req.top_logprobs or 0
    stream = req.stream
    params = sampling_params(
        req,
        max_tokens,
        top_n if req.logprobs else None,
        OutputKind.DELTA if stream else OutputKind.FINAL_ONLY,
        structured,
        req.prompt_logprobs,
        engine,
        rename={"max_tokens": mt_param},
    )
    text = await render_chat_prompt(engine, req, plan.tools)
    ids = await tokenize(engine, text, add_special_tokens=False, param="messages")
    check_lengths(ctx, len(ids), max_tokens, "messages", mt_param, req.min_tokens)
    rid = ctx.new_id("chatcmpl")
    gen = Generation(
        ctx,
        [Prompt(text, ids)],
        params,
        rid,
        req.priority,
        rename={"prompt": "messages", "max_tokens": mt_param, "structured_outputs": structured_param},
        lora_request=lora,
    )
    await gen.start(request.receive)
    log_extra(request, engine_request_id=rid, prompt_tokens=len(ids), n=req.n, stream=stream, user=req.user)
    model = lora.lora_name if lora is not None else ctx.model_name
    meta = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model}
    if stream:
        opts = req.stream_options or StreamOptions()
        chunk_meta = {**meta, "object": "chat.completion.chunk"}
        events = _chat_events(
            gen,
            chunk_meta,
            req.n,
            len(ids),
            opts.include_usage,
            top_n,
            engine,
            request,
            ids if req.return_token_ids else None,
            opts.continuous_usage_stats,
            plan,
            req.return_tokens_as_token_ids,
        )
        return EventStream(events, on_gone=lambda: log_extra(request, client_gone=True), close=gen.abort)
    (final,) = await until_disconnect(request.receive, gen.collect())
    choices = []
    completion_tokens = 0
    for c in final.outputs:
        completion_tokens += len(c.token_ids)
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        finish_reason = c.finish_reason
        if plan.active:
            content, calls = read_output(plan, c.text)
            message = {"role": "assistant", "content": content, "tool_calls": tool_calls_json(calls)}
            if calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        choices.append(
            {
                "index": c.index,
                "message": message,
                "logprobs": (
                    chat_logprobs(c.token_ids, c.logprobs, top_n, engine, req.return_tokens_as_token_ids)
                    if req.logprobs
                    else None
                ),
                "finish_reason": finish_reason,
                "stop_reason": c.stop_reason,
                "token_ids": list(c.token_ids) if req.return_token_ids else None,
            }
        )
    log_extra(request, completion_tokens=completion_tokens)
    return json_response(
        {
            **meta,
            "choices": choices,
            "usage": usage(len(ids), completion_tokens, final.num_cached_tokens),
            "system_fingerprint": None,
            "prompt_logprobs": prompt_logprobs_json(final.prompt_logprobs, ids, req.prompt_logprobs or 0),
            "prompt_token_ids": ids if req.return_token_ids else None,
        }
    )


async def _chat_events(
    gen: Generation,
    meta: dict[str, Any],
    n: int,
    prompt_tokens: int,
    include_usage: bool,
    top_n: int,
    tokenizer: EngineClient,
    request: Request,
    prompt_ids: list[int] | None = None,
    continuous: bool = False,
    plan: ToolPlan | None = None,
    as_ids: bool = False,
) -> AsyncIterator[dict[str, Any]]:
    """``prompt_ids`` (return_token_ids): in the first chunk, as vLLM sends them; each choice
    delta then carries its new ``token_ids``. ``as_ids``: logprob tokens spelt ``token_id:<id>``.
    With tools, content is shown until calls may begin; the calls follow once the choice
    finishes (aiolm/server/tools.py)."""
    want_logprobs = gen.params.logprobs is not None
    completion_tokens = cached_tokens = 0

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        out = {**meta, "choices": choices, "system_fingerprint": None}
        if include_usage:  # vLLM's continuous_usage_stats: the counts so far in every chunk
            out["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens) if continuous else None
        return out

    tool_states = {i: StreamState(plan) for i in range(n)} if plan is not None and plan.active else None
    for i in range(n):
        first = chunk(
            [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
        )
        if prompt_ids is not None and i == 0:
            first["prompt_token_ids"] = prompt_ids
        yield first
    try:
        async for _, out in gen.stream():
            cached_tokens = out.num_cached_tokens
            choices = []
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                lp = (
                    chat_logprobs(c.token_ids, c.logprobs, top_n, tokenizer, as_ids)
                    if want_logprobs and c.token_ids
                    else None
                )
                text, finish_reason = c.text, c.finish_reason
                tool_deltas: list[dict[str, Any]] = []
                if tool_states is not None:
                    state = tool_states[c.index]
                    text = state.feed(c.text)
                    if c.finished:
                        rest, calls = state.finish()
                        text += rest
                        tool_deltas = call_deltas(calls)
                        if calls and finish_reason == "stop":
                            finish_reason = "tool_calls"
                if tool_deltas:
                    if text:
                        yield chunk(
                            [{"index": c.index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}]
                        )
                        text = ""
                    for d in tool_deltas[:-1]:
                        yield chunk([{"index": c.index, "delta": d, "logprobs": None, "finish_reason": None}])
                if not text and not c.finished and lp is None and not (prompt_ids is not None and c.token_ids):
                    continue
                delta = tool_deltas[-1] if tool_deltas else ({"content": text} if text else {})
                choice: dict[str, Any] = {
                    "index": c.index,
                    "delta": delta,
                    "logprobs": lp,
                    "finish_reason": finish_reason,
                }
                if c.finished:
                    choice["stop_reason"] = c.stop_reason
                if prompt_ids is not None:
                    choice["token_ids"] = list(c.token_ids)
                choices.append(choice)
            for choice in choices:  # one choice per chunk, as OpenAI streams n > 1
                yield chunk([choice])
    except Exception as e:  # the stream has started: report in-band, as OpenAI does
        yield engine_error(e).body()
        return
    finally:  # also when the response is closed early: free the engine request now, not at GC
        await gen.abort()
    log_extra(request, completion_tokens=completion_tokens)
    if include_usage:
        final_usage = usage(prompt_tokens, completion_tokens, cached_tokens)
        yield {**meta, "choices": [], "system_fingerprint": None, "usage": final_usage}
