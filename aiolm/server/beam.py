"""vLLM's ``use_beam_search`` on /v1/completions and /v1/chat/completions.

``n`` is the beam width and the choices are the n best beams, best first
(aiolm/engine/beam_search.py runs the search). As in vLLM v1 the beams exist only once
the search is over, so a stream sends them then: one chunk per choice with its whole
text and finish reason (after chat's role chunks), then the usage chunk if asked.
Usage counts the prompts and every token of every returned choice.

The search honours ``n``, ``max_tokens``, ``length_penalty``, ``temperature`` (it picks
the one sampled candidate each step adds to the top 2n), ``ignore_eos``, ``stop_token_ids``,
``include_stop_str_in_output``, ``skip_special_tokens``; ``early_stopping`` is accepted
and, as in vLLM v1, has no effect. A field that would change how tokens are sampled or
reported per token (penalties, logprobs, structured outputs, stop strings...) is a 400
naming it, never dropped in silence.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from aiolm.engine.beam_search import BeamSearchOutput, beam_search
from aiolm.lora.request import LoRARequest
from aiolm.params import BeamSearchParams, ParamError
from aiolm.server.context import ServingContext
from aiolm.server.errors import bad_request, json_response
from aiolm.server.generation import Prompt, check_admission, engine_error, usage
from aiolm.server.http import log_extra
from aiolm.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    StreamOptions,
    param_error,
    with_model_defaults,
)
from aiolm.server.sse import EventStream, until_disconnect

# A field with another value than this changes sampling or per-token output, which a beam
# search does not do: (field, the value that means "not asked").
_SAMPLING_ONLY: tuple[tuple[str, Any], ...] = (
    ("top_p", 1.0),
    ("min_p", 0.0),
    ("seed", None),
    ("presence_penalty", 0.0),
    ("frequency_penalty", 0.0),
    ("repetition_penalty", 1.0),
    ("logit_bias", None),
    ("min_tokens", 0),
    ("allowed_token_ids", None),
    ("bad_words", None),
    ("prompt_logprobs", None),
    ("spaces_between_special_tokens", True),
    ("best_of", None),
    ("top_logprobs", None),
)

# (message text of a choice) -> (the assistant message, its tool calls): chat's reading
MessageOf = Callable[[str], tuple[dict[str, Any], Sequence[Any]]]


def _refuse(field: str, why: str = "") -> None:
    raise bad_request(f"'{field}' does not combine with 'use_beam_search'{why}", param=field)


def check_beam_request(req: SamplingRequest, structured_param: str | None) -> None:
    """A 400 naming the first field a beam search cannot honour."""
    for field, unset in _SAMPLING_ONLY:
        if getattr(req, field, unset) != unset:
            _refuse(field)
    if req.top_k not in (0, -1):
        _refuse("top_k")
    if req.stop:
        _refuse("stop", ": beams end on tokens only; give 'stop_token_ids'")
    logprobs = getattr(req, "logprobs", None)
    if logprobs is not None and logprobs is not False:
        _refuse("logprobs")
    if structured_param is not None:
        _refuse(structured_param, ": structured outputs constrain sampling, which beam search does not do")


def _params(ctx: ServingContext, req: SamplingRequest, max_tokens: int | None, num_prompts: int) -> BeamSearchParams:
    n = req.n
    limit = ctx.settings.limits.max_logprobs
    if limit >= 0 and 2 * n > limit:  # -1: no bound
        raise bad_request(
            f"'n' is the beam width: beam search asks each step for 2 * n = {2 * n} logprobs, more "
            f"than this server's --max-logprobs ({limit}) allows; use n <= {limit // 2}",
            param="n",
        )
    check_admission(ctx, num_prompts, n, req.priority)
    try:
        return BeamSearchParams(
            beam_width=n,
            max_tokens=max_tokens if max_tokens is not None else ctx.engine.max_model_len,
            ignore_eos=req.ignore_eos,
            temperature=with_model_defaults(req, ctx.engine, ("temperature",))["temperature"],
            length_penalty=req.length_penalty,
            include_stop_str_in_output=req.include_stop_str_in_output,
            stop_token_ids=list(req.stop_token_ids or []),
            skip_special_tokens=req.skip_special_tokens,
        )
    except ParamError as e:
        raise param_error(e, {"beam_width": "n"}) from None


async def _search(
    ctx: ServingContext,
    prompts: list[Prompt],
    params: BeamSearchParams,
    rid: str,
    priority: int,
    lora: LoRARequest | None,
    rename: dict[str, str],
    cache_salt: str | None,
) -> list[BeamSearchOutput]:
    """Every prompt's search at once (their steps share batches). The HTTP request counts in
    the server's load, and its step requests in the in-flight set a shutdown drains."""
    ctx.server_load += 1
    ctx.inflight.add(rid)
    timeout = ctx.settings.request_timeout or None
    tasks = [
        asyncio.ensure_future(
            beam_search(
                ctx.engine,
                {"prompt_token_ids": p.token_ids, "prompt": p.text, "cache_salt": cache_salt},
                params,
                request_id=rid if len(prompts) == 1 else f"{rid}-{i}",
                priority=priority,
                timeout=timeout,
                lora_request=lora,
                live=ctx.inflight,
            )
        )
        for i, p in enumerate(prompts)
    ]
    try:
        return list(await asyncio.gather(*tasks))
    except Exception as e:
        raise engine_error(e, {"beam_width": "n", **rename}) from None
    finally:  # one failed, or the client left: the others stop too
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        ctx.inflight.discard(rid)
        ctx.server_load -= 1


