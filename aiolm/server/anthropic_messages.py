"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on chat's path.

A request is translated once into a ChatCompletionRequest (``chat_request``), and then
takes chat's own steps, so the two APIs cannot drift: tools checked and planned by
tools.plan_tools (``tool_choice`` any and tool become enforced calls, generated to the
schema by structured outputs), the prompt rendered by tools.render_chat_prompt (tool_use
blocks as the template's tool calls, tool_result blocks as ``tool`` messages), sampling
by protocol.sampling_params, the run by generation.Generation, and calls read by the
server's ``--tool-call-parser``. Only the answer is Anthropic's: content blocks, a
``stop_reason``, usage split into fresh and prefix-cached prompt tokens, and a stream of
named events (message_start ... message_stop). Errors on these routes have Anthropic's
shape (anthropic_errors.py).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from aiolm.engine.client import EngineClient
from aiolm.outputs import CompletionOutput, RequestOutput
from aiolm.params import OutputKind
from aiolm.server.anthropic_errors import anthropic_body
from aiolm.server.anthropic_protocol import (
    AnthropicMessage,
    AnthropicRedactedThinkingBlock,
    AnthropicThinkingBlock,
    AnthropicThinkingDisabled,
    AnthropicThinkingEnabled,
    AnthropicToolChoiceAny,
    AnthropicToolChoiceAuto,
    AnthropicToolChoiceNone,
    AnthropicToolChoiceTool,
    AnthropicToolResultBlock,
    AnthropicToolUseBlock,
    CountTokensRequest,
    MessagesPrompt,
    MessagesRequest,
)
from aiolm.server.chat import bound_after_thinking, with_thinking_budget
from aiolm.server.errors import APIError, bad_request, json_response
from aiolm.server.generation import Generation, Prompt, check_lengths, engine_error, tokenize
from aiolm.server.http import check_model, context, log_extra, off_loop_if_big, read_json
from aiolm.server.protocol import ChatCompletionRequest, parse, sampling_params
from aiolm.server.reasoning import ReasoningFormat, ReasoningSplitter, reasoning_format, split_reasoning
from aiolm.server.sse import EventStream, NamedEvent, until_disconnect
from aiolm.server.tool_parsers import PARSERS, ParsedCall
from aiolm.server.tool_parsers.json_stream import PartialCall
from aiolm.server.tools import (
    StreamState,
    ToolPlan,
    checked_tools,
    message_text,
    plan_tools,
    read_output,
    render_chat_prompt,
    was_cut,
)

# Engine-side and chat-side names of what a Messages request calls otherwise (400s name the field).
_RENAME = {"stop": "stop_sequences", "prompt": "messages", "structured_outputs": "tools"}
_CHAT_TOOL_PATH = re.compile(r"(tools\[\d+\])\.function\.(name|parameters)")


# -- the request, as a chat request ----------------------------------------------------------


def chat_request(req: MessagesPrompt, thinking: ReasoningFormat | None) -> ChatCompletionRequest:
    """``req`` as the chat request that renders and samples the same (400s name Anthropic's fields).
    ``thinking``: the server's --reasoning-parser, whose template variable ``req.thinking`` sets."""
    fields: dict[str, Any] = {}
    if isinstance(req, MessagesRequest):
        fields = {"max_tokens": req.max_tokens, "stop": req.stop_sequences, "stream": req.stream}
        # only those the client gave: the others take the model's defaults, as chat's do
        fields |= {k: getattr(req, k) for k in ("temperature", "top_p", "top_k") if k in req.model_fields_set}
    choice = req.tool_choice
    if isinstance(choice, (AnthropicToolChoiceAuto, AnthropicToolChoiceAny)) and choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    tools = [
        {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.input_schema}}
        for t in req.tools or []
    ]
    if req.thinking is not None and thinking is not None:
        fields["chat_template_kwargs"] = {thinking.switch: not isinstance(req.thinking, AnthropicThinkingDisabled)}
    try:  # validated as chat's own requests are: the chat steps below get the model they expect
        return ChatCompletionRequest.model_validate(
            {
                "messages": chat_messages(req),
                "tools": tools or None,
                "tool_choice": _chat_tool_choice(req),
                "continue_final_message": req.messages[-1].role == "assistant",  # Anthropic's prefill
                **fields,
            }
        )
    except ValidationError as e:  # a bound chat has and these models lack (e.g. the message count)
        err = e.errors(include_url=False)[0]
        raise bad_request(f"'messages' cannot be rendered as a chat: {err['msg']}", param="messages") from None


