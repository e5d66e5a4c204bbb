"""Fast server tests on a fake engine: validation, error bodies, HTTP edges, formats.

No model is loaded, so these run in seconds; the real-model behaviour is in
test_server_openai.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import httpx
import pytest
from server_helpers import FakeEngine, free_port
from starlette.testclient import TestClient

from aiolm.server import build_app
from aiolm.server.settings import ServerSettings, build_parser, from_environment, parse_serve_args

USAGE_4_12 = {  # the fake engine reports no prefix-cache hits
    "prompt_tokens": 4,
    "completion_tokens": 12,
    "total_tokens": 16,
    "prompt_tokens_details": {"cached_tokens": 0},
}


def _client(engine: FakeEngine, **settings) -> TestClient:
    return TestClient(build_app(engine, ServerSettings(**settings)), raise_server_exceptions=False)


def _assert_error(r: httpx.Response, status: int, param: str | None = "<any>") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param != "<any>":
        assert err["param"] == param, err
    return err


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

BAD_CHAT = [
    ({"messages": []}, "messages"),
    ({}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": 7, "content": "x"}]}, "messages[0].role"),
    ({**CHAT, "temperature": "hot"}, "temperature"),
    ({**CHAT, "temperature": -1}, "temperature"),
    ({**CHAT, "top_p": 0}, "top_p"),
    ({**CHAT, "top_p": 1.5}, "top_p"),
    ({**CHAT, "top_k": -2}, "top_k"),
    ({**CHAT, "min_p": 2}, "min_p"),
    ({**CHAT, "n": 0}, "n"),
    ({**CHAT, "n": 1000}, "n"),
    ({**CHAT, "n": True}, "n"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "max_tokens": 2.5}, "max_tokens"),
    ({**CHAT, "max_completion_tokens": -3}, "max_completion_tokens"),
    ({**CHAT, "seed": 2**64}, "seed"),
    ({**CHAT, "seed": "1"}, "seed"),
    ({**CHAT, "stop": 5}, "stop"),
    ({**CHAT, "stop": [""]}, "stop[0]"),
    ({**CHAT, "stop_token_ids": [-1]}, "stop_token_ids[0]"),
    ({**CHAT, "presence_penalty": 3}, "presence_penalty"),
    ({**CHAT, "frequency_penalty": -2.5}, "frequency_penalty"),
    ({**CHAT, "repetition_penalty": 0}, "repetition_penalty"),
    ({**CHAT, "logit_bias": {"5": 500}}, "logit_bias"),
    ({**CHAT, "logit_bias": {"abc": 1}}, "logit_bias"),
    ({**CHAT, "logprobs": 1}, "logprobs"),
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({**CHAT, "top_logprobs": 3}, "top_logprobs"),
    ({**CHAT, "stream": "yes"}, "stream"),
    ({**CHAT, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({**CHAT, "min_tokens": 9}, "min_tokens"),
    ({"messages": CHAT["messages"], "min_tokens": 5000}, "min_tokens"),
    ({**CHAT, "ignore_eos": "no"}, "ignore_eos"),
    ({**CHAT, "user": 7}, "user"),
    ({**CHAT, "response_format": {"type": "xml"}}, "response_format.type"),
    ({**CHAT, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({**CHAT, "tools": [{"type": "function"}]}, "tools[0].function"),
    ({**CHAT, "model": "gpt-4"}, "model"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]}, "messages[1].content"),
    ({"messages": [{"role": "system", "content": None}, {"role": "user", "content": "hi"}]}, "messages[0].content"),
]


@pytest.mark.parametrize("body,param", BAD_CHAT, ids=[p for _, p in BAD_CHAT])
def test_chat_validation_names_the_field(fake_engine, body, param):
    with _client(fake_engine) as c:
        r = c.post("/v1/chat/completions", json=body)
        _assert_error(r, 404 if param == "model" else 400, param)
    assert not fake_engine.live


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# (where the deep value goes, the field the 400 names: None for the body as a whole)
DEEP = [
    ('{"messages": [{"role": "user", "content": "hi"}], "x": %s}', None),
    ('{"messages": [{"role": "user", "content": "hi"}], "metadata": {"a": %s}}', None),
    ('{"messages": [{"role": "user", "content": "hi"}], "guided_json": %s}', "guided_json"),
    (
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"id": "a", '
        '"type": "function", "function": {"name": "f", "arguments": %s}}]}]}',
        "messages[1].tool_calls[0].function.arguments",
    ),
]


@pytest.mark.parametrize("depth", [200, 1800, 5000])
@pytest.mark.parametrize("template,param", DEEP, ids=[p or "body" for _, p in DEEP])
def test_deeply_nested_json_is_a_400_that_says_so(fake_engine, template, param, depth):
    """Valid JSON nested past the bound, in the body or in a JSON string field, is 'nested too
    deeply' naming where, never 'not valid JSON' and never a 500."""
    inner = json.dumps(_nested(depth)) if param else _nested(depth)
    with _client(fake_engine) as c:
        r = c.post("/v1/chat/completions", content=template % inner, headers={"content-type": "application/json"})
        err = _assert_error(r, 400, param)
    assert "nested too deeply (more than 128 levels" in err["message"], err
    assert "not valid JSON" not in err["message"] and "recursion" not in err["message"]
    assert not fake_engine.live


