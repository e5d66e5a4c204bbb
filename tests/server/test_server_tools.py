"""Tool calling: the three parsers on crafted text, the request edge on the fake engine,
and enforced / parsed calls through a real `aiolm serve --tool-call-parser hermes` on
the embedded model with the real `openai` client (greedy, short)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_helpers import FakeEngine, ServerProcess, SharedServer
from starlette.testclient import TestClient

from aiolm.server import build_app
from aiolm.server.settings import ServerSettings, build_parser, settings_from_namespace
from aiolm.server.tool_parsers import PARSERS, ParsedCall
from aiolm.server.tools import CallDeltas, StreamState, ToolPlan

jsonschema = pytest.importorskip("jsonschema")

TIMEOUT = 180.0
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
TOOLS = [WEATHER, ADD]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


# -- the parsers, on crafted text ------------------------------------------------------------


PARSED = [
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "Let me check.\n",
        [ParsedCall("get_weather", '{"city": "Paris"}')],
    ),
    (
        "hermes",
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>',
        None,
        [ParsedCall("add", '{"a": 1, "b": 2}'), ParsedCall("add", '{"a": 3, "b": 4}')],
    ),
    ("hermes", "The weather is fine.", "The weather is fine.", []),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}',
        None,
        [ParsedCall("get_weather", '{"city": "Oslo", "unit": "c"}')],
    ),
    (
        "llama3_json",
        ' {"name": "add", "arguments": {"a": 1, "b": 2}}; {"name": "add", "parameters": {"a": 5, "b": 6}}',
        None,
        [ParsedCall("add", '{"a": 1, "b": 2}'), ParsedCall("add", '{"a": 5, "b": 6}')],
    ),
    ("llama3_json", "Sure, here you go.", "Sure, here you go.", []),
    (
        "pythonic",
        '[get_weather(city="Paris", unit="c"), add(a=1, b=-2)]',
        None,
        [ParsedCall("get_weather", '{"city": "Paris", "unit": "c"}'), ParsedCall("add", '{"a": 1, "b": -2}')],
    ),
    (
        "pythonic",
        "[f(xs=[1, 2.5, None, True], d={'k': 'v'})]",
        None,
        [ParsedCall("f", '{"xs": [1, 2.5, null, true], "d": {"k": "v"}}')],
    ),
    ("pythonic", "No calls needed.", "No calls needed.", []),
]

MALFORMED = [
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>'),  # broken JSON
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    ("hermes", '<tool_call>["add"]</tool_call>'),
    ("hermes", 'ok <tool_call>{"name": "add", "arguments": [1]}</tool_call>'),  # arguments not an object
    ("llama3_json", '{"name": "add", "parameters": {"a": 1}'),  # unterminated
    ("llama3_json", '{"nam": "add"}'),
    ("llama3_json", '<|python_tag|>print("hi")'),
    ("pythonic", "[add(1, 2)]"),  # positional arguments
    ("pythonic", "[__import__('os').system('echo pwned')]"),  # never evaluated
    ("pythonic", "[add(a=open('/etc/passwd'))]"),  # not a literal
    ("pythonic", "[add(**{'a': 1})]"),
    ("pythonic", "[add(a={1, 2})]"),  # a set is not JSON
    ("pythonic", "[add(a=1"),
    ("pythonic", "[" * 5000 + "]" * 5000),
    ("pythonic", "[]"),
]


DECLARED = frozenset({"get_weather", "add", "f", "g"})  # the functions the requests offer


@pytest.mark.parametrize(
    "name,text,calls",
    [
        # a lone surrogate escape: the arguments stay JSON a client can read (and the response UTF-8)
        ("hermes", '<tool_call>{"name": "f", "arguments": {"a": "\\udc00 é"}}</tool_call>', '{"a": "\\udc00 é"}'),
        ("pythonic", '[f(a="\\udc00")]', '{"a": "\\udc00"}'),
        # NaN and infinities are no JSON a client parses: not calls
        ("hermes", '<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>', None),
        ("llama3_json", '{"name": "f", "parameters": {"a": -Infinity}}', None),
        ("pythonic", "[f(a=1e999)]", None),
        # a JSON answer with a "name" field but no arguments is an answer, not a call
        ("llama3_json", '{"name": "Bob", "age": 3}', None),
        ("llama3_json", '{"name": "f"}', None),
        # a function the request did not offer is not called: alone, the output is the model's text
        ("hermes", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', None),
        ("pythonic", "[rm_rf(path='/'), f(a=1)]", '{"a": 1}'),
        ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call><tool_call>{"name": "g2"}', '{"a": 1}'),
    ],
)
@pytest.mark.parametrize("step", [1, 5])
def test_calls_are_sendable_json_of_offered_functions(name, text, calls, step):
    """Each call's arguments encode as UTF-8 and parse as JSON, streamed as one-shot; text that
    cannot be such a call is content, whole, and was not streamed as a call (a bad value after
    an offered name: what came before it, as the README says of calls left malformed)."""
    from aiolm.server.tools import read_output

    plan = ToolPlan(parser=PARSERS[name](), names=DECLARED)
    content, got = read_output(plan, text)
    if calls is None:
        assert (content, got) == (text, [])
        _, _, finished, deltas = _stream_pieces(name, text, step)
        bad_value = any(v in text for v in ("NaN", "Infinity", "1e999"))
        assert finished == [] and (bad_value or not any(deltas)), deltas
        assert not any(v in args for _, args in _joined(deltas) for v in ("NaN", "Infinity", "inf"))
        return
    assert [c.arguments for c in got] == [calls]
    from aiolm.server.errors import dumps

    got[0].arguments.encode()
    dumps({"input": json.loads(got[0].arguments)}).encode()  # Anthropic's tool_use block parses them back
    assert _joined(_stream_pieces(name, text, step)[3]) == [("f", calls)]


@pytest.mark.parametrize("name,text,content,calls", PARSED, ids=[f"{p[0]}-{i}" for i, p in enumerate(PARSED)])
def test_parsers_read_crafted_output(name, text, content, calls):
    assert PARSERS[name]().extract(text) == (content, calls)


@pytest.mark.parametrize("name,text", MALFORMED, ids=[f"{p[0]}-{i}" for i, p in enumerate(MALFORMED)])
def test_malformed_calls_fall_back_to_plain_content(name, text):
    assert PARSERS[name]().extract(text) == (text, [])


@pytest.mark.parametrize(
    "name,text,content,calls",
    PARSED + [(n, t, t, []) for n, t in MALFORMED],
    ids=[f"{p[0]}-{i}" for i, p in enumerate(PARSED + MALFORMED)],
)
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_pieces_reassemble_to_the_parsed_result(name, text, content, calls, step):
    """Fed in pieces, the content shown plus the calls at the end equal one-shot parsing,
    and no call text ever leaks into the content."""
    shown, rest, got, deltas = _stream_pieces(name, text, step)
    assert got == calls
    if calls:
        assert (shown + rest).strip() == (content or "").strip()
        assert _joined(deltas) == [(c.name, c.arguments) for c in calls]
    else:  # what was streamed as a call stays sent; the finished choice's content is the whole text
        assert shown + rest == text


def _stream_pieces(name: str, text: str, step: int) -> tuple[str, str, list, list[list[dict]]]:
    """(content shown, content at the end, finished calls, the call deltas of each piece)."""
    state, sender = StreamState(ToolPlan(parser=PARSERS[name](), names=DECLARED)), CallDeltas()
    shown, deltas = "", []
    for i in range(0, len(text), step):
        shown += state.feed(text[i : i + step])
        deltas.append(sender.update(state.progress()))
    rest, got = state.finish()
    deltas.append(sender.update(got))
    return shown, rest, got, deltas


def _joined(deltas: list[list[dict]]) -> list[tuple[str, str]]:
    """(name, arguments) per call from OpenAI's deltas: a header first, then arguments text."""
    calls: dict[int, list[str]] = {}
    for d in (d for piece in deltas for d in piece):
        (tc,) = d["tool_calls"]
        if "id" in tc:
            assert tc["index"] == len(calls) and tc["function"]["arguments"] == ""
            calls[tc["index"]] = [tc["function"]["name"], ""]
        else:
            calls[tc["index"]][1] += tc["function"]["arguments"]
    return [(n, a) for n, a in calls.values()]