def chat_messages(req: MessagesPrompt) -> list[dict[str, Any]]:
    """The system prompt and the turns as chat messages: an assistant turn's tool_use blocks
    become its tool calls, a user turn's tool_result blocks ``tool`` messages, in order."""
    out = [] if req.system is None else [{"role": "system", "content": message_text(req.system)}]
    last = len(req.messages) - 1
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "assistant":
            out.append(_assistant_turn(m, i, final=i == last))
        else:
            out.extend(_user_turn(m, i))
    return out


def _assistant_turn(m: AnthropicMessage, i: int, final: bool) -> dict[str, Any]:
    texts: list[Any] = []
    calls: list[dict[str, Any]] = []
    thoughts: list[str] = []
    for j, b in enumerate(m.content):
        if isinstance(b, AnthropicThinkingBlock):
            thoughts.append(b.thinking)
            continue
        if isinstance(b, AnthropicRedactedThinkingBlock):
            continue  # encrypted by the model that wrote it: nothing here can read it
        if isinstance(b, AnthropicToolResultBlock):
            raise bad_request(
                f"'messages[{i}].content[{j}]': tool_result blocks belong in user messages",
                param=f"messages[{i}].content[{j}]",
            )
        if isinstance(b, AnthropicToolUseBlock):
            if final:
                raise bad_request(
                    f"'messages[{i}].content[{j}]': the final assistant message is continued, so it cannot "
                    "hold tool_use blocks (send their tool_result in a user message)",
                    param=f"messages[{i}].content[{j}]",
                )
            arguments = json.dumps(b.input, ensure_ascii=False)
            calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": arguments}})
        else:
            texts.append(b)
    content = message_text(texts) if texts or not calls else None
    turn = {"role": "assistant", "content": content, "tool_calls": calls or None}
    return turn | {"reasoning_content": "".join(thoughts)} if thoughts else turn