def test_json_at_the_nesting_bound_is_parsed(fake_engine):
    with _client(fake_engine) as c:  # the body's object and 127 lists: 128 levels, parsed
        r = c.post(
            "/tokenize",
            content='{"prompt": "hi", "x": ' + _nested(127) + "}",
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400 and "Unrecognized request argument supplied: 'x'" in r.text, r.text
        r = c.post(
            "/tokenize",
            content='{"prompt": "hi", "x": ' + _nested(128) + "}",
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400 and "nested too deeply" in r.text, r.text


def test_thousands_of_unknown_fields_are_one_short_400(fake_engine):
    """An error names the first few unknown fields and counts the rest (it listed all 200,000,
    megabytes of message), and a client's long model name comes back clipped."""
    body = {"prompt": "hi", **{f"k{i}": 1 for i in range(200_000)}}
    with _client(fake_engine) as c:
        r = c.post("/v1/completions", json=body)
        err = _assert_error(r, 400, "k0")
        assert err["code"] == "unrecognized_argument" and "'k7' and 199992 more" in err["message"], err
        assert len(r.content) < 1000
        r = c.post("/v1/completions", json={"prompt": "hi", "model": "m" * 100_000})
        err = _assert_error(r, 404, "model")
        assert "(100000 characters)" in err["message"] and len(r.content) < 1000, err
    assert not fake_engine.live


BAD_COMPLETION = [
    ({}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt[1]"),
    ({"prompt": [-1, 5]}, "prompt[0]"),
    ({"prompt": [[3], [4, -2]]}, "prompt[1][1]"),
    ({"prompt": [[5], [2**40]], "echo": True}, "prompt[1]"),
    ({"prompt": [[1], []]}, "prompt[1]"),
    ({"prompt": "x", "logprobs": True}, "logprobs"),
    ({"prompt": "x", "logprobs": 99}, "logprobs"),
    ({"prompt": "x", "echo": "y"}, "echo"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "suffix": "tail"}, "suffix"),
    ({"prompt": "", "max_tokens": 2}, "prompt"),
    ({"prompt": "x" * 300}, "prompt"),
    ({"prompt": "x" * 200, "max_tokens": 100}, "max_tokens"),
    ({"prompt": ["ok", "y" * 300]}, "prompt[1]"),
    ({"prompt": "x", "temperature": float("nan")}, "temperature"),
]


@pytest.mark.parametrize("body,param", BAD_COMPLETION, ids=[p for _, p in BAD_COMPLETION])
def test_completion_validation_names_the_field(fake_engine, body, param):
    with _client(fake_engine) as c:
        r = c.post(
            "/v1/completions", content=json.dumps(body, allow_nan=True), headers={"content-type": "application/json"}
        )
        err = _assert_error(r, 400, param)
        if "x" * 200 in json.dumps(body) or "y" * 300 in json.dumps(body):
            assert "maximum context length" in err["message"]
    assert not fake_engine.live


def test_http_edges_have_openai_error_bodies(fake_engine):
    with _client(fake_engine) as c:
        _assert_error(c.get("/nope"), 404)
        _assert_error(c.get("/v1/chat/completions"), 405)
        _assert_error(c.delete("/v1/models"), 405)
        _assert_error(c.post("/v1/completions", content=b"{bad", headers={"content-type": "application/json"}), 400)
        _assert_error(c.post("/v1/completions", content=b"", headers={"content-type": "application/json"}), 400)
        _assert_error(c.post("/v1/completions", content=b"[1,2]", headers={"content-type": "application/json"}), 400)
        _assert_error(c.post("/v1/completions", content=b"\xff\xfe", headers={"content-type": "application/json"}), 400)
        deep = b"[" * 100000
        _assert_error(c.post("/v1/completions", content=deep, headers={"content-type": "application/json"}), 400)
        _assert_error(
            c.post(
                "/v1/completions", content=b"prompt=x", headers={"content-type": "application/x-www-form-urlencoded"}
            ),
            415,
        )
        _assert_error(c.post("/tokenize", json={"prompt": "a", "messages": [{"role": "user", "content": "b"}]}), 400)
        _assert_error(c.post("/detokenize", json={"tokens": [-1]}), 400, "tokens[0]")
        _assert_error(c.get("/v1/models/other"), 404)


SURROGATES = [  # valid JSON, not valid Unicode: a 400 naming the field, never a 500
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
    ("/v1/completions", b'{"prompt": ["ok", "x\\udfffy"]}', "prompt[1]"),
    ("/v1/completions", b'{"prompt": "x", "stop": ["\xed\xa0\x80"]}', "stop[0]"),
    ("/tokenize", b'{"prompt": "\\uDBFF"}', "prompt"),
    ("/v1/completions", b'{"prompt": "x", "logit_bias": {"\\ud800": 1}}', "logit_bias.\\ud800"),
]


@pytest.mark.parametrize("path,body,param", SURROGATES, ids=[p for _, _, p in SURROGATES])
def test_lone_surrogates_are_a_400_naming_the_field(fake_engine, caplog, path, body, param):
    with _client(fake_engine) as c:
        err = _assert_error(c.post(path, content=body, headers={"content-type": "application/json"}), 400, param)
        assert err["code"] == "invalid_unicode" and "surrogate" in err["message"]
        # A valid pair is one character, not an error.
        ok = c.post(
            "/tokenize", content=b'{"prompt": "smile \\ud83d\\ude00"}', headers={"content-type": "application/json"}
        )
        assert ok.status_code == 200, ok.text
    assert "Traceback" not in caplog.text


def test_body_limit_is_413(fake_engine):
    with _client(fake_engine, max_request_bytes=1000) as c:
        big = {"prompt": "x" * 2000}
        _assert_error(c.post("/v1/completions", json=big), 413)

        def chunks():  # no Content-Length: the reader enforces the limit
            yield b'{"prompt": "'
            for _ in range(20):
                yield b"x" * 100
            yield b'"}'

        _assert_error(c.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}), 413)