@pytest.mark.parametrize(
    "name,text,piecemeal",
    [
        ("hermes", '<tool_call>{"name": "f", "arguments": {"city": "Paris", "days": [1, 2]}}</tool_call>', True),
        ("hermes", '<tool_call>{"arguments": {"city": "Paris"}, "name": "f"}</tool_call>', False),  # name last
        (
            "llama3_json",
            '{"name": "f", "parameters": {"city": "Paris"}}; {"name": "g", "parameters": {"q": "x y"}}',
            True,
        ),
        ("pythonic", '[f(city="Paris", days=[1, 2]), g(q="x y")]', False),  # a call at a time
    ],
)
def test_call_arguments_stream_while_they_are_written(name, text, piecemeal):
    """A call's header goes out once its name is read and its arguments as they grow (JSON:
    characters; pythonic: each call once its parenthesis closes), before the output ends."""
    _, _, calls, deltas = _stream_pieces(name, text, 1)
    assert _joined(deltas) == [(c.name, c.arguments) for c in calls] and calls
    before_end = _joined(deltas[:-1])
    assert before_end == [(c.name, c.arguments) for c in calls], "everything was streamed before the end"
    pieces = [d for piece in deltas for d in piece if "id" not in d["tool_calls"][0]]
    assert (len(pieces) > len(calls) * 3) == piecemeal