def _user_turn(m: AnthropicMessage, i: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    texts: list[Any] = []
    for j, b in enumerate(m.content):
        if isinstance(b, (AnthropicToolUseBlock, AnthropicThinkingBlock, AnthropicRedactedThinkingBlock)):
            raise bad_request(
                f"'messages[{i}].content[{j}]': {b.type} blocks belong in assistant messages",
                param=f"messages[{i}].content[{j}]",
            )
        if isinstance(b, AnthropicToolResultBlock):
            if texts:
                out.append({"role": "user", "content": message_text(texts)})
                texts = []
            result = message_text(b.content) or ""
            out.append({"role": "tool", "content": result, "tool_call_id": b.tool_use_id})
        else:
            texts.append(b)
    if texts or not out:
        out.append({"role": "user", "content": message_text(texts)})
    return out


def _chat_tool_choice(req: MessagesPrompt) -> str | dict[str, Any] | None:
    """Anthropic's ``tool_choice`` as chat's, after checking what chat would name in its own terms."""
    choice = req.tool_choice
    if choice is None or isinstance(choice, AnthropicToolChoiceNone):
        return None if choice is None else "none"
    if isinstance(choice, AnthropicToolChoiceAuto):
        return "auto"
    names = [t.name for t in req.tools or []]
    if not names:
        raise bad_request(f"'tool_choice' {choice.type!r} needs 'tools'", param="tool_choice")
    if isinstance(choice, AnthropicToolChoiceAny):
        return "required"
    assert isinstance(choice, AnthropicToolChoiceTool)
    if choice.name not in names:
        raise bad_request(
            f"'tool_choice.name' {choice.name!r} is not one of the tools ({', '.join(names)})",
            param="tool_choice.name",
        )
    return {"type": "function", "function": {"name": choice.name}}


def _anthropic_names(e: APIError) -> APIError:
    """A chat tool check's 400 with Anthropic's field names."""

    def fix(text: str) -> str:
        return _CHAT_TOOL_PATH.sub(lambda m: m[1] + (".name" if m[2] == "name" else ".input_schema"), text)

    return APIError(e.status, fix(e.message), fix(e.param) if e.param else None, e.code, e.type, e.headers)


def _plan(chat: ChatCompletionRequest, parser_name: str | None) -> ToolPlan:
    if chat.tools and chat.tool_choice in (None, "auto") and parser_name is None:
        raise bad_request(
            "'tool_choice' auto (the default with 'tools') needs the server started with --tool-call-parser "
            f"({', '.join(PARSERS)}); use {{'type': 'any'}}, {{'type': 'tool', 'name': ...}} or {{'type': 'none'}}",
            param="tool_choice",
        )
    try:
        return plan_tools(chat, parser_name)
    except APIError as e:
        raise _anthropic_names(e) from None


async def _prompt(engine: EngineClient, chat: ChatCompletionRequest, tools: list[dict[str, Any]]) -> Prompt:
    text = await render_chat_prompt(engine, chat, tools)
    return Prompt(text, await tokenize(engine, text, add_special_tokens=False, param="messages"))


# -- the answer -------------------------------------------------------------------------------


def _usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, int]:
    """Anthropic counts a prompt in parts: fresh (``input_tokens``) and read from the cache."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "output_tokens": output_tokens,
        "cache_read_input_tokens": cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def _thinking_block(text: str) -> dict[str, Any]:
    """A thinking block as Anthropic's API returns one; aiolm signs nothing, so no signature."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def _tool_use_id() -> str:
    return "toolu_" + secrets.token_hex(12)


