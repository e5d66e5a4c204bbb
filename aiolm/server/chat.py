"""POST /v1/chat/completions."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from aiolm.engine.client import EngineClient
from aiolm.params import OutputKind, ParamError, SamplingParams
from aiolm.server import beam
from aiolm.server.errors import bad_request, json_response
from aiolm.server.generation import (
    Generation,
    Prompt,
    check_lengths,
    engine_error,
    tokenize,
    truncation,
    usage,
)
from aiolm.server.http import check_model, context, log_extra, off_loop_if_big, read_json
from aiolm.server.logprobs import chat_logprobs, prompt_logprobs_json
from aiolm.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    StreamOptions,
    check_unsupported_chat,
    param_error,
    parse,
    sampling_params,
    structured_spec,
)
from aiolm.server.reasoning import ReasoningFormat, ReasoningSplitter, reasoning_format, split_reasoning
from aiolm.server.sse import EventStream, until_disconnect
from aiolm.server.tool_parsers import ParsedCall
from aiolm.server.tools import (
    CallDeltas,
    StreamState,
    ToolPlan,
    check_continuation,
    image_urls,
    message_text,
    plan_tools,
    read_output,
    render_chat_prompt,
    tool_calls_json,
    was_cut,
)


async def create_chat_completion(request: Request) -> Response | EventStream:
    ctx = context(request)
    body = await read_json(request, ctx.settings.max_request_bytes)
    req = await off_loop_if_big(request, parse, ChatCompletionRequest, body, ctx.settings.limits)
    lora = check_model(ctx, req.model)
    check_unsupported_chat(req)
    structured, structured_param = await off_loop_if_big(request, structured_spec, req)
    plan = await off_loop_if_big(request, plan_tools, req, ctx.settings.tool_call_parser)
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
    if req.batched and req.prompt_logprobs is not None:
        raise bad_request("'prompt_logprobs' is not available with a batch of conversations", param="prompt_logprobs")
    thinking = reasoning_format(ctx.settings.reasoning_parser)
    if thinking is None and req.thinking_token_budget not in (None, -1):
        raise bad_request(
            "'thinking_token_budget' needs the server started with --reasoning-parser", param="thinking_token_budget"
        )
    turns = []
    cut = truncation(engine, req.truncate_prompt_tokens, req.truncation_side)
    for k, conv in enumerate(req.conversations):
        where = f"messages[{k}]" if req.batched else "messages"
        urls = image_urls(conv, where)
        if urls and cut is not None:  # cutting tokens could split an image's placeholders
            raise bad_request("'truncate_prompt_tokens' does not take images", param="truncate_prompt_tokens")
        if urls and not engine.takes_images:
            raise bad_request("this model takes no images: send text content only", param=urls[0][1])
        text = await render_chat_prompt(engine, req, plan.tools, conv, where)
        images: list[Any] = []
        if urls:
            try:
                given = await engine.prompt_with_images(text, urls, where)
            except ParamError as e:
                raise param_error(e) from None
            ids, images = given["prompt_token_ids"], given["mm_inputs"]
        else:
            ids = await tokenize(engine, text, add_special_tokens=req.add_special_tokens, param=where, cut=cut)
        check_lengths(ctx, len(ids), max_tokens, where, mt_param, req.min_tokens)
        own = None
        continued = _continued(req, conv)
        splitter = ReasoningSplitter(thinking, text, continued) if thinking is not None else None
        if splitter is not None:
            own = bound_after_thinking(engine, splitter, params)
            budget = req.thinking_token_budget
            own = with_thinking_budget(engine, splitter, own or params, budget, "thinking_token_budget") or own
        reading = _Reading(plan, thinking, text, req.include_reasoning, continued)
        turns.append(_Turn(Prompt(text, ids, own, images), reading, _echoed(req, conv)))
    if req.use_beam_search and any(t.prompt.images for t in turns):
        # each beam step re-sends the beam's tokens, which carry no images
        raise bad_request("'use_beam_search' does not take images yet", param="use_beam_search")
    if req.use_beam_search and req.thinking_token_budget not in (None, -1):
        raise bad_request(
            "'thinking_token_budget' is not available with 'use_beam_search'", param="thinking_token_budget"
        )
    if req.use_beam_search:  # the n best beams as the choices (aiolm/server/beam.py)
        ids_of = [t.prompt.token_ids for t in turns]
        returned = (ids_of if req.batched else ids_of[0]) if req.return_token_ids else None
        beams = [(t.prompt, t.reading.message, t.echo) for t in turns]
        structured_field = structured_param if structured else None
        return await beam.chat_completion(
            request, ctx, req, beams, max_tokens, mt_param, lora, structured_field, returned
        )
    rid = ctx.new_id("chatcmpl")
    gen = Generation(
        ctx,
        [t.prompt for t in turns],
        params,
        rid,
        req.priority,
        rename={
            "prompt": "messages",
            "max_tokens": mt_param,
            "structured_outputs": structured_param,
            "logprobs": "top_logprobs",
        },
        lora_request=lora,
        cache_salt=req.cache_salt,
    )
    await gen.start(request.receive)
    prompt_ids = [t.prompt.token_ids for t in turns]
    prompt_tokens = sum(map(len, prompt_ids))
    log_extra(request, engine_request_id=rid, prompt_tokens=prompt_tokens, n=req.n, stream=stream, user=req.user)
    model = lora.lora_name if lora is not None else ctx.model_name
    meta = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model}
    returned_ids = (prompt_ids if req.batched else prompt_ids[0]) if req.return_token_ids else None
    if stream:
        opts = req.stream_options or StreamOptions()
        chunk_meta = {**meta, "object": "chat.completion.chunk"}
        events = _chat_events(
            gen,
            chunk_meta,
            req.n,
            prompt_tokens,
            opts.include_usage,
            top_n,
            engine,
            request,
            returned_ids,
            opts.continuous_usage_stats,
            req.return_tokens_as_token_ids,
            turns,
        )
        return EventStream(events, on_gone=lambda: log_extra(request, client_gone=True), close=gen.abort)
    as_ids = req.return_tokens_as_token_ids
    finals = await until_disconnect(request.receive, gen.collect())
    choices = []
    completion_tokens = 0
    for k, (turn, final) in enumerate(zip(turns, finals)):
        for c in final.outputs:
            completion_tokens += len(c.token_ids)
            finish_reason = c.finish_reason
            message, calls = turn.reading.message(c.text, was_cut(c))
            if turn.echo:
                message["content"] = turn.echo + (message["content"] or "")
            if calls and finish_reason == "stop" and not isinstance(c.stop_reason, str):  # a stop string cut it
                finish_reason = "tool_calls"
            choices.append(
                {
                    "index": k * req.n + c.index,
                    "message": message,
                    "logprobs": (
                        chat_logprobs(c.token_ids, c.logprobs, top_n, engine, as_ids, req.logprob_token_ids)
                        if req.logprobs
                        else None
                    ),
                    "finish_reason": finish_reason,
                    "stop_reason": c.stop_reason,
                    "token_ids": list(c.token_ids) if req.return_token_ids else None,
                }
            )
    log_extra(request, completion_tokens=completion_tokens)
    cached = sum(f.num_cached_tokens for f in finals)
    return json_response(
        {
            **meta,
            "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens, cached),
            "system_fingerprint": None,
            "prompt_logprobs": prompt_logprobs_json(finals[0].prompt_logprobs, prompt_ids[0], req.prompt_logprobs or 0),
            "prompt_token_ids": returned_ids,
            "kv_transfer_params": finals[0].kv_transfer_params,
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
    prompt_ids: list[int] | list[list[int]] | None = None,
    continuous: bool = False,
    as_ids: bool = False,
    turns: list[_Turn] | None = None,
) -> AsyncIterator[dict[str, Any]]:
    """``prompt_ids`` (return_token_ids): in the first chunk, as vLLM sends them; each choice
    delta then carries its new ``token_ids``. ``as_ids``: logprob tokens spelt ``token_id:<id>``.
    ``turns``: per conversation, how its choices are read (thinking and tool calls:
    ``_Reading``; with tools, calls stream as they are written, aiolm/server/tools.py) and
    what they echo; conversation k's choices are numbered from k * n."""
    turns = turns or [_Turn(Prompt(None, []), _Reading(ToolPlan(), None, "", True), "")]
    want_logprobs = gen.params.logprobs is not None
    completion_tokens = 0
    cached: dict[int, int] = {}

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        out = {**meta, "choices": choices, "system_fingerprint": None}
        if include_usage:  # vLLM's continuous_usage_stats: the counts so far in every chunk
            known = sum(cached.values()) if len(cached) == len(turns) else None  # every conversation's, or none
            counts = usage(prompt_tokens, completion_tokens, known)
            out["usage"] = counts if continuous else None
        return out

    streams = {k * n + i: t.reading.stream() for k, t in enumerate(turns) for i in range(n)}
    for idx in streams:
        first = chunk(
            [{"index": idx, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
        )
        if prompt_ids is not None and idx == 0:
            first["prompt_token_ids"] = prompt_ids
        yield first
        echo = turns[idx // n].echo
        if echo:
            yield chunk([{"index": idx, "delta": {"content": echo}, "logprobs": None, "finish_reason": None}])
    try:
        async for pi, out in gen.stream():
            cached[pi] = out.num_cached_tokens
            choices = []
            for c in out.outputs:
                idx = pi * n + c.index
                completion_tokens += len(c.token_ids)
                lp = (
                    chat_logprobs(c.token_ids, c.logprobs, top_n, tokenizer, as_ids, gen.params.logprob_token_ids)
                    if want_logprobs and c.token_ids
                    else None
                )
                finish_reason = c.finish_reason
                reasoning, text, call_deltas = streams[idx].feed(c.text, c.finished, was_cut(c))
                if streams[idx].called and finish_reason == "stop" and not isinstance(c.stop_reason, str):
                    finish_reason = "tool_calls"
                head = {**(_reasoning_fields(reasoning) if reasoning else {}), **({"content": text} if text else {})}
                deltas = ([head] if head else []) + call_deltas
                for d in deltas[:-1]:
                    yield chunk([{"index": idx, "delta": d, "logprobs": None, "finish_reason": None}])
                if not deltas and not c.finished and lp is None and not (prompt_ids is not None and c.token_ids):
                    continue
                choice: dict[str, Any] = {
                    "index": idx,
                    "delta": deltas[-1] if deltas else {},
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
        final_usage = usage(prompt_tokens, completion_tokens, sum(cached.values()))
        yield {**meta, "choices": [], "system_fingerprint": None, "usage": final_usage}


@dataclass
class _Turn:
    """One conversation of the request: its prompt, how its choices are read, what they echo."""

    prompt: Prompt
    reading: _Reading
    echo: str


def _continued(req: ChatCompletionRequest, conversation: list[ChatMessage]) -> str:
    """The content of a final assistant message the answer continues, else ""."""
    last = conversation[-1]
    continued = req.continue_final_message or not req.add_generation_prompt
    return (message_text(last.content) or "") if continued and last.role == "assistant" else ""


def _echoed(req: ChatCompletionRequest, conversation: list[ChatMessage]) -> str:
    """vLLM's chat ``echo``: the content of a final assistant message the answer continues."""
    return _continued(req, conversation) if req.echo else ""


def bound_after_thinking(
    engine: EngineClient, splitter: ReasoningSplitter, params: SamplingParams
) -> SamplingParams | None:
    """``params`` whose grammar waits for the end of the thinking (aiolm/structured/spec.py),
    unless the model may skip it and does not open it; None where the grammar binds from the
    first token as it is. Where the start marker is several tokens (Granite's), the first token
    cannot tell thinking from answering: a model left to choose is bound from its first token
    (it answers without thinking), or the grammar would wait for an end marker that a model
    answering at once never writes."""
    structured = params.structured_outputs
    if structured is None or not splitter.thinking:
        return None
    end = tuple(engine.tokenize(splitter.fmt.ends[0], False))
    start = tuple(engine.tokenize(splitter.fmt.starts[0], False)) if splitter.undecided else ()
    if len(start) > 1:
        return None
    return params.clone(structured_outputs=dataclasses.replace(structured, after=end, opens=start))


def with_thinking_budget(
    engine: EngineClient,
    splitter: ReasoningSplitter,
    params: SamplingParams,
    budget: int | None,
    param: str,
    required: bool = True,
) -> SamplingParams | None:
    """``params`` that cap the thinking at ``budget`` tokens (vLLM's ``thinking_token_budget``),
    None where nothing is to cap: no budget, or a prompt that closed the thinking already. The
    markers must be one token each, as the worker counts and forces tokens, not text: other
    markers are a 400, or, where the budget is not ``required``, no cap."""
    if budget is None or budget < 0 or not splitter.thinking:
        return None
    end = engine.tokenize(splitter.fmt.ends[0], False)
    start = engine.tokenize(splitter.fmt.starts[0], False) if splitter.undecided else [None]
    if len(end) != 1 or len(start) != 1:
        if not required:
            return None
        raise bad_request(
            f"'{param}' needs thinking markers of one token each; this model writes "
            f"{splitter.fmt.ends[0]!r} as {len(end)} tokens",
            param=param,
        )
    return params.clone(thinking_token_budget=budget, thinking_markers=(end[0], start[0]))


def _reasoning_fields(text: str | None) -> dict[str, Any]:
    """vLLM's two spellings of the thinking, on messages and deltas alike."""
    return {"reasoning_content": text, "reasoning": text}


@dataclass
class _Reading:
    """How a choice's text becomes the assistant's message: the thinking split off first
    (aiolm/server/reasoning.py), then tool calls read from the rest (aiolm/server/tools.py)."""

    plan: ToolPlan
    thinking: ReasoningFormat | None
    prompt: str
    include_reasoning: bool
    continued: str = ""  # a final assistant message the output continues

    def message(self, text: str, cut: bool = False) -> tuple[dict[str, Any], list[ParsedCall]]:
        reasoning: str | None = None
        content: str | None = text
        if self.thinking is not None:
            reasoning, content = split_reasoning(self.thinking, self.prompt, text, self.continued)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        calls: list[ParsedCall] = []
        if self.plan.active:
            text_part, calls = read_output(self.plan, content or "", cut)
            message["content"] = text_part or None  # nothing besides the calls is null, as a stream sends none
            message["tool_calls"] = tool_calls_json(calls)
        if self.thinking is not None:
            message.update(_reasoning_fields(reasoning if self.include_reasoning else None))
        return message, calls

    def stream(self) -> _ChoiceStream:
        return _ChoiceStream(self)


class _ChoiceStream:
    """One streamed choice through ``_Reading``'s steps, delta by delta."""

    def __init__(self, reading: _Reading) -> None:
        self.show_reasoning = reading.include_reasoning
        self.split = (
            ReasoningSplitter(reading.thinking, reading.prompt, reading.continued) if reading.thinking else None
        )
        self.tools = StreamState(reading.plan) if reading.plan.active else None
        self.calls = CallDeltas()

        self.called = False  # the finished choice holds calls (finish_reason "tool_calls")

    def feed(self, delta: str, finished: bool, cut: bool = False) -> tuple[str, str, list[dict[str, Any]]]:
        """(reasoning, content, tool-call deltas) to send now; the calls as they are written."""
        reasoning, content = "", delta
        if self.split is not None:
            reasoning, content = self.split.step(delta, finished)
        deltas: list[dict[str, Any]] = []
        if self.tools is not None:
            content = self.tools.feed(content)
            deltas = self.calls.update(self.tools.progress())
            if finished:
                rest, calls = self.tools.finish(cut)
                content += rest
                deltas += self.calls.update(calls)
                self.called = bool(calls)
        return (reasoning if self.show_reasoning else ""), content, deltas