def test_api_key(fake_engine):
    with _client(fake_engine, api_key="sekrit") as c:
        err = _assert_error(c.post("/v1/chat/completions", json=CHAT), 401)
        assert err["code"] == "invalid_api_key"
        _assert_error(c.get("/v1/models", headers={"authorization": "Bearer wrong"}), 401)
        for header in ("Bearer sekrit", "bearer sekrit", "BEARER  sekrit"):  # RFC 7235: any case
            assert c.get("/v1/models", headers={"authorization": header}).status_code == 200, header
        for header in ("Basic sekrit", "Bearersekrit", "sekrit", "Bearer sekri"):
            _assert_error(c.get("/v1/models", headers={"authorization": header}), 401)
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200


def test_request_id_echoed_or_made(fake_engine):
    with _client(fake_engine) as c:
        assert c.get("/health", headers={"x-request-id": "abc-123"}).headers["x-request-id"] == "abc-123"
        made = c.get("/health").headers["x-request-id"]
        assert len(made) >= 16
        assert c.get("/health", headers={"x-request-id": "bad id\twith spaces"}).headers["x-request-id"] != "bad id"


def test_cors(fake_engine):
    with _client(fake_engine, allowed_origins=["https://ui.example"], api_key="k") as c:
        r = c.options(
            "/v1/chat/completions",
            headers={
                "origin": "https://ui.example",
                "access-control-request-method": "POST",
                "access-control-request-headers": "authorization,content-type",
            },
        )
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://ui.example"
        r = c.get("/health", headers={"origin": "https://ui.example"})
        assert r.headers["access-control-allow-origin"] == "https://ui.example"
        r = c.get("/health", headers={"origin": "https://evil.example"})
        assert "access-control-allow-origin" not in r.headers