# -- the request edge, on the fake engine ------------------------------------------------------


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _client(engine: FakeEngine, parser: str | None = None) -> TestClient:
    return TestClient(build_app(engine, ServerSettings(tool_call_parser=parser)), raise_server_exceptions=False)


def _fn(**over: Any) -> dict[str, Any]:
    return {"type": "function", "function": {**ADD["function"], **over}}


BAD = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f"}, "extra": 1}]}, "tools[0].extra"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": ["add"]}, "tools[0]"),
    ({"tools": [_fn(name="bad name!")]}, "tools[0].function.name"),
    ({"tools": [_fn(name="f\n")]}, "tools[0].function.name"),  # "$" matched before a final newline
    ({"tools": [ADD, _fn()]}, "tools[1].function.name"),
    ({"tools": [_fn(parameters={"type": "objekt"})]}, "tools[0].function.parameters.type"),
    ({"tools": [_fn(parameters={"type": "string"})]}, "tools[0].function.parameters.type"),
    ({"tools": [_fn(parameters={"type": {}})]}, "tools[0].function.parameters.type"),  # was a 500
    ({"tools": [_fn(parameters={"type": ["object", []]})]}, "tools[0].function.parameters.type"),
    ({"tools": [_fn(parameters=[1])]}, "tools[0].function.parameters"),
    (
        {"tools": [_fn(parameters={"type": "object", "properties": {"a": {"type": 5}}})]},
        "tools[0].function.parameters.properties.a.type",
    ),
    (
        {"tools": [_fn(parameters={"type": "object", "properties": {"a": "int"}})]},
        "tools[0].function.parameters.properties.a",
    ),
    ({"tools": [_fn(parameters={"type": "object", "required": "a"})]}, "tools[0].function.parameters.required"),
    (
        {"tools": [_fn(parameters={"type": "object", "properties": {"xs": {"type": "array", "items": 3}}})]},
        "tools[0].function.parameters.properties.xs.items",
    ),
    (
        {"tools": [_fn(parameters={"type": "object", "properties": {"x": {"anyOf": []}}})]},
        "tools[0].function.parameters.properties.x.anyOf",
    ),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tool_choice": "required"}, "tool_choice"),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": "x",
                    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}],
                }
            ]
        },
        "messages[0].tool_calls",
    ),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c1"}]}, "messages[0].tool_call_id"),
    (
        {
            "messages": [
                {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add"}}]}
            ]
        },
        "messages[0].tool_calls[0].function.arguments",
    ),
]


