"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the real
`anthropic` client against the shared keyed `aiolm serve` on the embedded model (greedy,
short), plus its error and stream paths on the fake engine."""

from __future__ import annotations

import json
import re
from typing import Any

import anthropic
import httpx
import pytest
from server_helpers import API_KEY, FakeEngine, ServerProcess
from starlette.testclient import TestClient

from aiolm.server import build_app
from aiolm.server.settings import ServerSettings

jsonschema = pytest.importorskip("jsonschema")

TIMEOUT = 180.0
GREEDY = {"temperature": 0}  # sent as extra_body: recent clients dropped the sampling keywords
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"],
    },
}
ADD = {
    "name": "add",
    "description": "Add two integers",
    "input_schema": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
}
# Anthropic's stream: message_start, a ping, whole content blocks, message_delta, message_stop.
EVENT_ORDER = re.compile(
    r"message_start ping (content_block_start (content_block_delta )+content_block_stop )*message_delta message_stop"
)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def model(server: ServerProcess) -> str:
    r = httpx.get(server.base_url + "/v1/models", headers={"authorization": f"Bearer {API_KEY}"}, timeout=TIMEOUT)
    return r.json()["data"][0]["id"]


def _ask(client: anthropic.Anthropic, model: str, **kw: Any) -> Any:
    kw.setdefault("messages", FRANCE)
    kw.setdefault("max_tokens", 24)
    return client.messages.create(model=model, extra_body=GREEDY, **kw)


def _text(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def _comparable(message: Any) -> dict[str, Any]:
    """What a streamed and a plain answer must share: everything but the ids, and the prompt
    tokens counted whole (how many the prefix cache served differs from request to request)."""
    blocks = [{k: v for k, v in b.to_dict(exclude_none=True).items() if k != "id"} for b in message.content]
    u = message.usage
    return {
        "content": blocks,
        "stop_reason": message.stop_reason,
        "stop_sequence": message.stop_sequence,
        "prompt_tokens": u.input_tokens + (u.cache_read_input_tokens or 0),
        "output_tokens": u.output_tokens,
    }


def _raw_events(server: ServerProcess, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(event: line, data) of each event of a streamed request, as sent."""
    events: list[tuple[str, dict[str, Any]]] = []
    name = None
    headers = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
    with httpx.stream("POST", server.base_url + "/v1/messages", json=body, headers=headers, timeout=TIMEOUT) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                assert name is not None, line
                events.append((name, json.loads(line[len("data: ") :])))
                name = None
    return events


# -- answers ------------------------------------------------------------------------------------


def test_a_plain_message_answers(client, model):
    m = _ask(client, model, max_tokens=32)
    assert m.type == "message" and m.role == "assistant" and m.model == model and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and "Paris" in m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    u = m.usage
    assert u.input_tokens + u.cache_read_input_tokens > 5 and 0 < u.output_tokens <= 32
    assert u.cache_creation_input_tokens == 0


def test_the_system_prompt_renders_and_answers_as_chat_does(server, client, model):
    """A system prompt (a string or text blocks) gives the prompt and the greedy answer of the
    chat request with that system message."""
    system = "You are a geography teacher. Answer in one short sentence."
    chat = httpx.post(
        server.base_url + "/v1/chat/completions",
        headers={"authorization": f"Bearer {API_KEY}"},
        json={"model": model, "messages": [{"role": "system", "content": system}, *FRANCE], "max_tokens": 24, **GREEDY},
        timeout=TIMEOUT,
    ).json()
    plain = _ask(client, model, system=system)
    blocks = _ask(client, model, system=[{"type": "text", "text": system}])
    bare = _ask(client, model)
    for m in (plain, blocks):
        assert _text(m) == chat["choices"][0]["message"]["content"]
        assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat["usage"]["prompt_tokens"]
    # without one the template writes its own default system prompt, which is another length
    assert bare.usage.input_tokens + bare.usage.cache_read_input_tokens != chat["usage"]["prompt_tokens"]


