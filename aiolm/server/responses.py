"""POST /v1/responses: OpenAI's Responses API, text in and out.

The input (a string, or message items) and ``instructions`` go through the chat
template as chat's messages do, and generation is chat's (generation.py). The
answer is one ``message`` output item holding one ``output_text`` part, after a
``reasoning`` item holding the thinking where ``--reasoning-parser`` finds some
(split as chat splits it, aiolm/server/reasoning.py; a ``text.format`` binds the
answer after it). A stream is typed events (an ``event:`` line naming each), numbered by
``sequence_number``, from ``response.created`` to ``response.completed`` (or
``response.incomplete`` when ``max_output_tokens`` cut it, ``error`` when the
engine failed); no ``[DONE]`` follows, as at OpenAI. Nothing is stored, so
``store`` has no effect and no response can be fetched or continued later.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from aiolm.params import SAMPLING_DEFAULT_KEYS, OutputKind, ParamError, SamplingParams
from aiolm.server.chat import bound_after_thinking
from aiolm.server.errors import bad_request, json_response
from aiolm.server.generation import (
    Generation,
    Prompt,
    check_lengths,
    engine_error,
    tokenize,
)
from aiolm.server.http import check_model, context, log_extra, off_loop_if_big, read_json
from aiolm.server.protocol import ResponsesRequest, param_error, parse, text_format_spec, with_model_defaults
from aiolm.server.reasoning import ReasoningSplitter, reasoning_format, split_reasoning
from aiolm.server.sse import EventStream, NamedEvent, until_disconnect
from aiolm.server.tools import message_text

# Engine-side names of what a Responses request calls otherwise (for 400s naming the field).
_RENAME = {
    "prompt": "input",
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "structured_outputs": "text.format",
}


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """``instructions`` as a leading system message, then the input items in order."""
    out = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    if isinstance(req.input, str):
        return [*out, {"role": "user", "content": req.input}]
    return out + [{"role": it.role, "content": _content(it.content)} for it in req.input]


def _content(content: str | list[Any]) -> str | list[dict[str, Any]]:
    """Text as a string; with images, parts as a vision-language template takes them."""
    if isinstance(content, list) and any(p.type == "input_image" for p in content):
        return [{"type": "image"} if p.type == "input_image" else {"type": "text", "text": p.text} for p in content]
    return message_text(content) or ""


def _image_urls(req: ResponsesRequest) -> list[tuple[str, str]]:
    """Each input_image's URL with where it is in the request, in prompt order."""
    if isinstance(req.input, str):
        return []
    return [
        (p.image_url, f"input[{i}].content[{j}].image_url")
        for i, it in enumerate(req.input)
        if isinstance(it.content, list)
        for j, p in enumerate(it.content)
        if p.type == "input_image"
    ]


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """The output item; ``text`` None while it is still being written (no part yet)."""
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [] if text is None else [_text_part(text)],
    }


def _reasoning(item_id: str, text: str, status: str) -> dict[str, Any]:
    """The thinking's output item, as vLLM writes it (its text whole, no summary)."""
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def _usage(prompt_tokens: int, cached_tokens: int, output_tokens: int, reasoning_tokens: int = 0) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + output_tokens,
    }


async def _thinking_tokens(engine: Any, thinking: str | None) -> int:
    """The thinking's length in tokens, counted by tokenizing its text (the split is on text),
    off the event loop: a long thinking takes milliseconds."""
    return len(await asyncio.to_thread(engine.tokenize, thinking, False)) if thinking else 0


def _outcome(finish_reason: str | None) -> tuple[str, dict[str, Any] | None, dict[str, Any] | None]:
    """(status, incomplete_details, error) of a response whose text ended for ``finish_reason``."""
    if finish_reason == "stop":
        return "completed", None, None
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}, None
    return "failed", None, {"code": "server_error", "message": f"the generation ended with '{finish_reason}'"}


def _shell(req: ResponsesRequest, response_id: str, model: str, sampling: dict[str, Any]) -> dict[str, Any]:
    """The response object before any output: what the request asked, echoed as OpenAI does
    (``sampling``: the temperature and top_p it runs with, the model's where it gave none)."""
    fmt = req.text.format if req.text is not None else None
    shown = fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"}
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "model": model,
        "output": [],
        "parallel_tool_calls": False,
        "previous_response_id": None,
        "temperature": sampling["temperature"],
        "top_p": sampling["top_p"],
        "text": {"format": shown},
        "tool_choice": "none",
        "tools": [],
        "truncation": "disabled",
        "usage": None,
        "user": req.user,
    }