def test_chat_response_shape_and_usage(fake_engine):
    with _client(fake_engine) as c:
        r = c.post("/v1/chat/completions", json={**CHAT, "n": 2, "logprobs": True, "top_logprobs": 2})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
        assert [ch["index"] for ch in body["choices"]] == [0, 1]
        assert body["choices"][0]["message"] == {"role": "assistant", "content": "abcd"}
        assert body["choices"][1]["message"]["content"] == "bcde"
        assert body["choices"][0]["finish_reason"] == "length"
        lp = body["choices"][0]["logprobs"]["content"]
        assert [e["token"] for e in lp] == list("abcd")
        assert len(lp[0]["top_logprobs"]) == 2 and lp[0]["bytes"] == [97]
        prompt_len = len("<user>hi<assistant>")
        assert body["usage"] == {
            "prompt_tokens": prompt_len,
            "completion_tokens": 8,
            "total_tokens": prompt_len + 8,
            "prompt_tokens_details": {"cached_tokens": 0},
        }


def _events(r: httpx.Response) -> list:
    lines = [ln for ln in r.text.split("\n\n") if ln.strip()]
    assert all(ln.startswith("data: ") for ln in lines), lines
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


def test_chat_stream_format(fake_engine):
    with _client(fake_engine) as c:
        body = {**CHAT, "stream": True, "n": 2, "stream_options": {"include_usage": True}, "stop": "c"}
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            r.read()
        events = _events(r)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    text = {0: "", 1: ""}
    finish = {}
    for e in events[:-1]:
        assert e["usage"] is None
        for ch in e["choices"]:
            text[ch["index"]] += ch["delta"].get("content", "")
            if ch["finish_reason"]:
                finish[ch["index"]] = ch["finish_reason"]
    assert text == {0: "ab", 1: "b"} and finish == {0: "stop", 1: "stop"}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5


def test_completions_many_prompts_echo_logprobs(fake_engine):
    with _client(fake_engine) as c:
        body = {"prompt": ["hi", "ho"], "n": 2, "max_tokens": 3, "echo": True, "logprobs": 1}
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["object"] == "text_completion"
        assert [ch["index"] for ch in out["choices"]] == [0, 1, 2, 3]
        assert out["choices"][0]["text"] == "hiabc" and out["choices"][3]["text"] == "hobcd"
        lp = out["choices"][0]["logprobs"]
        assert lp["tokens"] == ["h", "i", "a", "b", "c"]
        assert lp["token_logprobs"][:2] == [None, None] and lp["token_logprobs"][2] == -0.5
        assert lp["text_offset"] == [0, 1, 2, 3, 4]
        assert out["usage"] == USAGE_4_12

        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        with c.stream("POST", "/v1/completions", json=body) as r:
            r.read()
        events = _events(r)
        texts = ["", "", "", ""]
        for e in events[:-1]:
            for ch in e["choices"]:
                texts[ch["index"]] += ch["text"]
        assert texts == ["hiabc", "hibcd", "hoabc", "hobcd"]
        assert events[-1]["usage"] == USAGE_4_12


def test_health_and_dead_engine(fake_engine):
    with _client(fake_engine) as c:
        assert c.get("/health").json() == {"status": "ok"}
        fake_engine.dead = "worker 0 exited with code -9"
        err = _assert_error(c.get("/health"), 503)
        assert "worker 0" in err["message"]
        _assert_error(c.post("/v1/chat/completions", json=CHAT), 503)
        assert "aiolm:engine_healthy{" in c.get("/metrics").text


def test_models_version_tokenize(fake_engine):
    with _client(fake_engine) as c:
        models = c.get("/v1/models").json()
        assert models["data"][0]["id"] == "fake-model"
        assert c.get("/v1/models/fake-model").json()["id"] == "fake-model"
        assert "version" in c.get("/version").json()
        t = c.post("/tokenize", json={"prompt": "hey"}).json()
        assert t["tokens"] == [104, 101, 121] and t["count"] == 3 and t["max_model_len"] == 256
        assert c.post("/detokenize", json={"tokens": t["tokens"]}).json() == {"prompt": "hey"}
        m = c.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}]}).json()
        assert m["count"] == len("<user>x<assistant>")


