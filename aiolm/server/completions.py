"""POST /v1/completions: one or many prompts (text or token ids), each with ``n`` choices.

Choice indexes run prompt-major (``prompt_index * n + i``), like OpenAI.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from aiolm.engine.client import EngineClient
from aiolm.outputs import CompletionOutput
from aiolm.params import OutputKind
from aiolm.server import beam
from aiolm.server.context import ServingContext
from aiolm.server.errors import bad_request, json_response
from aiolm.server.generation import (
    Generation,
    Prompt,
    Truncation,
    check_lengths,
    engine_error,
    tokenize,
    truncation,
    usage,
)
from aiolm.server.http import check_model, context, log_extra, off_loop_if_big, read_json
from aiolm.server.logprobs import CompletionLogprobs, merge, prompt_logprobs_json
from aiolm.server.protocol import (
    CompletionRequest,
    StreamOptions,
    check_unsupported_completion,
    parse,
    sampling_params,
    structured_spec,
)
from aiolm.server.sse import EventStream, until_disconnect


def _prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """Normalize OpenAI's four prompt shapes to a list of strings or token-id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)  # type: ignore[arg-type]


async def _prepare(
    ctx: ServingContext,
    raw: list[str | list[int]],
    add_special: bool,
    max_tokens: int | None,
    min_tokens: int,
    cut: Truncation | None,
) -> list[Prompt]:
    prompts = []
    for i, p in enumerate(raw):
        param = "prompt" if len(raw) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            ids = await tokenize(ctx.engine, p, add_special, param, cut) if p else []
            # a cut prompt's text is its kept tokens' (decoded where needed: echo)
            prompt = Prompt(p if cut is None or len(ids) < cut.keep else None, ids)
        else:
            vocab = ctx.engine.vocab_size
            bad = next((t for t in p if t >= vocab), None)
            if bad is not None:
                raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", param=param)
            prompt = Prompt(None, list(p) if cut is None else cut.cut(list(p)))
        check_lengths(ctx, len(prompt.token_ids), max_tokens, param, "max_tokens", min_tokens)
        prompts.append(prompt)
    return prompts


async def create_completion(request: Request) -> Response | EventStream:
    ctx = context(request)
    body = await read_json(request, ctx.settings.max_request_bytes)
    req = await off_loop_if_big(request, parse, CompletionRequest, body, ctx.settings.limits)
    lora = check_model(ctx, req.model)
    check_unsupported_completion(req)
    if req.logprob_token_ids is not None and req.logprobs is None:  # the named tokens' columns, as logprobs: 0
        req = req.model_copy(update={"logprobs": 0})
    structured, structured_param = await off_loop_if_big(request, structured_spec, req)
    stream = req.stream
    # echo with max_tokens 0 scores the prompt alone (vLLM's echo without generation): one token
    # is generated, as the engine needs, and not returned
    echo_only = req.echo and req.max_tokens == 0
    if echo_only:
        if req.use_beam_search:
            raise bad_request(
                "'max_tokens' 0 (the echo alone) is not available with 'use_beam_search'", param="max_tokens"
            )
        req = req.model_copy(update={"max_tokens": 1})
    # Echoed prompt tokens get real logprobs: the engine scores the prompt too (as vLLM does).
    scored = req.prompt_logprobs
    if req.echo and req.logprobs is not None:
        scored = req.logprobs if scored is None else -1 if -1 in (scored, req.logprobs) else max(scored, req.logprobs)
    params = sampling_params(
        req,
        req.max_tokens,
        req.logprobs,
        OutputKind.DELTA if stream else OutputKind.FINAL_ONLY,
        structured,
        scored,
        ctx.engine,
    )
    cut = truncation(ctx.engine, req.truncate_prompt_tokens, req.truncation_side)
    raw = _prompt_list(req.prompt)
    prompts = await _prepare(ctx, raw, req.add_special_tokens, req.max_tokens, req.min_tokens, cut)
    tok = ctx.engine  # decodes token ids for echo and logprobs
    for p in prompts:  # echo needs the text of token-id prompts
        if p.text is None and req.echo:
            p.text = tok.decode(p.token_ids)
    if req.use_beam_search:  # the n best beams as the choices (aiolm/server/beam.py)
        return await beam.completion(request, ctx, req, prompts, lora, structured_param if structured else None)
    rid = ctx.new_id("cmpl")
    rename = {"structured_outputs": structured_param}
    gen = Generation(ctx, prompts, params, rid, req.priority, rename, lora_request=lora, cache_salt=req.cache_salt)
    await gen.start(request.receive)
    n = req.n
    log_extra(
        request,
        engine_request_id=rid,
        prompt_tokens=sum(len(p.token_ids) for p in prompts),
        n=n,
        prompts=len(prompts),
        stream=stream,
        user=req.user,
    )
    model = lora.lora_name if lora is not None else ctx.model_name
    meta = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model}
    if stream:
        opts = req.stream_options or StreamOptions()
        events = _events(
            gen, meta, prompts, req, opts.include_usage, tok, request, opts.continuous_usage_stats, echo_only
        )
        return EventStream(events, on_gone=lambda: log_extra(request, client_gone=True), close=gen.abort)
    finals = await until_disconnect(request.receive, gen.collect())
    choices = []
    completion_tokens = 0
    for pi, (prompt, final) in enumerate(zip(prompts, finals)):
        for c in final.outputs:
            if echo_only:
                c = _nothing_generated(c)
            completion_tokens += len(c.token_ids)
            echo = (prompt.text or "") if req.echo else ""
            lp = None
            if req.logprobs is not None:
                b = CompletionLogprobs(
                    req.logprobs, tok, as_ids=req.return_tokens_as_token_ids, named=req.logprob_token_ids
                )
                echoed = b.prompt(prompt.token_ids, final.prompt_logprobs) if req.echo else None
                lp = merge(echoed, b.generated(c.token_ids, c.logprobs or []))
            ids = req.return_token_ids
            choices.append(
                {
                    "index": pi * n + c.index,
                    "text": echo + c.text,
                    "logprobs": lp,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                    "prompt_logprobs": (
                        prompt_logprobs_json(final.prompt_logprobs, prompt.token_ids, req.prompt_logprobs)
                        if req.prompt_logprobs is not None
                        else None
                    ),
                    "prompt_token_ids": prompt.token_ids if ids else None,
                    "token_ids": list(c.token_ids) if ids else None,
                }
            )
    log_extra(request, completion_tokens=completion_tokens)
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    cached_tokens = sum(f.num_cached_tokens for f in finals)
    return json_response(
        {
            **meta,
            "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
            "system_fingerprint": None,
            "kv_transfer_params": finals[0].kv_transfer_params,
        }
    )