@pytest.mark.parametrize("body,param", BAD, ids=[p for _, p in BAD])
def test_bad_tool_input_is_a_400_naming_the_field(fake_engine, body, param):
    with _client(fake_engine, "hermes") as c:
        r = c.post("/v1/chat/completions", json={**CHAT, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert not fake_engine.live


def test_auto_without_a_parser_names_the_flag(fake_engine):
    with _client(fake_engine) as c:
        for body in ({**CHAT, "tools": TOOLS}, {**CHAT, "tools": TOOLS, "tool_choice": "auto"}):
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
            assert "--tool-call-parser" in r.json()["error"]["message"]
        r = c.post("/v1/chat/completions", json={**CHAT, "tools": TOOLS, "tool_choice": "none"})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "abcd"


class _RecordingEngine(FakeEngine):
    def __init__(self) -> None:
        super().__init__()
        self.rendered: list[tuple[list[dict[str, Any]], dict[str, Any]]] = []

    def render_chat(self, messages, add_generation_prompt=True, **kw):
        self.rendered.append((messages, kw))
        return super().render_chat(messages, add_generation_prompt)


def test_the_template_gets_the_tools_and_the_calls_as_objects():
    engine = _RecordingEngine()
    msgs = [
        {"role": "user", "content": "add 1 and 2"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]
    with _client(engine, "hermes") as c:
        r = c.post("/v1/chat/completions", json={**CHAT, "messages": msgs, "tools": TOOLS})
    assert r.status_code == 200, r.text
    messages, kw = engine.rendered[-1]
    assert kw["tools"] == TOOLS
    assert messages[1]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 1, "b": 2}}
    assert messages[2] == {"role": "tool", "content": "3", "tool_call_id": "call_1"}
    # free text under 'auto': no calls found, plain content, an empty call list
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "abcd" and choice["message"]["tool_calls"] == []


def test_tool_call_parser_flag():
    for name in PARSERS:
        assert settings_from_namespace(build_parser().parse_args(["--tool-call-parser", name])).tool_call_parser == name
    assert settings_from_namespace(build_parser().parse_args([])).tool_call_parser is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--tool-call-parser", "nope"])


# -- the real server, the real client ----------------------------------------------------------


@pytest.fixture(scope="module")
def tool_server(open_servers: SharedServer) -> ServerProcess:
    """The shared server without a key (tests/conftest.py), started with --tool-call-parser hermes."""
    return open_servers.get()


@pytest.fixture(scope="module")
def client(tool_server):
    return openai.OpenAI(base_url=tool_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _calls(message: Any) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and len(call.id) > 8
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, PARAMS[call.function.name])
        out.append((call.function.name, args))
    return out


def _streamed(client, model, **kw) -> tuple[str, list[tuple[str, dict[str, Any]]], str | None]:
    """(content, calls, finish_reason) reassembled from the chunks as a client would."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=model, stream=True, **kw):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for d in ch.delta.tool_calls or []:
            if d.id is not None:  # a call's first delta: index, id, type, name, empty arguments
                assert d.index not in calls and d.type == "function" and d.function.arguments == ""
                calls[d.index] = [d.function.name, ""]
            else:
                calls[d.index][1] += d.function.arguments
        finish = ch.finish_reason or finish
    return content, [(name, json.loads(args)) for _, (name, args) in sorted(calls.items())], finish


PROMPTS = ["What is the weather in Paris?", "Please add 17 and 25."]


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize(
    "choice,parallel", [("required", True), ("required", False), ("get_weather", None), ("add", False)]
)
def test_enforced_calls_always_parse_and_match_the_schema(client, model, prompt, choice, parallel):
    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    kw = dict(
        messages=[{"role": "user", "content": prompt}],
        tools=TOOLS,
        tool_choice=tool_choice,
        max_tokens=80,
        temperature=0,
        **extra,
    )
    r = client.chat.completions.create(model=model, **kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    assert ch.message.content is None
    calls = _calls(ch.message)
    assert calls
    if choice != "required":
        assert [name for name, _ in calls] == [choice]
    if parallel is False:
        assert len(calls) == 1
    assert _streamed(client, model, **kw) == ("", calls, "tool_calls")


def test_enforced_call_arguments_arrive_as_they_are_generated(client, model):
    """The real model writing a named call: its arguments come in many deltas, each in a
    chunk before the one that finishes the choice, and join to the non-streamed arguments."""
    kw = dict(
        messages=[{"role": "user", "content": PROMPTS[0]}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=80,
        temperature=0,
    )
    plain = client.chat.completions.create(model=model, **kw).choices[0].message.tool_calls[0].function.arguments
    pieces, finished_at = [], None
    for i, chunk in enumerate(client.chat.completions.create(model=model, stream=True, **kw)):
        for ch in chunk.choices:
            pieces += [(i, d.function.arguments) for d in ch.delta.tool_calls or [] if d.function.arguments]
            finished_at = i if ch.finish_reason else finished_at
    assert "".join(a for _, a in pieces) == plain
    assert len(pieces) >= 3 and sum(i < finished_at for i, _ in pieces) >= len(pieces) - 1


HERMES = '<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call>'


@pytest.mark.parametrize("prefix", ["", "Adding now. "])
def test_auto_reads_hermes_calls_in_real_output(client, model, prefix):
    """The model is made to write a hermes block (a choice constraint), and the server's
    parser turns it into a call, streamed or not."""
    kw = dict(
        messages=[{"role": "user", "content": "Please add 17 and 25."}],
        tools=TOOLS,
        tool_choice="auto",
        max_tokens=120,
        temperature=0,
        extra_body={"structured_outputs": {"choice": [prefix + HERMES]}},
    )
    ch = client.chat.completions.create(model=model, **kw).choices[0]
    assert ch.finish_reason == "tool_calls", ch
    assert ch.message.content == (prefix or None)
    assert _calls(ch.message) == [("add", {"a": 17, "b": 25})]
    assert _streamed(client, model, **kw) == (prefix, [("add", {"a": 17, "b": 25})], "tool_calls")


def test_auto_free_text_stays_content(client, model):
    kw = dict(messages=[{"role": "user", "content": "Say hello."}], tools=TOOLS, max_tokens=8, temperature=0)
    ch = client.chat.completions.create(model=model, **kw).choices[0]
    assert not ch.message.tool_calls and ch.message.content and ch.finish_reason in ("stop", "length")
    content, calls, finish = _streamed(client, model, **kw)
    assert (content, calls, finish) == (ch.message.content, [], ch.finish_reason)


def test_tool_result_round_trip(tool_server, client, model):
    """An assistant turn with tool_calls and the tool's answer render through the model's
    template (the answer is in the prompt) and the conversation continues."""
    msgs = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc123",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc123", "content": "sunny and 21 degrees"},
    ]
    base = tool_server.base_url
    ids = httpx.post(base + "/tokenize", json={"messages": msgs}, timeout=TIMEOUT).json()["tokens"]
    prompt = httpx.post(base + "/detokenize", json={"tokens": ids}, timeout=TIMEOUT).json()["prompt"]
    assert "sunny and 21 degrees" in prompt and prompt.index("Paris") < prompt.index("sunny and 21 degrees")
    r = client.chat.completions.create(
        model=model, messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    assert r.choices[0].message.content and r.usage.prompt_tokens == len(ids)


def test_invalid_schema_for_an_enforced_call_is_a_400(client, model):
    bad = _fn(parameters={"type": "object", "properties": {"a": {"type": "string", "pattern": "(unclosed"}}})
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], tools=[bad], tool_choice="required", max_tokens=4
        )
    assert e.value.body["param"] == "tools", e.value.body


def test_an_enforced_call_cut_short_is_a_partial_call_never_content(client, model):
    """Cut by max_tokens, a forced call is the call as far as it was written (OpenAI's 'length'
    finish), streamed or not; the grammar's call format was returned as the message content."""
    kw = dict(
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
    )
    whole = client.chat.completions.create(model=model, max_tokens=80, **kw).choices[0].message.tool_calls[0]
    ch = client.chat.completions.create(model=model, max_tokens=12, **kw).choices[0]
    assert ch.finish_reason == "length" and ch.message.content is None, ch
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_weather" and whole.function.arguments.startswith(call.function.arguments)
    content, names, args, finish = "", [], "", None
    for chunk in client.chat.completions.create(model=model, max_tokens=12, stream=True, **kw):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            names += [d.function.name] if d.function.name else []
            args += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (content, names, args, finish) == ("", ["get_weather"], call.function.arguments, "length")
    # cut by a stop string: 'stop' with the string, never 'tool_calls' for a call that is not whole
    for stream in (False, True):
        kw_stop = dict(max_tokens=80, stop=["}"], **kw)
        if stream:
            chunks = [c for c in client.chat.completions.create(model=model, stream=True, **kw_stop) if c.choices]
            finish = next(c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason)
        else:
            finish = client.chat.completions.create(model=model, **kw_stop).choices[0].finish_reason
        assert finish == "stop", (stream, finish)


DEFS_PARAMS = {  # a schema with its own definitions, as pydantic writes one for nested models
    "type": "object",
    "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    "properties": {"place": {"$ref": "#/$defs/Place"}, "days": {"type": "integer"}},
    "required": ["place", "days"],
}


@pytest.mark.parametrize("choice,parallel", [("required", True), ("required", False), ("forecast", None)])
def test_parameters_with_their_own_definitions_are_enforced(client, model, choice, parallel):
    """A tool's "#/$defs/..." references point into its parameters, which an enforced call nests
    inside its own schema: they were a 400 ("Cannot find field '$defs'")."""
    tools = [_fn(name="forecast", parameters=DEFS_PARAMS), *TOOLS]
    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "The weather in Paris for 3 days?"}],
        tools=tools,
        tool_choice=tool_choice,
        max_tokens=80,
        temperature=0,
        **extra,
    )
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls, r
    for call in calls:
        args = json.loads(call.function.arguments)
        params = DEFS_PARAMS if call.function.name == "forecast" else PARAMS[call.function.name]
        jsonschema.validate(args, params)