def test_stop_sequences_stop_and_name_the_sequence(client, model):
    full = _text(_ask(client, model, max_tokens=32))
    assert "Paris" in full
    m = _ask(client, model, max_tokens=32, stop_sequences=["nothing like this", "Paris"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "Paris"
    assert _text(m) == full[: full.index("Paris")]


def test_max_tokens_cuts_the_answer(client, model):
    m = _ask(client, model, max_tokens=3)
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None and m.usage.output_tokens == 3


def test_a_final_assistant_turn_is_continued(client, model):
    """Anthropic's prefill: the answer continues the final assistant text and does not repeat it."""
    prefill = [*FRANCE, {"role": "assistant", "content": "The capital of France is"}]
    m = _ask(client, model, messages=prefill, max_tokens=8)
    assert "Paris" in _text(m) and not _text(m).startswith("The capital")


# -- streaming ----------------------------------------------------------------------------------


def test_the_stream_is_anthropics_event_sequence(server, model):
    body = {"model": model, "messages": FRANCE, "max_tokens": 24, "stream": True, **GREEDY}
    events = _raw_events(server, body)
    assert all(name == data["type"] for name, data in events), events
    assert EVENT_ORDER.fullmatch(" ".join(name for name, _ in events)), [n for n, _ in events]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert all(d["type"] == "text_delta" for d in deltas) and "Paris" in "".join(d["text"] for d in deltas)
    end = events[-2][1]
    assert end["delta"]["stop_reason"] in ("end_turn", "max_tokens") and end["usage"]["output_tokens"] > 0


@pytest.mark.parametrize("extra", [{}, {"stop_sequences": ["Paris"]}, {"max_tokens": 4}])
def test_a_streamed_message_equals_the_plain_one(client, model, extra):
    kw = {"messages": FRANCE, "max_tokens": 24, **extra}
    plain = _ask(client, model, **kw)
    with client.messages.stream(model=model, extra_body=GREEDY, **kw) as stream:
        texts = list(stream.text_stream)
        streamed = stream.get_final_message()
    assert _comparable(streamed) == _comparable(plain)
    assert "".join(texts) == _text(plain)
    raw = client.messages.create(model=model, extra_body=GREEDY, stream=True, **kw)
    types = [event.type for event in raw]  # the client drops pings
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"], types


# -- tools --------------------------------------------------------------------------------------


def _tool_uses(message: Any) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for b in message.content:
        if b.type == "tool_use":
            assert b.id.startswith("toolu_") and len(b.id) > 10
            jsonschema.validate(b.input, {"get_weather": WEATHER, "add": ADD}[b.name]["input_schema"])
            out.append((b.name, b.input))
    return out


def test_tool_use_round_trip(client, model):
    """A named tool_choice makes the model call it with input that fits the schema (streamed
    alike); the tool_result sent back is in the prompt and the model answers in text."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = {"messages": ask, "tools": [WEATHER, ADD], "tool_choice": {"type": "tool", "name": "get_weather"}}
    m = _ask(client, model, max_tokens=80, **kw)
    assert m.stop_reason == "tool_use" and m.stop_sequence is None, m
    calls = _tool_uses(m)
    assert [name for name, _ in calls] == ["get_weather"] and [b.type for b in m.content] == ["tool_use"]
    with client.messages.stream(model=model, extra_body=GREEDY, max_tokens=80, **kw) as stream:
        events = list(stream)
        assert _comparable(stream.get_final_message()) == _comparable(m)
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert len(pieces) >= 3, "the input streams as it is generated"
    assert json.loads("".join(pieces)) == m.content[0].input

    use = m.content[0]
    result = {"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": "sunny, 21 C"}]}
    history = [*ask, {"role": "assistant", "content": [b.to_dict() for b in m.content]}]
    follow = [*history, {"role": "user", "content": [result]}]
    tools = {"tools": [WEATHER, ADD], "tool_choice": {"type": "none"}}
    answer = _ask(client, model, messages=follow, max_tokens=16, **tools)
    assert [b.type for b in answer.content] == ["text"] and _text(answer).strip()
    assert answer.stop_reason in ("end_turn", "max_tokens")
    without = client.messages.count_tokens(model=model, messages=[*history, {"role": "user", "content": "ok"}], **tools)
    counted = client.messages.count_tokens(model=model, messages=follow, **tools)
    assert counted.input_tokens == answer.usage.input_tokens + answer.usage.cache_read_input_tokens
    assert counted.input_tokens > without.input_tokens  # the result's text is in the prompt


@pytest.mark.parametrize("cut", [{"max_tokens": 12}, {"max_tokens": 80, "stop_sequences": ["}"]}])
def test_a_forced_call_cut_short_is_a_tool_use_block_never_text(client, model, cut):
    """A forced call that max_tokens or a stop sequence ends early is still a tool_use block,
    streamed or not; the grammar's call format was shown as text (and the stream sent both)."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = {"messages": ask, "tools": [WEATHER, ADD], "tool_choice": {"type": "any"}, **cut}
    m = _ask(client, model, **kw)
    assert [b.type for b in m.content] == ["tool_use"] and m.content[0].name == "get_weather", m
    assert m.stop_reason == ("stop_sequence" if "stop_sequences" in cut else "max_tokens"), m
    with client.messages.stream(model=model, extra_body=GREEDY, **kw) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.name) for b in final.content] == [("tool_use", "get_weather")], final
    assert final.stop_reason == m.stop_reason


