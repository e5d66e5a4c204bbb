"""Tool calling for /v1/chat/completions: the enforced-call schema, and turning generated
text into OpenAI ``tool_calls`` (the request fields are models in protocol.py).

``tool_choice`` ``required`` or a named function constrains generation with a JSON
schema (structured outputs), so those calls always parse. ``auto`` leaves the model
free and reads its output with the ``--tool-call-parser`` parser; what the parser
cannot read stays content. ``none`` generates text.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from aiolm.engine.client import EngineClient
from aiolm.outputs import CompletionOutput
from aiolm.params import ParamError
from aiolm.server import client_json
from aiolm.server.errors import bad_request
from aiolm.server.protocol import ChatCompletionRequest, ChatMessage, TokenizeRequest, param_error
from aiolm.server.tool_parsers import PARSERS, ParsedCall, ToolParser
from aiolm.server.tool_parsers.base import CallsReader
from aiolm.server.tool_parsers.json_stream import JsonCallsReader, PartialCall, json_text
from aiolm.structured.spec import SCHEMA_MAPS, StructuredOutputs

log = logging.getLogger(__name__)
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names (fullmatch)
_JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}
# What chat_template_kwargs may not set: the variables the server passes the template
# itself, the template's functions, and transformers' apply_chat_template's own arguments
# (tokenize or return_dict would change what rendering returns).
_SERVER_TEMPLATE_VARS = frozenset(
    {
        "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
        "raise_exception", "strftime_now", "chat_template", "tokenize", "padding", "truncation", "max_length",
        "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs",
    }
)  # fmt: skip


@dataclass
class ToolPlan:
    """What a chat request asks of tools, after validation."""

    tools: list[dict[str, Any]] = field(default_factory=list)  # for the chat template
    enforced: StructuredOutputs | None = None  # required / named
    named: str | None = None
    parallel: bool = True
    parser: ToolParser | None = None  # auto
    names: frozenset[str] = frozenset()  # auto: the functions a call may name; others are text

    @property
    def active(self) -> bool:
        return self.enforced is not None or self.parser is not None


def plan_tools(req: ChatCompletionRequest, parser_name: str | None) -> ToolPlan:
    """Check ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` beyond their shapes (400s name the field)."""
    tools = req.tools or []
    choice = req.tool_choice
    if not tools:
        if choice not in (None, "none", "auto"):
            raise bad_request(f"'tool_choice' {_choice_text(choice)} needs 'tools'", param="tool_choice")
        return ToolPlan()
    names, template_tools = checked_tools(tools)
    parallel = req.parallel_tool_calls is not False
    choice = "auto" if choice is None else choice
    if choice == "none":
        return ToolPlan(template_tools)
    if choice == "auto":
        if parser_name is None:
            raise bad_request(
                "'tool_choice' 'auto' needs the server started with --tool-call-parser "
                "(hermes, llama3_json or pythonic); use 'required', a named function or 'none'",
                param="tool_choice",
            )
        return ToolPlan(template_tools, parser=PARSERS[parser_name](), parallel=parallel, names=frozenset(names))
    if not isinstance(choice, str):
        name = choice.function.name
        if name not in names:
            raise bad_request(
                f"'tool_choice.function.name' {name!r} is not one of the tools ({', '.join(names)})",
                param="tool_choice.function.name",
            )
        schema = _call_schema(name, names[name], "")
        return ToolPlan(template_tools, StructuredOutputs("json", json.dumps(schema)), named=name, parallel=False)
    at = "/items" if parallel else ""
    if len(names) == 1:
        ((n, p),) = names.items()
        one = _call_schema(n, p, at)
    else:
        one = {"anyOf": [_call_schema(n, p, f"{at}/anyOf/{i}") for i, (n, p) in enumerate(names.items())]}
    schema = {"type": "array", "items": one, "minItems": 1} if parallel else one
    return ToolPlan(template_tools, StructuredOutputs("json", json.dumps(schema)), parallel=parallel)


def checked_tools(tools: list[Any]) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """``tools`` checked beyond their shapes (400s name the field): each function's parameter
    schema by name, and the tools as the chat template takes them."""
    names: dict[str, dict[str, Any]] = {}
    for i, t in enumerate(tools):
        fn = t.function
        if not _NAME.fullmatch(fn.name):
            raise bad_request(
                f"'tools[{i}].function.name' must be 1-64 letters, digits, '_' or '-', got {fn.name!r}",
                param=f"tools[{i}].function.name",
            )
        if fn.name in names:
            raise bad_request(
                f"'tools[{i}].function.name' {fn.name!r} is given twice", param=f"tools[{i}].function.name"
            )
        # none or {}: a function without parameters (as vLLM takes {}), whose arguments are {}
        params = fn.parameters if fn.parameters else {"type": "object", "properties": {}}
        _check_schema(params, f"tools[{i}].function.parameters", top=True)
        names[fn.name] = params
    return names, [{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in tools]


def _choice_text(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else "a named function"


def _call_schema(name: str, params: dict[str, Any], at: str) -> dict[str, Any]:
    """A call of function ``name``, as the schema at JSON pointer ``at`` of the whole one:
    its parameters' own references ("#/$defs/...", "#") are moved to where they now sit."""
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": _rebased(params, f"{at}/properties/arguments")},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


_DATA_KEYS = frozenset({"const", "enum", "default", "examples"})  # values there are data, not schemas


def _rebased(schema: Any, base: str) -> Any:
    """``schema`` with each local ``$ref`` ("#" and a JSON pointer) prefixed by ``base``, the
    pointer of the place it is nested at. Recursion is bounded by the JSON depth limit."""
    if isinstance(schema, list):
        return [_rebased(v, base) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):  # not an anchor ("#name")
            out[k] = "#" + base + v[1:]
        elif k in SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: _rebased(sub, base) for name, sub in v.items()}
        elif k in _DATA_KEYS:
            out[k] = v
        else:
            out[k] = _rebased(v, base)
    return out


def _check_schema(s: Any, path: str, top: bool = False) -> None:
    """The structural checks a JSON schema must pass; xgrammar checks the rest when enforced."""
    if isinstance(s, bool):
        return
    if not isinstance(s, dict):
        raise bad_request(f"'{path}' must be a JSON schema object", param=path)
    typ = s.get("type")
    types = typ if isinstance(typ, list) else [typ] if typ is not None else []
    for t in types:
        if not isinstance(t, str) or t not in _JSON_TYPES:
            raise bad_request(
                f"'{path}.type' must be one of {', '.join(sorted(_JSON_TYPES))}, got {t!r}", param=f"{path}.type"
            )
    if top and typ is not None and typ != "object":
        raise bad_request(f"'{path}' must describe an object (type 'object'), got type {typ!r}", param=f"{path}.type")
    props = s.get("properties")
    if props is not None:
        if not isinstance(props, dict):
            raise bad_request(f"'{path}.properties' must be an object", param=f"{path}.properties")
        for k, v in props.items():
            _check_schema(v, f"{path}.properties.{k}")
    req = s.get("required")
    if req is not None and not (isinstance(req, list) and all(isinstance(r, str) for r in req)):
        raise bad_request(f"'{path}.required' must be a list of property names", param=f"{path}.required")
    items = s.get("items")
    if isinstance(items, list):  # draft 4's tuple form
        for j, sub in enumerate(items):
            _check_schema(sub, f"{path}.items[{j}]")
    elif items is not None:
        _check_schema(items, f"{path}.items")
    for key in ("anyOf", "oneOf", "allOf"):
        if key in s:
            if not isinstance(s[key], list) or not s[key]:
                raise bad_request(f"'{path}.{key}' must be a non-empty list of schemas", param=f"{path}.{key}")
            for j, sub in enumerate(s[key]):
                _check_schema(sub, f"{path}.{key}[{j}]")


def check_continuation(req: ChatCompletionRequest | TokenizeRequest) -> None:
    """Continuing the final assistant message and opening a new turn exclude each other."""
    if req.continue_final_message and req.add_generation_prompt and "add_generation_prompt" in req.model_fields_set:
        raise bad_request(
            "'continue_final_message' and 'add_generation_prompt' cannot both be true", param="continue_final_message"
        )


async def render_chat_prompt(
    engine: EngineClient,
    req: ChatCompletionRequest | TokenizeRequest,
    tools: list[dict[str, Any]] | None,
    messages: list[ChatMessage] | None = None,
    where: str = "messages",
) -> str:
    """``req.messages`` through the model's chat template, as chat and /tokenize both render
    them: with the template's ``tools`` and the client's ``chat_template_kwargs``, continuing
    the final message when asked. ``messages``: one conversation of a batched chat request."""
    messages = messages if messages is not None else req.messages
    assert messages is not None and not isinstance(messages[0], list)
    cont = req.continue_final_message
    kwargs = dict(req.chat_template_kwargs or {})
    taken = sorted(_SERVER_TEMPLATE_VARS.intersection(kwargs))
    if taken:
        raise bad_request(
            f"'chat_template_kwargs' cannot set {', '.join(map(repr, taken))}: the request's own fields do",
            param="chat_template_kwargs",
        )
    if cont:
        kwargs["continue_final_message"] = True
    if tools:
        kwargs["tools"] = tools
    if req.documents:
        kwargs["documents"] = req.documents
    try:
        return await engine.render_chat_async(
            template_messages(messages, where), add_generation_prompt=req.add_generation_prompt and not cont, **kwargs
        )
    except ParamError as e:
        raise param_error(e) from None


def template_messages(messages: list[ChatMessage], where: str = "messages") -> list[dict[str, Any]]:
    """Parsed messages as chat templates want them: a call's arguments as an object
    (templates serialize it themselves), the tool result under ``tool_call_id``. ``where``:
    the conversation's name in the request, for 400s."""
    out = []
    for i, m in enumerate(messages):
        if m.content is None and not (m.role == "assistant" and m.tool_calls is not None):
            # As at OpenAI: only an assistant turn that made tool calls may leave its content out.
            raise bad_request(
                f"'{where}[{i}].content' is required for a {m.role} message (null or missing "
                f"content is allowed only on an assistant message with tool_calls)",
                param=f"{where}[{i}].content",
            )
        # fields beyond OpenAI's first, so they cannot override the ones read here
        content = _with_image_markers(m.content) if isinstance(m.content, list) and _has_images(m.content) else None
        content = content or message_text(m.content) or ""
        msg: dict[str, Any] = {**(m.model_extra or {}), "role": m.role, "content": content}
        if m.name:
            msg["name"] = m.name
        if m.tool_calls:
            if m.role != "assistant":
                raise bad_request(
                    f"'{where}[{i}].tool_calls' is only for assistant messages", param=f"{where}[{i}].tool_calls"
                )
            calls = []
            for j, c in enumerate(m.tool_calls):
                path = f"{where}[{i}].tool_calls[{j}].function.arguments"
                text = c.function.arguments
                try:
                    args = client_json.loads(text) if text.strip() else {}
                except client_json.TooDeep as e:
                    raise bad_request(f"'{path}' is {e}", param=path) from None
                except ValueError:
                    args = None
                if not isinstance(args, dict):
                    # An answer cut by max_tokens leaves its call's arguments unfinished: sent back,
                    # they are shown as no arguments, as vLLM shows them, so the conversation goes on.
                    log.warning("%s is not a JSON object; the template gets {}", path)
                    args = {}
                calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}})
            msg["tool_calls"] = calls
        if m.tool_call_id:
            if m.role != "tool":
                raise bad_request(
                    f"'{where}[{i}].tool_call_id' is only for tool messages", param=f"{where}[{i}].tool_call_id"
                )
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def message_text(content: str | list[Any] | None) -> str | None:
    """OpenAI allows content as a list of text parts; the engine's template wants a string:
    the parts a line apart, as vLLM joins them (run together, "Hello" and "World" became
    one word)."""
    if content is None or isinstance(content, str):
        return content
    return "\n".join(part.text for part in content if getattr(part, "text", None) is not None)


def _has_images(content: str | list[Any] | None) -> bool:
    return isinstance(content, list) and any(part.type == "image_url" for part in content)


def _with_image_markers(content: list[Any]) -> list[dict[str, Any]]:
    """Content with images as the parts a vision-language template takes: text parts and
    ``{"type": "image"}`` where each image goes."""
    return [{"type": "image"} if p.type == "image_url" else {"type": "text", "text": p.text} for p in content]


def image_urls(messages: list[ChatMessage], where: str = "messages") -> list[tuple[str, str]]:
    """Each image part's URL with where it is in the request, in prompt order."""
    found = []
    for i, m in enumerate(messages):
        parts: list[Any] = m.content if isinstance(m.content, list) else []
        for j, part in enumerate(parts):
            if part.type == "image_url":
                found.append((part.image_url.url, f"{where}[{i}].content[{j}].image_url.url"))
    return found


def enforced_calls(plan: ToolPlan, text: str) -> list[ParsedCall] | None:
    """The calls in a constrained output, or None when it is incomplete (cut by max_tokens)."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):  # a model's output nested past the parser's limit: not calls
        return None
    items = doc if isinstance(doc, list) else [doc]
    calls = []
    for it in items:
        if not isinstance(it, dict) or not isinstance(it.get("name"), str):
            return None
        arguments = json_text(it.get("arguments", {}))
        if arguments is None:
            return None
        calls.append(ParsedCall(it["name"], arguments))
    return calls or None


def cut_calls(plan: ToolPlan, text: str) -> list[ParsedCall]:
    """An enforced output cut short (max_tokens, a stop string): its calls as far as they were
    written, each once its name is, the arguments a prefix of their JSON (as OpenAI returns a
    call cut by its length)."""
    reader = JsonCallsReader()
    reader.feed(text)
    calls = [] if reader.failed else [ParsedCall(c.name, c.arguments) for c in reader.calls if c.name is not None]
    if not calls and plan.named is not None:  # a named call is that function's, before its name is written
        first = reader.calls[0].arguments if reader.calls and not reader.failed else ""
        calls = [ParsedCall(plan.named, first)]
    return calls if plan.parallel else calls[:1]


def was_cut(c: CompletionOutput) -> bool:
    """Whether a choice ended where its text was cut (max_tokens, a stop string), not where the
    model ended it: a call it was writing then stands, as far as it goes."""
    return c.finish_reason == "length" or isinstance(c.stop_reason, str)


def read_output(plan: ToolPlan, text: str, cut: bool = False) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of one finished choice (``cut``: see ``was_cut``)."""
    if plan.enforced is not None:  # the text is the grammar's call format, never content
        calls = enforced_calls(plan, text)
        return None, calls if calls else cut_calls(plan, text)
    assert plan.parser is not None
    content, calls = plan.parser.extract(text)
    if not calls and cut:
        content, calls = _unfinished_calls(plan, text) or (content, calls)
    offered = [c for c in calls if c.name in plan.names]  # a call of no such function is dropped
    if calls and not offered:  # only such calls: the model's text
        return text, []
    calls = offered
    if calls and not plan.parallel:
        calls = calls[:1]
    return content, calls


def _unfinished_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[ParsedCall]] | None:
    """(content, calls) of a text that ends inside its calls (cut by max_tokens or a stop
    string): each call whose name was read, with its arguments as far as they go, as OpenAI
    returns a call cut by the length and as the stream has already sent it; None where no
    call's name was read, or the text is not calls after all."""
    assert plan.parser is not None
    start = plan.parser.calls_start(text)
    if start is None:
        return None
    reader = plan.parser.stream_reader()
    reader.feed(text[start:])
    if reader.failed or not reader.calls or reader.calls[-1].done:
        return None  # not calls, or calls the text finished (malformed ones: the text stands)
    named = [ParsedCall(c.name, c.arguments) for c in reader.calls if c.name is not None]
    return (text[:start] or None, named) if named else None


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


def tool_calls_json(calls: list[ParsedCall]) -> list[dict[str, Any]]:
    return [
        {"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
    ]


class CallDeltas:
    """OpenAI's streamed tool calls: per call, a header delta (index, id, type, name, empty
    arguments) once its name is known, then its arguments text as it grows."""

    def __init__(self) -> None:
        self.sent: list[str] = []  # per call headed: the arguments text sent so far

    def update(self, calls: Sequence[PartialCall | ParsedCall]) -> list[dict[str, Any]]:
        """Deltas for what ``calls`` (read so far, or finished) add to what was sent."""
        out: list[dict[str, Any]] = []
        for i, c in enumerate(calls):
            if c.name is None:
                break  # a later call's deltas wait for this one's name, keeping the indexes in order
            if i == len(self.sent):
                head = {"index": i, "id": call_id(), "type": "function", "function": {"name": c.name, "arguments": ""}}
                out.append({"tool_calls": [head]})
                self.sent.append("")
            sent = self.sent[i]
            if not c.arguments.startswith(sent):  # the finished text disagrees with the stream: cannot unsend
                log.warning("tool call %d: finished arguments differ from those streamed", i)
                continue
            if len(c.arguments) > len(sent):
                out.append({"tool_calls": [{"index": i, "function": {"arguments": c.arguments[len(sent) :]}}]})
                self.sent[i] = c.arguments
        return out


class StreamState:
    """One streamed choice: content is shown until tool calls may begin; from there the
    calls are read as they are written (``progress``), and the finished text is read
    again by ``finish`` as a non-streamed choice is, which has the last word."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.shown = 0
        self.reader: CallsReader = plan.parser.stream_reader() if plan.parser is not None else JsonCallsReader()
        self.fed: int | None = 0 if plan.enforced is not None else None  # text given to the reader

    def feed(self, delta: str) -> str:
        """The content that can be shown now."""
        self.text += delta
        if self.fed is None:
            assert self.plan.parser is not None
            upto = max(self.shown, self.plan.parser.safe_prefix(self.text))
            out, self.shown = self.text[self.shown : upto], upto
            self.fed = self.plan.parser.calls_start(self.text)
        else:
            out = ""
        if self.fed is not None:
            self.reader.feed(self.text[self.fed :])
            self.fed = len(self.text)
        return out

    def progress(self) -> list[PartialCall]:
        """The calls read so far (the first only without parallel tool calls)."""
        if self.reader.failed:
            return []  # not calls after all, or not ones the stream can follow: finish decides
        names = self.plan.names
        calls = [c for c in self.reader.calls if not names or c.name is None or c.name in names]
        return calls if self.plan.parallel else calls[:1]

    def finish(self, cut: bool = False) -> tuple[str, list[ParsedCall]]:
        """(content still to show, calls); ``cut``: see ``was_cut``."""
        content, calls = read_output(self.plan, self.text, cut)
        if not calls:
            return ("" if self.plan.enforced is not None else self.text[self.shown :]), []
        rest = (content or "")[self.shown :] if content and len(content) > self.shown else ""
        return rest, calls