def test_metrics_exposition(fake_engine):
    """/metrics serves the engine's own registry; the gauges are read from the engine when scraped."""
    from prometheus_client.parser import text_string_to_metric_families

    with _client(fake_engine) as c:
        fake_engine.live["x"] = None  # one live request: the fake reports 1 running, 1% KV
        r = c.get("/metrics")
        fake_engine.live.clear()
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    labels = {"model_name": "fake-model", "engine": "0"}
    for name, kind, value in (
        ("aiolm:num_requests_running", "gauge", 1.0),
        ("aiolm:kv_cache_usage_perc", "gauge", 0.01),
        ("aiolm:engine_healthy", "gauge", 1.0),
        ("aiolm:prompt_tokens", "counter", 0.0),
    ):
        f = families[name]
        assert f.type == kind and f.samples[0].labels == labels and f.samples[0].value == value, f
    assert families["aiolm:inter_token_latency_seconds"].type == "histogram"


def test_openapi_describes_everything(fake_engine):
    with _client(fake_engine, api_key="k") as c:
        spec = c.get("/openapi.json").json()
    for path in (
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/health",
        "/version",
        "/tokenize",
        "/detokenize",
        "/metrics",
    ):
        assert path in spec["paths"], path
    chat = spec["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["required"] == ["messages"]
    for f in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stop_token_ids",
        "n",
        "max_tokens",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "logit_bias",
        "stream_options",
        "ignore_eos",
        "min_tokens",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "user",
    ):
        assert f in chat["properties"], f
    assert "echo" in spec["components"]["schemas"]["CompletionRequest"]["properties"]


def test_access_log_is_json(fake_engine, caplog):
    with caplog.at_level(logging.INFO, logger="aiolm.access"):
        with _client(fake_engine) as c:
            c.post(
                "/v1/completions",
                json={"prompt": "abc", "max_tokens": 2, "user": "u1"},
                headers={"x-request-id": "log-me"},
            )
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "aiolm.access"]
    line = next(ln for ln in lines if ln["request_id"] == "log-me")
    assert line["status"] == 200 and line["path"] == "/v1/completions" and line["method"] == "POST"
    assert line["prompt_tokens"] == 3 and line["completion_tokens"] == 2 and line["user"] == "u1"
    assert line["duration_ms"] >= 0


def test_settings_from_flags_env_and_config(tmp_path):
    parser = build_parser()
    flags = {a.option_strings[0] for a in parser._actions if a.option_strings}
    import dataclasses

    from aiolm.config import EngineArgs

    for f in dataclasses.fields(EngineArgs):
        assert "--" + f.name.replace("_", "-") in flags, f.name
    eargs, settings, _ = parse_serve_args(
        [
            "some/model.gguf",
            "--max-model-len",
            "512",
            "--api-key",
            "k",
            "--allowed-origins",
            "a.com, b.com",
            "--max-n",
            "4",
        ]
    )
    assert eargs.model == "some/model.gguf" and eargs.max_model_len == 512
    assert settings.api_key == "k" and settings.allowed_origins == ["a.com", "b.com"] and settings.max_n == 4
    assert eargs.scheduling_policy == "fcfs" and not settings.allow_request_priority
    # vLLM's JSON list form (taken as one origin named '["http://a.com"]', it matched none)
    _, settings, _ = parse_serve_args(["--allowed-origins", '["http://a.com", "*"]'])
    assert settings.allowed_origins == ["http://a.com", "*"]
    eargs, settings, _ = parse_serve_args(["--allow-request-priority"])  # honoured means ordered by priority
    assert eargs.scheduling_policy == "priority" and settings.allow_request_priority
    eargs, settings, _ = parse_serve_args(["--scheduling-policy", "priority"])  # vLLM's switch: takes priorities
    assert eargs.scheduling_policy == "priority" and settings.allow_request_priority
    _, settings, _ = parse_serve_args(["--max-num-seqs", "3", "--max-waiting-requests", "5"])
    assert (settings.max_live_seqs, settings.replicas) == (8, 1)
    _, settings, _ = parse_serve_args(
        ["--max-num-seqs", "3", "--max-waiting-requests", "5", "--data-parallel-size", "2"]
    )
    assert (settings.max_live_seqs, settings.replicas) == (8, 2)  # the prompts are spread over the replicas

    cfg = tmp_path / "aiolm.json"
    cfg.write_text(json.dumps({"max_num_seqs": 7, "max_model_len": 300, "allowed_origins": "x.org"}))
    eargs, settings = from_environment(
        {
            "AIOLM_CONFIG": str(cfg),
            "AIOLM_ARGS": "--max-model-len 400",
            "AIOLM_MODEL": "m.gguf",
            "AIOLM_API_KEY": "env-key",
        }
    )
    assert (eargs.max_num_seqs, eargs.max_model_len, eargs.model) == (7, 400, "m.gguf")
    assert settings.api_key == "env-key" and settings.allowed_origins == ["x.org"]
    cfg.write_text(json.dumps({"allowed_origins": ["a.org", "b.org"], "enable_prefix_caching": False, "max_n": 3}))
    eargs, settings = from_environment({"AIOLM_CONFIG": str(cfg)})
    assert settings.allowed_origins == ["a.org", "b.org"] and not eargs.enable_prefix_caching and settings.max_n == 3
    # a value starting with "-", a list flag before a positional model, null for a three-state flag
    cfg.write_text(
        json.dumps({"api_key": "-secret", "allowed_media_domains": ["a.org"], "async_scheduling": None, "max_n": 2})
    )
    eargs, settings = from_environment({"AIOLM_CONFIG": str(cfg), "AIOLM_ARGS": "some/model.gguf --max-n 5"})
    assert settings.api_key == "-secret" and eargs.model == "some/model.gguf" and eargs.async_scheduling is None
    assert settings.max_n == 5  # the command line wins
    # vLLM's list form of --served-model-name: one name (it served the name '["m"]')
    cfg.write_text(json.dumps({"served_model_name": ["m"]}))
    eargs, _ = from_environment({"AIOLM_CONFIG": str(cfg)})
    assert eargs.served_model_name == "m"