def test_an_answer_dumped_by_the_sdk_goes_back_as_history(client, model):
    """model_dump() writes every field the SDK knows, null where unset (citations, caller,
    toolset_name): those were refused as unknown fields."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    said = _ask(client, model, max_tokens=8, messages=FRANCE)
    m = _ask(client, model, max_tokens=80, messages=ask, tools=[WEATHER], tool_choice={"type": "any"})
    use = m.content[0]
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}
    for history in (
        [*FRANCE, {"role": "assistant", "content": [b.model_dump() for b in said.content]}, *ask],
        [
            *ask,
            {"role": "assistant", "content": [b.model_dump() for b in m.content]},
            {"role": "user", "content": [result]},
        ],
    ):
        answer = _ask(client, model, max_tokens=4, messages=history, tools=[WEATHER], tool_choice={"type": "none"})
        assert answer.content and answer.content[0].type == "text", answer
    with pytest.raises(anthropic.BadRequestError):  # a citation itself is not taken
        cited = {"type": "text", "text": "Paris", "citations": [{"type": "char_location", "cited_text": "x"}]}
        _ask(client, model, max_tokens=4, messages=[*FRANCE, {"role": "assistant", "content": [cited]}, *ask])


def test_any_tool_without_parallel_use_calls_exactly_one(client, model):
    m = _ask(
        client,
        model,
        max_tokens=80,
        messages=[{"role": "user", "content": "Please add 17 and 25."}],
        tools=[WEATHER, ADD],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )
    assert m.stop_reason == "tool_use" and len(_tool_uses(m)) == 1


def test_count_tokens_is_the_prompt_of_a_real_request(server, client, model):
    """The count is the prompt a /v1/messages request runs, which /tokenize renders the same
    from the chat messages and tools."""
    kw = {
        "system": "Be brief.",
        "messages": FRANCE,
        "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather"},
    }
    counted = client.messages.count_tokens(model=model, **kw)
    m = _ask(client, model, max_tokens=40, **kw)
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens
    function = {"name": WEATHER["name"], "description": WEATHER["description"], "parameters": WEATHER["input_schema"]}
    chat = {
        "messages": [{"role": "system", "content": "Be brief."}, *FRANCE],
        "tools": [{"type": "function", "function": function}],
    }
    r = httpx.post(server.base_url + "/tokenize", headers={"x-api-key": API_KEY}, json=chat, timeout=TIMEOUT)
    assert r.json()["count"] == counted.input_tokens


# -- auth and errors ----------------------------------------------------------------------------


def test_x_api_key_is_accepted_and_a_wrong_key_is_an_anthropic_401(server, model):
    # Older clients send the key as x-api-key, newer ones as a bearer token: here it is only
    # right in x-api-key, whichever this client is.
    headers = {"x-api-key": API_KEY, "authorization": "Bearer wrong"}
    with anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, default_headers=headers, max_retries=0) as c:
        assert _text(_ask(c, model, max_tokens=4))
    r = httpx.post(
        server.base_url + "/v1/messages/count_tokens",
        headers={"x-api-key": API_KEY},
        json={"messages": FRANCE},
        timeout=TIMEOUT,
    )
    assert r.status_code == 200 and r.json()["input_tokens"] > 5
    with anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0) as wrong:
        with pytest.raises(anthropic.AuthenticationError) as e:
            _ask(wrong, model, max_tokens=4)
    assert e.value.status_code == 401 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "authentication_error" and "x-api-key" in e.value.body["error"]["message"]
    r = httpx.post(server.base_url + "/v1/messages", headers={"x-api-key": "wrong"}, json={}, timeout=TIMEOUT)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(server.base_url + "/v1/chat/completions", headers={"x-api-key": "wrong"}, json={}, timeout=TIMEOUT)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"  # OpenAI's shape there


BASE = {"messages": FRANCE, "max_tokens": 4}
BAD = [
    ("missing max_tokens", {"messages": FRANCE}, 400, "max_tokens"),
    ("max_tokens 0", {**BASE, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", {**BASE, "max_tokens": -5}, 400, "max_tokens"),
    ("max_tokens a string", {**BASE, "max_tokens": "4"}, 400, "max_tokens"),
    ("unknown field", {**BASE, "frobnicate": True}, 400, "frobnicate"),
    ("messages not a list", {**BASE, "messages": "hello"}, 400, "messages"),
    ("messages empty", {**BASE, "messages": []}, 400, "messages"),
    ("bad role", {**BASE, "messages": [{"role": "system", "content": "hi"}]}, 400, "messages[0].role"),
    ("image block", {**BASE, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, 400, "content[0]"),
    ("temperature above 1", {**BASE, "temperature": 1.5}, 400, "temperature"),
    (
        "tool_choice naming an unknown tool",
        {**BASE, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
        400,
        "tool_choice.name",
    ),
    ("tool_choice without tools", {**BASE, "tool_choice": {"type": "any"}}, 400, "tool_choice"),
    ("auto without a parser", {**BASE, "tools": [WEATHER]}, 400, "--tool-call-parser"),
    ("a tool twice", {**BASE, "tools": [ADD, ADD], "tool_choice": {"type": "any"}}, 400, "tools[1].name"),
    (
        "tool_use from the user",
        {
            **BASE,
            "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "add", "input": {}}]}],
        },
        400,
        "messages[0].content[0]",
    ),
    ("unknown model", {**BASE, "model": "claude-nope"}, 404, "claude-nope"),
    ("prompt too long", {**BASE, "messages": [{"role": "user", "content": "word " * 3000}]}, 400, "context length"),
]


@pytest.mark.parametrize("body,status,named", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_a_4xx_in_anthropics_shape(client, model, body, status, named):
    body = {"model": model, **body} if "model" not in body else body
    with pytest.raises(anthropic.APIStatusError) as e:
        client.post("/v1/messages", body=body, cast_to=httpx.Response)
    expected = anthropic.NotFoundError if status == 404 else anthropic.BadRequestError
    assert isinstance(e.value, expected) and e.value.status_code == status
    err = e.value.body
    assert set(err) == {"type", "error"} and err["type"] == "error", err
    assert err["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert named in err["error"]["message"], err


def test_count_tokens_refuses_generation_fields(client, model):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.post("/v1/messages/count_tokens", body={"model": model, **BASE}, cast_to=httpx.Response)
    assert "max_tokens" in e.value.body["error"]["message"]


# -- the fake engine: what a real model does not do on demand -----------------------------------


class _FailingEngine(FakeEngine):
    """Streams two tokens, then the engine fails."""

    async def stream(self, st):
        n = 0
        async for out in super().stream(st):
            yield out
            n += 1
            if n == 2:
                raise RuntimeError("the worker died")


def test_an_engine_failure_mid_stream_is_an_error_event():
    with TestClient(build_app(_FailingEngine(), ServerSettings()), raise_server_exceptions=False) as c:
        r = c.post("/v1/messages", json={**BASE, "max_tokens": 8, "stream": True})
    events = re.findall(r"event: (\S+)\ndata: (.*)\n", r.text)
    assert [n for n, _ in events[:3]] == ["message_start", "ping", "content_block_start"]
    name, data = events[-1]
    body = json.loads(data)
    assert name == "error" and body["type"] == "error"
    assert body["error"]["type"] == "api_error" and "the worker died" in body["error"]["message"]


def test_a_dead_engine_is_overloaded_and_a_missing_route_not_found(fake_engine):
    with TestClient(build_app(fake_engine, ServerSettings()), raise_server_exceptions=False) as c:
        fake_engine.dead = "gone"
        r = c.post("/v1/messages", json=BASE)
        assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error", r.text
        r = c.post("/v1/messages/batches", json=BASE)
        assert r.status_code == 404 and r.json() == {
            "type": "error",
            "error": {"type": "not_found_error", "message": "no route for POST /v1/messages/batches"},
        }
        r = c.get("/v1/messages")
        assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_bodies_from_the_schema_never_get_a_5xx(fake_engine):
    """Bodies drawn from /openapi.json's schemas of both routes, some with a field of any value
    added: an answer or a 4xx in Anthropic's shape, never a 5xx."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from server_helpers import from_schema, json_values

    with TestClient(build_app(fake_engine, ServerSettings()), raise_server_exceptions=False) as c:
        schemas = c.get("/openapi.json").json()["components"]["schemas"]
        routes = {"/v1/messages": "MessagesRequest", "/v1/messages/count_tokens": "CountTokensRequest"}
        cases = st.one_of(
            st.tuples(st.just(path), from_schema(schemas[name], defs=schemas), st.text(max_size=8), json_values())
            for path, name in routes.items()
        )

        @settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(cases, st.booleans())
        def check(case, extra):
            path, body, key, value = case
            body = {**body, key: value} if extra else body
            if isinstance(body.get("max_tokens"), int):
                body["max_tokens"] = min(body["max_tokens"], 4)
            body.pop("model", None)
            r = c.post(path, json=body)
            assert r.status_code < 500, (body, r.text)
            if r.status_code >= 400:
                assert r.json()["type"] == "error" and r.json()["error"]["message"], r.text

        check()
    assert not fake_engine.live