def _finished(
    shell: dict[str, Any], items: list[dict[str, Any]], finish_reason: str | None, usage: dict[str, Any]
) -> dict[str, Any]:
    status, incomplete, error = _outcome(finish_reason)
    return {
        **shell,
        "status": status,
        "incomplete_details": incomplete,
        "error": error,
        "output": items,
        "usage": usage,
    }


async def create_response(request: Request) -> Response | EventStream:
    ctx = context(request)
    body = await read_json(request, ctx.settings.max_request_bytes)
    req = await off_loop_if_big(request, parse, ResponsesRequest, body, ctx.settings.limits)
    lora = check_model(ctx, req.model)  # a LoRA adapter's name, or the base model
    structured = await off_loop_if_big(request, text_format_spec, req.text.format if req.text is not None else None)
    stream = req.stream
    max_tokens = req.max_output_tokens
    sampling = with_model_defaults(req, ctx.engine, SAMPLING_DEFAULT_KEYS)
    try:  # SamplingParams holds the bounds: a bad value is a 400 before any work
        params = SamplingParams(
            **sampling,
            max_tokens=max_tokens,
            output_kind=OutputKind.DELTA if stream else OutputKind.FINAL_ONLY,
            structured_outputs=structured,
        )
    except ParamError as e:
        raise param_error(e, _RENAME) from None
    engine = ctx.engine
    urls = _image_urls(req)
    if urls and not engine.takes_images:
        raise bad_request("this model takes no images: send text content only", param=urls[0][1])
    images: list[Any] = []
    try:
        text = await engine.render_chat_async(_messages(req), add_generation_prompt=True)
        if urls:
            given = await engine.prompt_with_images(text, urls, "input")
            images = given["mm_inputs"]
    except ParamError as e:
        raise param_error(e, _RENAME) from None
    ids = given["prompt_token_ids"] if urls else await tokenize(engine, text, add_special_tokens=False, param="input")
    check_lengths(ctx, len(ids), max_tokens, "input", "max_output_tokens")
    response_id = ctx.new_id("resp", "_")
    thinking = reasoning_format(ctx.settings.reasoning_parser)
    splitter = ReasoningSplitter(thinking, text) if thinking is not None else None
    own = bound_after_thinking(engine, splitter, params) if splitter is not None else None
    prompt = Prompt(text, ids, own, images)
    gen = Generation(ctx, [prompt], params, response_id, rename=_RENAME, lora_request=lora, cache_salt=req.cache_salt)
    await gen.start(request.receive)
    log_extra(request, engine_request_id=response_id, prompt_tokens=len(ids), stream=stream, user=req.user)
    shell = _shell(req, response_id, lora.lora_name if lora is not None else ctx.model_name, sampling)
    ids_of = {"message": ctx.new_id("msg", "_"), "reasoning": ctx.new_id("rs", "_")}
    if stream:
        return EventStream(
            _events(gen, shell, ids_of, len(ids), request, splitter),
            done=False,
            close=gen.abort,
            on_gone=lambda: log_extra(request, client_gone=True),
        )
    (final,) = await until_disconnect(request.receive, gen.collect())
    c = final.outputs[0]
    log_extra(request, completion_tokens=len(c.token_ids))
    status = "completed" if c.finish_reason == "stop" else "incomplete"
    thought, answer = split_reasoning(thinking, text, c.text) if thinking is not None else (None, c.text)
    cut = answer is None and c.finish_reason != "stop"  # max_output_tokens ended it inside the thinking
    items = (
        [_reasoning(ids_of["reasoning"], thought, "incomplete" if cut else "completed")] if thought is not None else []
    )
    items.append(_message(ids_of["message"], answer or "", status))
    usage = _usage(len(ids), final.num_cached_tokens, len(c.token_ids), await _thinking_tokens(engine, thought))
    return json_response(_finished(shell, items, c.finish_reason, usage))