def _tool_use(call: ParsedCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": _tool_use_id(), "name": call.name}


def _call_input(arguments: str) -> dict[str, Any]:
    """A tool_use block's input: the call's arguments, or {} for a call cut short (max_tokens or
    a stop sequence) before its JSON was whole; the stream sent what there was as partial_json."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _stop(c: CompletionOutput, out: RequestOutput, calls: list[ParsedCall]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished output; an engine failure is raised."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if c.finish_reason == "stop":
        if isinstance(c.stop_reason, str):  # one of stop_sequences; a token id or None is the model's end
            return "stop_sequence", c.stop_reason
        if calls:
            return "tool_use", None
        return "end_turn", None
    if c.finish_reason == "abort":
        raise APIError(503, "the generation was aborted (the server is shutting down)", type="server_error")
    raise APIError(500, f"the generation failed: {out.error or c.finish_reason}", type="server_error")


def _shell(message_id: str, model: str) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
    }


# -- the routes -------------------------------------------------------------------------------


async def create_message(request: Request) -> Response | EventStream:
    ctx = context(request)
    body = await read_json(request, ctx.settings.max_request_bytes)
    req = await off_loop_if_big(request, parse, MessagesRequest, body, ctx.settings.limits)
    lora = check_model(ctx, req.model)
    thinking = reasoning_format(ctx.settings.reasoning_parser)
    chat = chat_request(req, thinking)
    wants = req.thinking
    if thinking is None and wants is not None and not isinstance(wants, AnthropicThinkingDisabled):
        raise bad_request(
            f"'thinking' {wants.type!r} needs the server started with --reasoning-parser", param="thinking"
        )
    if isinstance(wants, AnthropicThinkingEnabled) and wants.budget_tokens >= req.max_tokens:
        raise bad_request("'thinking.budget_tokens' must be less than 'max_tokens'", param="thinking.budget_tokens")
    plan = await off_loop_if_big(request, _plan, chat, ctx.settings.tool_call_parser)
    engine = ctx.engine
    kind = OutputKind.DELTA if req.stream else OutputKind.FINAL_ONLY
    params = sampling_params(chat, req.max_tokens, None, kind, plan.enforced, engine=engine, rename=_RENAME)
    prompt = await _prompt(engine, chat, plan.tools)
    check_lengths(ctx, len(prompt.token_ids), req.max_tokens, "messages", "max_tokens")
    rendered = prompt.text or ""
    # Anthropic's prefill: a final assistant turn the answer continues (its text, as chat reads it)
    continued = (message_text(chat.conversations[0][-1].content) or "") if chat.continue_final_message else ""
    splitter = ReasoningSplitter(thinking, rendered, continued) if thinking is not None else None
    if splitter is not None:  # the thinking is split off as chat splits it; a forced call follows it
        own = bound_after_thinking(engine, splitter, params)
        if isinstance(wants, AnthropicThinkingEnabled):
            own = with_thinking_budget(engine, splitter, own or params, wants.budget_tokens, "thinking") or own
        elif isinstance(wants, AnthropicThinkingDisabled):  # a template that ignored the switch: closed at once
            own = with_thinking_budget(engine, splitter, own or params, 0, "thinking", required=False) or own
        prompt = Prompt(prompt.text, prompt.token_ids, own)
    message_id = ctx.new_id("msg", "_")
    gen = Generation(ctx, [prompt], params, message_id, rename=_RENAME, lora_request=lora)
    await gen.start(request.receive)
    user = req.metadata.user_id if req.metadata is not None else None
    log_extra(request, engine_request_id=message_id, prompt_tokens=len(prompt.token_ids), stream=req.stream, user=user)
    shell = _shell(message_id, lora.lora_name if lora is not None else ctx.model_name)
    if req.stream:
        events = _events(gen, shell, plan, len(prompt.token_ids), request, splitter)
        return EventStream(events, done=False, close=gen.abort, on_gone=lambda: log_extra(request, client_gone=True))
    (final,) = await until_disconnect(request.receive, gen.collect())
    c = final.outputs[0]
    log_extra(request, completion_tokens=len(c.token_ids))
    thought, answer = split_reasoning(thinking, rendered, c.text, continued) if thinking is not None else (None, c.text)
    content, calls = read_output(plan, answer or "", was_cut(c)) if plan.active else (answer, [])
    stop_reason, stop_sequence = _stop(c, final, calls)
    blocks: list[dict[str, Any]] = [_thinking_block(thought)] if thought else []
    blocks += [{"type": "text", "text": content}] if content else []
    blocks += [{**_tool_use(call), "input": _call_input(call.arguments)} for call in calls]
    return json_response(
        {
            **shell,
            "content": blocks,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": _usage(len(prompt.token_ids), final.num_cached_tokens, len(c.token_ids)),
        }
    )


async def count_tokens(request: Request) -> Response:
    """The prompt a /v1/messages request with these fields would run, counted."""
    ctx = context(request)
    req = parse(CountTokensRequest, await read_json(request, ctx.settings.max_request_bytes), ctx.settings.limits)
    check_model(ctx, req.model)
    chat = chat_request(req, reasoning_format(ctx.settings.reasoning_parser))
    try:
        _, tools = checked_tools(chat.tools or [])
    except APIError as e:
        raise _anthropic_names(e) from None
    prompt = await _prompt(ctx.engine, chat, tools)
    return json_response({"input_tokens": len(prompt.token_ids)})


# -- the stream -------------------------------------------------------------------------------


def _event(kind: str, **fields: Any) -> NamedEvent:
    return NamedEvent(kind, {"type": kind, **fields})


class _Blocks:
    """The content blocks of a streamed message, each numbered by ``index``, one open at a
    time: a thinking block first where the model thinks, a text block opened by its first
    text, tool_use blocks after it, each opened once its call's name is read and taking its
    input as it is written."""

    def __init__(self) -> None:
        self.count = 0
        self.open: str | None = None  # the kind of the block open: thinking, text or tool_use
        self.inputs: list[str] = []  # per tool_use block opened: the input JSON sent so far

    def _delta(self, kind: str, start: dict[str, Any], delta: dict[str, Any]) -> Iterator[NamedEvent]:
        if self.open != kind:
            yield from self.close()
            self.open = kind
            yield _event("content_block_start", index=self.count, content_block=start)
        yield _event("content_block_delta", index=self.count, delta=delta)

    def thinking(self, delta: str) -> Iterator[NamedEvent]:
        if delta:
            yield from self._delta("thinking", _thinking_block(""), {"type": "thinking_delta", "thinking": delta})

    def text(self, delta: str) -> Iterator[NamedEvent]:
        if delta:
            yield from self._delta("text", {"type": "text", "text": ""}, {"type": "text_delta", "text": delta})

    def tool_uses(self, calls: Sequence[PartialCall | ParsedCall]) -> Iterator[NamedEvent]:
        """What ``calls`` (read so far, or finished) add: new blocks and input deltas."""
        for i, call in enumerate(calls):
            if call.name is None:
                return  # its block, and the ones after it, wait for its name
            if i == len(self.inputs):
                yield from self.close()
                block = {"type": "tool_use", "id": _tool_use_id(), "name": call.name, "input": {}}
                yield _event("content_block_start", index=self.count, content_block=block)
                self.inputs.append("")
                self.open = "tool_use"
            sent = self.inputs[i]
            if self.open == "tool_use" and i == len(self.inputs) - 1 and call.arguments.startswith(sent):
                new = call.arguments[len(sent) :]
                if new:
                    delta = {"type": "input_json_delta", "partial_json": new}
                    yield _event("content_block_delta", index=self.count, delta=delta)
                    self.inputs[i] = call.arguments

    def close(self) -> Iterator[NamedEvent]:
        if self.open is not None:
            self.open = None
            yield _event("content_block_stop", index=self.count)
            self.count += 1


async def _events(
    gen: Generation,
    shell: dict[str, Any],
    plan: ToolPlan,
    prompt_tokens: int,
    request: Request,
    splitter: ReasoningSplitter | None,
) -> AsyncIterator[NamedEvent]:
    """Anthropic's event sequence. message_start waits for the engine's first output, which
    says how much of the prompt the prefix cache served."""
    blocks = _Blocks()
    state = StreamState(plan) if plan.active else None
    output_tokens = cached = 0
    started = False
    stop: tuple[str, str | None] = ("end_turn", None)
    try:
        async for _, out in gen.stream():
            c = out.outputs[0]
            cached = out.num_cached_tokens
            if not started:
                started = True
                yield _event("message_start", message={**shell, "usage": _usage(prompt_tokens, cached, 0)})
                yield _event("ping")
            output_tokens += len(c.token_ids)
            thought, answer = ("", c.text) if splitter is None else splitter.step(c.text, c.finished)
            for ev in blocks.thinking(thought):
                yield ev
            text = answer if state is None else state.feed(answer)
            for ev in blocks.text(text):
                yield ev
            if state is not None:
                for ev in blocks.tool_uses(state.progress()):  # tool input as it is written
                    yield ev
            if c.finished:
                calls: list[ParsedCall] = []
                if state is not None:
                    rest, calls = state.finish(was_cut(c))
                    for ev in (*blocks.text(rest), *blocks.tool_uses(calls)):
                        yield ev
                stop = _stop(c, out, calls)
    except Exception as e:  # the stream has started: report in-band, as Anthropic does
        yield NamedEvent("error", anthropic_body(engine_error(e, _RENAME)))
        return
    finally:  # also when the client has gone: free the engine request now
        await gen.abort()
    log_extra(request, completion_tokens=output_tokens)
    for ev in blocks.close():
        yield ev
    usage = _usage(prompt_tokens, cached, output_tokens)
    yield _event("message_delta", delta={"stop_reason": stop[0], "stop_sequence": stop[1]}, usage=usage)
    yield _event("message_stop")