_PIECES = st.sampled_from(
    [
        "<tool_call>",
        "</tool_call>",
        "<|python_tag|>",
        "{",
        "}",
        "[",
        "]",
        "(",
        ")",
        '"name"',
        '"arguments"',
        '"parameters"',
        ":",
        ",",
        "=",
        "f",
        "a",
        "1",
        '"x"',
        " ",
        "\n",
        ";",
    ]
)


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(sorted(PARSERS)),
    pieces=st.lists(_PIECES | st.text(max_size=3), max_size=40),
    step=st.integers(1, 9),
)
def test_parsers_never_raise_and_streaming_agrees(name, pieces, step):
    text = "".join(pieces)
    content, calls = PARSERS[name]().extract(text)
    assert calls or content == text
    for c in calls:
        assert isinstance(json.loads(c.arguments), dict)
    shown, rest, got, deltas = _stream_pieces(name, text, step)
    assert got == calls
    assert shown + rest == text if not calls else (shown + rest).strip() == (content or "").strip()
    if calls:
        assert _joined(deltas) == [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("parameters", [None, {}])
def test_a_function_without_parameters_is_called_with_no_arguments(parameters):
    """Empty parameters, like none, are a function of no arguments (as vLLM reads {}): a forced
    call's arguments are {}, where {} as a schema let them be any JSON value."""
    from aiolm.server.protocol import ChatCompletionRequest
    from aiolm.server.tools import plan_tools

    tool = {"type": "function", "function": {"name": "now", "parameters": parameters}}
    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [tool], "tool_choice": "required"}
    )
    schema = json.loads(plan_tools(req, None).enforced.text)
    assert schema["items"]["properties"]["arguments"] == {"type": "object", "properties": {}}
