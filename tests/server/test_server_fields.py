"""No silent ignoring: every request field is either implemented, a documented no-op, or a 400.

Runs on the fake engine (no model); the real-client check is in test_server_openai.py.
"""

from __future__ import annotations

import logging

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import FakeEngine
from starlette.testclient import TestClient

from aiolm.server import build_app
from aiolm.server.settings import ServerSettings, build_parser, settings_from_namespace

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}

# Real OpenAI / vLLM fields this server does not implement, and made-up ones: each must be refused.
UNKNOWN = [
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {**CHAT, "function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {**CHAT, "audio": {"voice": "alloy"}}, "audio"),
    ("/v1/chat/completions", {**CHAT, "prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("/v1/chat/completions", {**CHAT, "reasoning_effort": "low"}, "reasoning_effort"),
    ("/v1/chat/completions", {**CHAT, "web_search_options": {}}, "web_search_options"),
    ("/v1/chat/completions", {**CHAT, "vllm_xargs": {"a": 1}}, "vllm_xargs"),
    ("/v1/chat/completions", {**CHAT, "temprature": 0.5}, "temprature"),
    ("/v1/chat/completions", {**CHAT, "frobnicate": None}, "frobnicate"),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]}]},
        "messages[0].content[0].cache_control",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "stream": True, "stream_options": {"include_usage": True, "x": 1}},
        "stream_options.x",
    ),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "text", "y": 2}}, "response_format.y"),
    ("/v1/completions", {**COMPLETION, "prompt_embeds": "AAAA"}, "prompt_embeds"),
    ("/v1/completions", {**COMPLETION, "vllm_xargs": {"a": 1}}, "vllm_xargs"),
    ("/v1/completions", {**COMPLETION, "messages": []}, "messages"),
    ("/tokenize", {"prompt": "hi", "return_tokens": True}, "return_tokens"),
    ("/detokenize", {"tokens": [104], "skip_special_tokens": True}, "skip_special_tokens"),
]


def _client(engine: FakeEngine, **settings) -> TestClient:
    return TestClient(build_app(engine, ServerSettings(**settings)), raise_server_exceptions=False)


@pytest.mark.parametrize("path,body,param", UNKNOWN, ids=[p for _, _, p in UNKNOWN])
def test_unknown_field_is_a_400_naming_it(fake_engine, path, body, param):
    with _client(fake_engine) as c:
        r = c.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "unrecognized_argument", err
    assert repr(param) in err["message"] and "Unrecognized request argument" in err["message"]
    assert not fake_engine.live and fake_engine.stats["prompt_tokens"] == 0


def test_several_unknown_fields_are_all_named(fake_engine):
    with _client(fake_engine) as c:
        r = c.post("/v1/chat/completions", json={**CHAT, "aa": 1, "bb": 2})
    err = r.json()["error"]
    assert r.status_code == 400 and "'aa'" in err["message"] and "'bb'" in err["message"]