async def _events(
    gen: Generation,
    shell: dict[str, Any],
    ids_of: dict[str, str],
    prompt_tokens: int,
    request: Request,
    splitter: ReasoningSplitter | None,
) -> AsyncIterator[NamedEvent]:
    """The stream's events. Without a reasoning parser the message item opens at once; with
    one, a reasoning item opens at the first thinking and closes where the answer begins,
    and the message item opens after it (at the answer, or at the end)."""
    numbers = itertools.count()

    def event(kind: str, **fields: Any) -> NamedEvent:
        return NamedEvent(kind, {"type": kind, "sequence_number": next(numbers), **fields})

    items: list[dict[str, Any]] = []  # finished output items, in order
    thought: list[str] | None = None  # the thinking so far, once its item is open
    pieces: list[str] | None = None  # the answer so far, once its item is open

    def where(kind: str) -> dict[str, Any]:
        return {"item_id": ids_of[kind], "output_index": len(items), "content_index": 0}

    def open_message(thinking_cut: bool = False) -> list[NamedEvent]:
        """The message item opened, after the thinking's closed where it was open."""
        return [
            *(close_thinking(thinking_cut) if thought is not None else []),
            event(
                "response.output_item.added",
                output_index=len(items),
                item=_message(ids_of["message"], None, "in_progress"),
            ),
            event("response.content_part.added", **where("message"), part=_text_part("")),
        ]

    def close_thinking(cut: bool) -> list[NamedEvent]:
        assert thought is not None
        text = "".join(thought)
        item = _reasoning(ids_of["reasoning"], text, "incomplete" if cut else "completed")
        done = [
            event("response.reasoning_text.done", **where("reasoning"), text=text),
            event("response.content_part.done", **where("reasoning"), part={"type": "reasoning_text", "text": text}),
            event("response.output_item.done", output_index=len(items), item=item),
        ]
        items.append(item)
        return done

    yield event("response.created", response=shell)
    yield event("response.in_progress", response=shell)
    if splitter is None:
        pieces = []
        for ev in open_message():
            yield ev
    output_tokens = cached = 0
    finish_reason = None
    try:
        async for _, out in gen.stream():
            c = out.outputs[0]
            output_tokens += len(c.token_ids)
            cached = out.num_cached_tokens
            finish_reason = c.finish_reason or finish_reason
            finished = c.finish_reason is not None
            reasoning, answer = ("", c.text) if splitter is None else splitter.step(c.text, finished)
            if reasoning:
                if thought is None:
                    thought = []
                    item = {**_reasoning(ids_of["reasoning"], "", "in_progress"), "content": []}
                    yield event("response.output_item.added", output_index=0, item=item)
                    part = {"type": "reasoning_text", "text": ""}
                    yield event("response.content_part.added", **where("reasoning"), part=part)
                thought.append(reasoning)
                yield event("response.reasoning_text.delta", **where("reasoning"), delta=reasoning)
            if answer:
                if pieces is None:
                    pieces = []
                    for ev in open_message():
                        yield ev
                pieces.append(answer)
                yield event("response.output_text.delta", **where("message"), delta=answer, logprobs=[])
    except Exception as e:  # the stream has started: report in-band, as OpenAI does
        err = engine_error(e, _RENAME)
        yield event("error", code=err.code, message=err.message, param=err.param)
        return
    finally:  # also when the client has gone: free the engine request now
        await gen.abort()
    log_extra(request, completion_tokens=output_tokens)
    if pieces is None:  # only thinking, or nothing: the message item is still sent, empty
        pieces = []
        for ev in open_message(thinking_cut=finish_reason != "stop"):
            yield ev
    text = "".join(pieces)
    yield event("response.output_text.done", **where("message"), text=text, logprobs=[])
    yield event("response.content_part.done", **where("message"), part=_text_part(text))
    item = _message(ids_of["message"], text, "completed" if finish_reason == "stop" else "incomplete")
    yield event("response.output_item.done", output_index=len(items), item=item)
    items.append(item)
    reasoning_tokens = await _thinking_tokens(gen.ctx.engine, "".join(thought)) if thought else 0
    final = _finished(shell, items, finish_reason, _usage(prompt_tokens, cached, output_tokens, reasoning_tokens))
    yield event(f"response.{final['status']}", response=final)