@pytest.mark.parametrize(
    "config, words",
    [
        # set as parser defaults, these skipped the flags' checks: "false" was a true string,
        # 2.5 reached the workers as a count, 0 made every explicit n a 400
        ({"enable_prefix_caching": "false"}, "enable_prefix_caching: must be true or false"),
        ({"max_num_seqs": 2.5}, "--max-num-seqs"),
        ({"max_n": 0}, "--max-n"),
        ({"shutdown_timeout": -5}, "--shutdown-timeout"),
        ({"log_level": "chatty"}, "--log-level"),
        ({"port": 9000}, "the ASGI server's option"),
        ({"no_such_flag": 1}, "unknown settings in the config: no_such_flag"),
        ({"served_model_name": ["a", "b"]}, "served_model_name: takes one value, got a list of 2"),
    ],
)
def test_a_bad_config_value_is_refused_as_its_flag_would_be(config, words, tmp_path, capsys):
    cfg = tmp_path / "aiolm.json"
    cfg.write_text(json.dumps(config))
    with pytest.raises(SystemExit) as e:
        from_environment({"AIOLM_CONFIG": str(cfg)})
    assert words in f"{e.value.code} {capsys.readouterr().err}"


def test_bad_environment_is_one_line(tmp_path):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    for env, words in (
        ({"AIOLM_CONFIG": str(tmp_path / "missing.json")}, "cannot read it"),
        ({"AIOLM_CONFIG": str(bad_json)}, "not valid JSON"),
        ({"AIOLM_ARGS": "--max-model-len 'unbalanced"}, "AIOLM_ARGS: No closing quotation"),
        ({"AIOLM_ARGS": "--port 9000"}, "--port: the ASGI server's option"),
    ):
        with pytest.raises(SystemExit) as e:
            from_environment(env)
        assert words in str(e.value.code), (env, e.value.code)


# -- disconnects through a real HTTP server (uvicorn in a thread, fake engine) ------------------


class _ThreadServer:
    def __init__(self, app) -> None:
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(20)


def _wait(pred, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_at_once(stream):
    engine = FakeEngine(step_delay=0.05)  # 200 tokens would take 10 s
    with _ThreadServer(build_app(engine)) as url:

        async def drop() -> None:
            async with httpx.AsyncClient(base_url=url) as client:
                body = {"prompt": "x", "max_tokens": 200, "stream": stream}
                if stream:
                    async with client.stream("POST", "/v1/completions", json=body) as r:
                        async for _ in r.aiter_lines():
                            break  # one chunk, then hang up
                else:
                    with pytest.raises(httpx.ReadTimeout):
                        await client.post("/v1/completions", json=body, timeout=0.5)

        t0 = time.monotonic()
        asyncio.run(drop())
        assert _wait(lambda: len(engine.aborted) == 1 and not engine.live, 3.0), (engine.aborted, engine.live)
        assert time.monotonic() - t0 < 5.0