def _tokens_used(results: list[BeamSearchOutput]) -> tuple[int, int, int]:
    """(prompt, completion, cached) tokens: each prompt once, every returned beam's tokens."""
    prompt = sum(len(r.prompt_token_ids) for r in results)
    completion = sum(len(s.token_ids) for r in results for s in r.sequences)
    return prompt, completion, sum(r.num_cached_tokens for r in results)


def _usage_chunk(meta: dict[str, Any], results: list[BeamSearchOutput]) -> dict[str, Any]:
    return {**meta, "choices": [], "system_fingerprint": None, "usage": usage(*_tokens_used(results))}


async def _respond(
    request: Request,
    stream: bool,
    opts: StreamOptions | None,
    run: Callable[[], Awaitable[list[BeamSearchOutput]]],
    chunks: Callable[[list[BeamSearchOutput]], list[dict[str, Any]]],
    body: Callable[[list[BeamSearchOutput]], dict[str, Any]],
    first: list[dict[str, Any]],
    meta: dict[str, Any],
) -> Response | EventStream:
    """The JSON body once the search is over, or a stream: ``first`` now, ``chunks`` then."""
    if not stream:
        results = await until_disconnect(request.receive, run())
        log_extra(request, completion_tokens=_tokens_used(results)[1])
        return json_response(body(results))
    include_usage = (opts or StreamOptions()).include_usage

    async def events() -> AsyncGenerator[dict[str, Any], None]:
        task = asyncio.ensure_future(run())
        try:
            for chunk in first:
                yield chunk
            try:
                results = await task
            except Exception as e:  # the stream has started: report in-band
                yield engine_error(e).body()
                return
            for chunk in chunks(results):
                yield chunk
            log_extra(request, completion_tokens=_tokens_used(results)[1])
            if include_usage:
                yield _usage_chunk(meta, results)
        finally:  # the client left: the search stops and aborts its step
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    gen = events()
    return EventStream(gen, on_gone=lambda: log_extra(request, client_gone=True), close=gen.aclose)


async def completion(
    request: Request,
    ctx: ServingContext,
    req: CompletionRequest,
    prompts: list[Prompt],
    lora: LoRARequest | None,
    structured_param: str | None,
) -> Response | EventStream:
    """/v1/completions with ``use_beam_search``: choice ``prompt_index * n + i`` is the
    prompt's i-th best beam."""
    check_beam_request(req, structured_param)
    params = _params(ctx, req, req.max_tokens, len(prompts))
    rid = ctx.new_id("cmpl")
    n, ids = req.n, req.return_token_ids
    model = lora.lora_name if lora is not None else ctx.model_name
    meta = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model}
    log_extra(request, engine_request_id=rid, n=n, prompts=len(prompts), stream=req.stream, beam_search=True)

    def run() -> Awaitable[list[BeamSearchOutput]]:
        return _search(ctx, prompts, params, rid, req.priority, lora, {}, req.cache_salt)

    def choices(results: list[BeamSearchOutput]) -> list[dict[str, Any]]:
        out = []
        for pi, (p, r) in enumerate(zip(prompts, results)):
            echo = (p.text or "") if req.echo else ""
            for i, s in enumerate(r.sequences):
                out.append(
                    {
                        "index": pi * n + i,
                        "text": echo + s.text,
                        "logprobs": None,
                        "finish_reason": s.finish_reason,
                        "stop_reason": s.stop_reason,
                        "prompt_logprobs": None,
                        "prompt_token_ids": p.token_ids if ids else None,
                        "token_ids": s.token_ids if ids else None,
                    }
                )
        return out

    def body(results: list[BeamSearchOutput]) -> dict[str, Any]:
        return {**meta, "choices": choices(results), "usage": usage(*_tokens_used(results)), "system_fingerprint": None}

    def chunks(results: list[BeamSearchOutput]) -> list[dict[str, Any]]:
        out = []
        for c in choices(results):  # one choice per chunk, as OpenAI streams n > 1
            del c["prompt_logprobs"]
            if not ids:
                del c["prompt_token_ids"], c["token_ids"]
            out.append({**meta, "choices": [c], "system_fingerprint": None, **_null_usage(req)})
        return out

    return await _respond(request, req.stream, req.stream_options, run, chunks, body, [], meta)