def _nothing_generated(c: CompletionOutput) -> CompletionOutput:
    """An output of echo with max_tokens 0: its one generated token left out."""
    finish = "length" if c.finish_reason == "stop" else c.finish_reason  # (its token was EOS: none shown)
    return dataclasses.replace(
        c, text="", token_ids=[], logprobs=None if c.logprobs is None else [], finish_reason=finish, stop_reason=None
    )


async def _events(
    gen: Generation,
    meta: dict[str, Any],
    prompts: list[Prompt],
    req: CompletionRequest,
    include_usage: bool,
    tok: EngineClient,
    request: Request,
    continuous: bool = False,
    echo_only: bool = False,
) -> AsyncIterator[dict[str, Any]]:
    n, top_n, ids = req.n, req.logprobs, req.return_token_ids
    sent_prompt: set[int] = set()

    def with_ids(choice: dict[str, Any], pi: int, token_ids: list[int]) -> dict[str, Any]:
        """vLLM's streaming shape: the prompt's ids in a choice's first chunk, then each chunk's ids."""
        if ids:
            first = choice["index"] not in sent_prompt
            sent_prompt.add(choice["index"])
            choice["prompt_token_ids"] = prompts[pi].token_ids if first else None
            choice["token_ids"] = token_ids
        return choice

    completion_tokens = 0
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    cached_of: dict[int, int] = {}  # prompt index -> its cached tokens, once known

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        out = {**meta, "choices": choices, "system_fingerprint": None}
        if include_usage:  # vLLM's continuous_usage_stats: the counts so far in every chunk
            known = sum(cached_of.values()) if len(cached_of) == len(prompts) else None  # every prompt's, or none
            out["usage"] = usage(prompt_tokens, completion_tokens, known) if continuous else None
        return out

    builders: dict[int, CompletionLogprobs] = {}
    if top_n is not None:
        as_ids = req.return_tokens_as_token_ids
        builders = {
            pi * n + i: CompletionLogprobs(top_n, tok, as_ids=as_ids, named=req.logprob_token_ids)
            for pi in range(len(prompts))
            for i in range(n)
        }
    echo_pending = set(range(len(prompts))) if req.echo else set()

    def echo(pi: int, plp: Any) -> list[dict[str, Any]]:
        """A prompt's echo, sent with its first output: that output carries its prompt logprobs."""
        echo_pending.discard(pi)
        p = prompts[pi]
        return [
            chunk(
                [
                    with_ids(
                        {
                            "index": pi * n + i,
                            "text": p.text or "",
                            "logprobs": builders[pi * n + i].prompt(p.token_ids, plp) if top_n is not None else None,
                            "finish_reason": None,
                        },
                        pi,
                        [],
                    )
                ]
            )
            for i in range(n)
        ]

    try:
        async for pi, out in gen.stream():
            cached_of[pi] = out.num_cached_tokens
            if pi in echo_pending:
                for echoed in echo(pi, out.prompt_logprobs):
                    yield echoed
            choices = []
            for c in out.outputs:
                if echo_only:
                    c = _nothing_generated(c)
                completion_tokens += len(c.token_ids)
                idx = pi * n + c.index
                lp = builders[idx].generated(c.token_ids, c.logprobs or []) if top_n is not None else None
                if not c.text and not c.finished and not c.token_ids:
                    continue
                choice = {"index": idx, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason}
                if c.finished:
                    choice["stop_reason"] = c.stop_reason
                choices.append(with_ids(choice, pi, list(c.token_ids)))
            for choice in choices:  # one choice per chunk, as OpenAI streams n > 1
                yield chunk([choice])
    except Exception as e:  # the stream has started: report in-band
        yield engine_error(e).body()
        return
    finally:  # also when the response is closed early: free the engine request now, not at GC
        await gen.abort()
    log_extra(request, completion_tokens=completion_tokens)
    if include_usage:
        final_usage = usage(prompt_tokens, completion_tokens, sum(cached_of.values()))
        yield {**meta, "choices": [], "system_fingerprint": None, "usage": final_usage}