def test_lenient_fields_logs_a_warning_instead(fake_engine, caplog):
    with caplog.at_level(logging.WARNING, logger="aiolm.server"), _client(fake_engine, lenient_fields=True) as c:
        r = c.post(
            "/v1/chat/completions",
            json={
                **CHAT,
                "reasoning_effort": "low",
                "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "x": 1}]}],
            },
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "ab"
        spec = c.get("/openapi.json").json()["components"]["schemas"]["ChatCompletionRequest"]
    warned = " ".join(rec.getMessage() for rec in caplog.records if rec.name == "aiolm.server")
    assert "'reasoning_effort'" in warned and "'messages[0].content[0].x'" in warned
    assert "additionalProperties" not in spec  # documented as open when the server is lenient


def test_lenient_fields_flag():
    ns = build_parser().parse_args(["--lenient-fields"])
    assert settings_from_namespace(ns).limits.lenient is True
    assert settings_from_namespace(build_parser().parse_args([])).limits.lenient is False


NOOPS = [
    ("store", True),
    ("metadata", {"k": "v"}),
    ("service_tier", "auto"),
    ("user", "u"),
    ("safety_identifier", "s"),
    ("prompt_cache_key", "p"),
    ("parallel_tool_calls", False),
    ("tool_choice", "none"),
    ("tool_choice", "auto"),
    ("modalities", ["text"]),
]


@pytest.mark.parametrize("field,value", NOOPS, ids=[f"{f}={v}" for f, v in NOOPS])
def test_openai_fields_that_do_not_apply_are_accepted_no_ops(fake_engine, field, value):
    with _client(fake_engine) as c:
        plain = c.post("/v1/chat/completions", json=CHAT).json()["choices"]
        r = c.post("/v1/chat/completions", json={**CHAT, field: value})
        assert r.status_code == 200, r.text
        assert r.json()["choices"] == plain
        spec = c.get("/openapi.json").json()["components"]["schemas"]["ChatCompletionRequest"]
    if field not in ("tool_choice", "modalities", "parallel_tool_calls"):
        assert "no effect" in spec["properties"][field]["description"]


def test_noop_fields_on_completions(fake_engine):
    with _client(fake_engine) as c:
        r = c.post(
            "/v1/completions",
            json={**COMPLETION, "store": False, "metadata": {}, "user": "u", "service_tier": "default"},
        )
        assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "body,param",
    [
        ({**CHAT, "tool_choice": "required"}, "tool_choice"),
        ({**CHAT, "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        ({**CHAT, "modalities": ["text", "audio"]}, "modalities"),
        ({**CHAT, "modalities": ["audio"]}, "modalities[0]"),
        ({**CHAT, "metadata": {"k": 1}}, "metadata"),
    ],
)
def test_no_op_fields_still_refuse_what_they_cannot_do(fake_engine, body, param):
    with _client(fake_engine) as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("path,base", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_stream_options_needs_stream(fake_engine, path, base):
    with _client(fake_engine) as c:
        for extra in ({}, {"stream": False}):
            r = c.post(path, json={**base, **extra, "stream_options": {"include_usage": True}})
            assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text
            assert "only allowed when 'stream' is enabled" in r.json()["error"]["message"]
        r = c.post(path, json={**base, "stream": True, "stream_options": {"include_usage": True}})
        assert r.status_code == 200 and '"usage": {"prompt_tokens"' in r.text.replace('":{', '": {')


def test_openapi_says_unknown_fields_are_refused(fake_engine):
    with _client(fake_engine) as c:
        schemas = c.get("/openapi.json").json()["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest", "TokenizeRequest", "DetokenizeRequest"):
        assert schemas[name]["additionalProperties"] is False, name
    one_conversation = schemas["ChatCompletionRequest"]["properties"]["messages"]["oneOf"][0]  # or a batch of them
    ref = one_conversation["items"]["$ref"]
    msg = schemas[ref.rsplit("/", 1)[1]]  # nested objects are components of their own
    # a message's own fields beyond OpenAI's go to the chat template, as vLLM passes them
    assert msg["additionalProperties"] is True and "refusal" in msg["properties"]


def test_max_logprobs_bounds_every_endpoint(fake_engine):
    with _client(fake_engine, max_logprobs=3) as c:
        r = c.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
        r = c.post("/v1/completions", json={**COMPLETION, "logprobs": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
        assert c.post("/v1/completions", json={**COMPLETION, "logprobs": 3}).status_code == 200
        props = c.get("/openapi.json").json()["components"]["schemas"]["CompletionRequest"]["properties"]
        assert props["logprobs"]["anyOf"][0]["maximum"] == 3
    ns = build_parser().parse_args(["--max-logprobs", "7"])
    assert settings_from_namespace(ns).limits.max_logprobs == 7


def _sse(text: str) -> list[dict]:
    import json

    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_return_token_ids(fake_engine):
    with _client(fake_engine) as c:
        r = c.post("/v1/completions", json={**COMPLETION, "return_token_ids": True}).json()
        assert r["choices"][0]["prompt_token_ids"] == [ord("h"), ord("i")]
        assert r["choices"][0]["token_ids"] == [ord("a"), ord("b")]
        plain = c.post("/v1/completions", json=COMPLETION).json()["choices"][0]
        assert plain["prompt_token_ids"] is None and plain["token_ids"] is None  # keys present, null
        chat = c.post("/v1/chat/completions", json={**CHAT, "return_token_ids": True}).json()
        rendered = [ord(ch) for ch in "<user>hi<assistant>"]
        assert chat["prompt_token_ids"] == rendered and chat["choices"][0]["token_ids"] == [ord("a"), ord("b")]
        assert c.post("/v1/chat/completions", json=CHAT).json()["prompt_token_ids"] is None
        events = _sse(
            c.post("/v1/completions", json={**COMPLETION, "stream": True, "n": 2, "return_token_ids": True}).text
        )
        for i in (0, 1):
            mine = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == i]
            assert mine[0]["prompt_token_ids"] == [ord("h"), ord("i")]
            assert all(m["prompt_token_ids"] is None for m in mine[1:])
            assert sum((m["token_ids"] for m in mine), []) == fake_engine_tokens(i, 2)
        events = _sse(c.post("/v1/chat/completions", json={**CHAT, "stream": True, "return_token_ids": True}).text)
        assert events[0]["prompt_token_ids"] == rendered
        assert sum((e["choices"][0].get("token_ids", []) for e in events if e["choices"]), []) == [97, 98]


def fake_engine_tokens(seq: int, n: int) -> list[int]:
    """What FakeEngine generates for sequence ``seq``: 'a' + (step + seq) % 26 per step."""
    return [ord("a") + (step + seq) % 26 for step in range(n)]


def test_allowed_token_ids_and_bad_words_reach_the_engine(fake_engine, monkeypatch):
    seen = []
    add = fake_engine.add_request

    async def spy(prompt, params, *a, **kw):
        seen.append((params.allowed_token_ids, params.bad_words_token_ids))
        return await add(prompt, params, *a, **kw)

    monkeypatch.setattr(fake_engine, "add_request", spy)
    with _client(fake_engine) as c:
        r = c.post("/v1/completions", json={**COMPLETION, "allowed_token_ids": [97, 98], "bad_words": ["ab", " c"]})
        assert r.status_code == 200, r.text
    # one char per token in the fake tokenizer: "ab", " ab" and " c" (already spaced: once)
    assert seen == [([97, 98], [[97, 98], [32, 97, 98], [32, 99]])]


@pytest.mark.parametrize("path,base", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_continuous_usage_stats(fake_engine, path, base):
    with _client(fake_engine) as c:
        events = _sse(
            c.post(
                path,
                json={
                    **base,
                    "stream": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                },
            ).text
        )
        counts = [e["usage"]["completion_tokens"] for e in events]
        assert counts == sorted(counts) and counts[-1] == 2 and all(e["usage"]["prompt_tokens"] > 0 for e in events)
        plain = _sse(c.post(path, json={**base, "stream": True, "stream_options": {"include_usage": True}}).text)
        assert all(e["usage"] is None for e in plain[:-1]) and plain[-1]["usage"]["completion_tokens"] == 2


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
_BASES = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": COMPLETION,
    "/v1/responses": {"input": "hi"},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [104]},
}


@pytest.mark.parametrize("path", sorted(_BASES))
def test_any_json_in_any_field_is_answered_never_a_500(path):
    """Whatever JSON a documented field gets, the answer is a success or a 4xx naming that field."""
    engine = FakeEngine()
    with _client(engine) as c:
        fields = sorted(
            c.get("/openapi.json").json()["components"]["schemas"][
                {
                    "/v1/chat/completions": "ChatCompletionRequest",
                    "/v1/completions": "CompletionRequest",
                    "/v1/responses": "ResponsesRequest",
                    "/tokenize": "TokenizeRequest",
                    "/detokenize": "DetokenizeRequest",
                }[path]
            ]["properties"]
        )

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
        @given(field=st.sampled_from(fields), value=_JSON)
        def check(field, value):
            r = c.post(path, json={**_BASES[path], field: value})
            assert r.status_code in (200, 400, 404), (field, value, r.text)
            if r.status_code != 200:
                err = r.json()["error"]
                assert err["param"] and err["message"], (field, value, err)

        check()
    assert not engine.live


HUGE = int("9" * 4300)  # the most digits a JSON integer may have here (Python's int-to-str limit)


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": HUGE}, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": HUGE}, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": HUGE}, "max_completion_tokens"),
        ("/v1/responses", {"input": "hi", "max_output_tokens": HUGE}, "max_output_tokens"),
        (
            "/v1/messages",
            {"model": "fake-model", "max_tokens": HUGE, "messages": [{"role": "user", "content": "hi"}]},
            "max_tokens",
        ),
        ("/v1/completions", {**COMPLETION, "bad_words": ["w" * 1025]}, "bad_words[0]"),
        ("/v1/completions", {**COMPLETION, "bad_words": ["w" * 1000] * 5}, "bad_words"),
        ("/v1/completions", {**COMPLETION, "stop_token_ids": [5] * 1025}, "stop_token_ids"),
        ("/v1/completions", {**COMPLETION, "logit_bias": {"05": 1}}, "logit_bias"),
        ("/v1/completions", {**COMPLETION, "logit_bias": {" 5": 1}}, "logit_bias"),
        ("/v1/completions", {**COMPLETION, "logit_bias": {"1_0": 1}}, "logit_bias"),
        ("/v1/completions", {**COMPLETION, "logit_bias": {"\u0663": 1}}, "logit_bias"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_client_sized_values_are_400s_naming_the_field(fake_engine, path, body, param):
    """A 4,300-digit max_tokens was a 500 (its sum with the prompt's length is past what str()
    takes); bad words are bounded as stop strings are (each was tokenized twice on the event
    loop, seconds for megabytes); logit_bias keys are plain token ids ("05" and "5" would name
    one token twice, the last value winning)."""
    with _client(fake_engine) as c:
        r = c.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    if path == "/v1/messages":  # Anthropic's error body names no param
        assert err["type"] == "invalid_request_error" and len(r.content) < 2000, err
    else:
        assert err["param"] == param and len(r.content) < 2000, err
    assert not fake_engine.live


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", {**CHAT, "thinking_token_budget": 10}),
        ("/v1/chat/completions", {**CHAT, "thinking_token_budget": -2}),
        ("/v1/chat/completions", {**CHAT, "thinking_token_budget": 10, "use_beam_search": True}),
        (
            "/v1/messages",
            {
                "model": "fake-model",
                "max_tokens": 4000,
                "messages": [{"role": "user", "content": "hi"}],
                "thinking": {"type": "enabled", "budget_tokens": 2000},
            },
        ),
    ],
)
def test_thinking_needs_a_reasoning_parser(fake_engine, path, body):
    """Without --reasoning-parser the server cannot tell the thinking's end: a budget is a 400."""
    with _client(fake_engine) as c:
        r = c.post(path, json=body)
    assert r.status_code == 400 and "thinking" in r.json()["error"]["message"], r.text
    assert not fake_engine.live


def test_the_models_sampling_defaults_fill_what_a_request_leaves_out(fake_engine, monkeypatch):
    """vLLM's --generation-config auto: temperature, top_p, top_k, min_p and
    repetition_penalty a request leaves out are the model's generation_config.json's, on
    chat, completions, Responses and Anthropic's Messages; a value the client gives wins."""
    seen = []
    add = fake_engine.add_request

    async def spy(prompt, params, *a, **kw):
        seen.append((params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty))
        return await add(prompt, params, *a, **kw)

    monkeypatch.setattr(fake_engine, "add_request", spy)
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}
    monkeypatch.setattr(fake_engine, "sampling_defaults", defaults)
    model = (0.6, 0.95, 20, 0.05, 1.1)
    with _client(fake_engine) as c:
        assert c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2}).status_code == 200
        assert c.post("/v1/completions", json={**COMPLETION, "temperature": 0.2, "top_k": 5}).status_code == 200
        r = c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2})
        assert r.status_code == 200 and (r.json()["temperature"], r.json()["top_p"]) == (0.6, 0.95)
        messages = {"model": fake_engine.model_name, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        messages["top_p"] = 0.5
        assert c.post("/v1/messages", json=messages).status_code == 200
    assert seen[0] == model
    assert seen[1] == (0.2, 0.95, 5, 0.05, 1.1)  # the client's temperature and top_k win
    assert seen[2] == model  # Responses has no top_k, min_p or repetition_penalty fields: the model's
    assert seen[3] == (0.6, 0.5, 20, 0.05, 1.1)


def test_sampling_defaults_read_from_a_generation_config():
    from aiolm.params import sampling_defaults

    gen = {"do_sample": True, "temperature": 0.7, "top_k": 0, "top_p": 2.0, "min_p": None, "max_new_tokens": 9}
    assert sampling_defaults(gen) == {"temperature": 0.7, "top_k": -1}  # a top_p SamplingParams refuses is left out


def test_truncating_a_prompt_keeps_its_bos():
    """A left cut keeps the tokenizer's leading special tokens, as the tokenizer's own cut
    does (slicing the ids dropped a Llama prompt's BOS)."""
    import asyncio

    from aiolm.server.generation import Truncation, tokenize

    class WithBos:
        def prompt_too_long(self, text):
            return None

        def clip_prompt(self, text, keep_end):
            return text

        def tokenize(self, text, add_special_tokens=True):
            return ([1] if add_special_tokens else []) + [ord(c) for c in text]

    engine = WithBos()
    assert asyncio.run(tokenize(engine, "abcdef", True, cut=Truncation(3, "left"))) == [1, ord("e"), ord("f")]
    assert asyncio.run(tokenize(engine, "abcdef", True, cut=Truncation(3, "right"))) == [1, ord("a"), ord("b")]
    assert asyncio.run(tokenize(engine, "abcdef", False, cut=Truncation(3, "left"))) == [ord(c) for c in "def"]
    assert asyncio.run(tokenize(engine, "ab", True, cut=Truncation(3, "left"))) == [1, ord("a"), ord("b")]