def _null_usage(req: SamplingRequest) -> dict[str, Any]:
    opts = req.stream_options
    return {"usage": None} if opts is not None and opts.include_usage else {}


async def chat_completion(
    request: Request,
    ctx: ServingContext,
    req: ChatCompletionRequest,
    turns: Sequence[tuple[Prompt, MessageOf, str]],
    max_tokens: int | None,
    mt_param: str,
    lora: LoRARequest | None,
    structured_param: str | None,
    prompt_token_ids: Any,
) -> Response | EventStream:
    """/v1/chat/completions with ``use_beam_search``. ``turns``: per conversation its prompt,
    how a choice's text becomes the assistant message (thinking, tool calls) and the text it
    echoes; ``prompt_token_ids``: the response's (return_token_ids)."""
    check_beam_request(req, structured_param)
    params = _params(ctx, req, max_tokens, len(turns))
    rid = ctx.new_id("chatcmpl")
    n = req.n
    model = lora.lora_name if lora is not None else ctx.model_name
    meta = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model}
    chunk_meta = {**meta, "object": "chat.completion.chunk"}
    log_extra(request, engine_request_id=rid, n=n, stream=req.stream, beam_search=True)

    def run() -> Awaitable[list[BeamSearchOutput]]:
        return _search(
            ctx, [t[0] for t in turns], params, rid, req.priority, lora, {"max_tokens": mt_param}, req.cache_salt
        )

    def choices(results: list[BeamSearchOutput]) -> list[dict[str, Any]]:
        out = []
        for k, ((_, message_of, echo), r) in enumerate(zip(turns, results)):
            for i, s in enumerate(r.sequences):
                message, calls = message_of(s.text)
                if echo:
                    message["content"] = echo + (message["content"] or "")
                finish = "tool_calls" if calls and s.finish_reason == "stop" else s.finish_reason
                out.append(
                    {
                        "index": k * n + i,
                        "message": message,
                        "logprobs": None,
                        "finish_reason": finish,
                        "stop_reason": s.stop_reason,
                        "token_ids": s.token_ids if req.return_token_ids else None,
                    }
                )
        return out

    def body(results: list[BeamSearchOutput]) -> dict[str, Any]:
        return {
            **meta,
            "choices": choices(results),
            "usage": usage(*_tokens_used(results)),
            "system_fingerprint": None,
            "prompt_logprobs": None,
            "prompt_token_ids": prompt_token_ids,
        }

    def chunks(results: list[BeamSearchOutput]) -> list[dict[str, Any]]:
        out = []
        for c in choices(results):
            delta = {k: v for k, v in c.pop("message").items() if k != "role" and v not in (None, [])}
            if "tool_calls" in delta:  # a streamed call carries its place in the list
                delta["tool_calls"] = [{"index": j, **call} for j, call in enumerate(delta["tool_calls"])]
            ids = c.pop("token_ids")
            choice = {**c, "delta": delta, **({"token_ids": ids} if req.return_token_ids else {})}
            out.append({**chunk_meta, "choices": [choice], "system_fingerprint": None, **_null_usage(req)})
        return out

    first = []
    for i in range(len(turns) * n):  # the role first, as a sampled stream sends it
        role = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        chunk = {**chunk_meta, "choices": [role], "system_fingerprint": None, **_null_usage(req)}
        if i == 0 and req.return_token_ids:
            chunk["prompt_token_ids"] = prompt_token_ids
        first.append(chunk)
    return await _respond(request, req.stream, req.stream_options, run, chunks, body, first, chunk_meta)
