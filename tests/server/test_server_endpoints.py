"""/openapi.json against what the app serves, and the small vLLM endpoints, on the fake engine.

The real-model checks of /v1/responses, /tokenizer_info, /load and /tokenize are in
test_server_openai.py (they share its server).
"""

from __future__ import annotations

from typing import get_args

import pytest
from pydantic import BaseModel
from server_helpers import FakeEngine
from starlette.routing import Mount, Route
from starlette.testclient import TestClient

from aiolm.server import build_app
from aiolm.server.settings import ServerSettings

# A valid body for each POST route: every field is tried against it, one at a time.
BASES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/responses": {"input": "hi", "max_output_tokens": 2},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [104]},
}
WRONG = [[[]]]  # no request field takes a list of lists of lists


def _client(engine: FakeEngine, **settings) -> TestClient:
    return TestClient(build_app(engine, ServerSettings(**settings)), raise_server_exceptions=False)


def _served(app) -> set[tuple[str, str]]:
    """(OpenAPI path, method) of every route, as a client would call it."""
    out = set()
    for r in app.routes:
        if isinstance(r, Mount):  # static files under a prefix
            out.add((r.path + "/{path}", "get"))
        elif isinstance(r, Route):
            path = r.path.replace(":path}", "}")  # Starlette's path converter is plain {name} in OpenAPI
            out |= {(path, m.lower()) for m in r.methods or () if m != "HEAD"}
    return out


def _models_in(annotation) -> list[type[BaseModel]]:
    """The pydantic models an annotation can hold (through Optional, lists, unions, Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def _fields_documented(model: type[BaseModel], schemas: dict, name: str, seen: set[str]) -> int:
    """Every field the model accepts, at every depth, is a property of the document's schema
    for it (and nothing else is: unknown fields are refused, or documented as passed on);
    returns how many were checked."""
    if name in seen:
        return 0
    seen.add(name)
    schema = schemas[name]
    props = schema.get("properties", {})
    accepted = {f.alias or k: f for k, f in model.model_fields.items()}
    assert set(props) == set(accepted), (name, set(accepted) ^ set(props))
    # refused, unless the model passes others on (a chat message's go to the chat template)
    assert schema.get("additionalProperties") is (model.model_config.get("extra") == "allow"), name
    assert sorted(schema.get("required", [])) == sorted(k for k, f in accepted.items() if f.is_required()), name
    checked = len(props)
    for f in accepted.values():
        for inner in _models_in(f.annotation) + [m for meta in f.metadata for m in _models_in(meta)]:
            checked += _fields_documented(inner, schemas, inner.__name__, seen)
    return checked


def test_openapi_documents_every_route_and_every_accepted_field(fake_engine):
    from aiolm.server.openapi import ALL_REQUEST_MODELS

    app = build_app(fake_engine, ServerSettings(web_ui=True))
    with TestClient(app, raise_server_exceptions=False) as c:
        doc = c.get("/openapi.json").json()
    documented = {(p, m) for p, ops in doc["paths"].items() for m in ops}
    assert _served(app) == documented, _served(app) ^ documented
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            ok = op["responses"]["200"]["content"]
            assert all("schema" in v for v in ok.values()), (path, method)
            for name in (p["name"] for p in op.get("parameters", [])):
                assert "{" + name + "}" in path
    # Which model each route parses its body with (protocol.py's and pooling_protocol.py's);
    # /invocations takes any of its tasks' bodies, and SageMaker's POST /ping none.
    assert {p for p, m in documented if m == "post"} - {"/invocations", "/ping"} == set(ALL_REQUEST_MODELS)
    from aiolm.server.invocations import TASKS

    any_of = doc["paths"]["/invocations"]["post"]["requestBody"]["content"]["application/json"]["schema"]["anyOf"]
    assert [r["$ref"].rsplit("/", 1)[1] for r in any_of] == [ALL_REQUEST_MODELS[p].__name__ for _, p in TASKS]
    schemas = doc["components"]["schemas"]
    checked, seen = 0, set()
    for path, model in ALL_REQUEST_MODELS.items():
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.rsplit("/", 1)[1] == model.__name__
        checked += _fields_documented(model, schemas, model.__name__, seen)
    assert checked > 150, checked  # the nested message, tool and format objects were walked too


@pytest.mark.parametrize("path", sorted(BASES))
def test_every_documented_field_is_one_the_server_reads(fake_engine, path):
    """The document and the server agree from the outside: each documented top-level field, given
    a value of the wrong shape, is refused by name (it is read, not unknown); an undocumented one
    is refused as unknown."""
    with _client(fake_engine) as c:
        doc = c.get("/openapi.json").json()
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        props = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"]
        for field in props:
            r = c.post(path, json={**BASES[path], field: WRONG})
            assert r.status_code == 400, (field, r.text)
            err = r.json()["error"]
            assert err["code"] != "unrecognized_argument" and err["param"].startswith(field), (field, err)
        r = c.post(path, json={**BASES[path], "not_a_field": 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unrecognized_argument"
    assert not fake_engine.live


def test_responses_refuses_what_it_does_not_do(fake_engine):
    base = BASES["/v1/responses"]
    cases = [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call", "role": "user", "content": "x"}]}, "input[0].type"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].image_url",
        ),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "text": "x"}]}]}, "input[0].content[0].type"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 10_000}, "max_output_tokens"),
        ({"input": []}, "input"),
        ({"model": "other"}, "model"),
    ]
    with _client(fake_engine) as c:
        for extra, param in cases:
            r = c.post("/v1/responses", json={**base, **extra})
            assert 400 <= r.status_code < 500 and r.json()["error"]["param"] == param, (extra, r.text)
        # the accepted no-ops, echoed where OpenAI echoes them
        r = c.post(
            "/v1/responses",
            json={
                **base,
                "store": False,
                "metadata": {"k": "v"},
                "user": "u",
                "service_tier": "auto",
                "truncation": "disabled",
            },
        )
        assert r.status_code == 200 and r.json()["metadata"] == {"k": "v"} and r.json()["user"] == "u"
    assert not fake_engine.live


def test_load_is_open_and_tokenizer_info_needs_the_key(fake_engine):
    """/load is read by load balancers, like the probes; the tokenizer's details need the key.
    (That /load counts live requests is checked on the real server, test_server_openai.py.)"""
    with _client(fake_engine, api_key="k") as c:
        assert c.get("/load").json() == {"server_load": 0}
        assert (
            c.post(
                "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers={"authorization": "Bearer k"}
            ).status_code
            == 200
        )
        assert c.get("/load").json() == {"server_load": 0}
        assert c.get("/tokenizer_info").status_code == 401
        info = c.get("/tokenizer_info", headers={"authorization": "Bearer k"}).json()
        assert info["tokenizer_class"] == "FakeTokenizer" and info["max_model_len"] == FakeEngine.max_model_len


def test_answers_fit_the_documented_models(fake_engine):
    """What the server sends validates against the answer models /openapi.json documents."""
    from aiolm.server import output_models as out

    with _client(fake_engine) as c:
        checks = [
            (c.post("/v1/chat/completions", json={**BASES["/v1/chat/completions"], "n": 2}), out.ChatCompletion),
            (c.post("/v1/completions", json=BASES["/v1/completions"]), out.Completion),
            (c.post("/v1/responses", json=BASES["/v1/responses"]), out.Response),
            (c.post("/tokenize", json=BASES["/tokenize"]), out.TokenizeResponse),
            (c.post("/detokenize", json=BASES["/detokenize"]), out.DetokenizeResponse),
            (c.get("/v1/models"), out.ModelList),
            (c.get("/v1/models/fake-model"), out.ModelCard),
            (c.get("/health"), out.Status),
            (c.get("/version"), out.Version),
            (c.get("/load"), out.ServerLoad),
            (c.get("/tokenizer_info"), out.TokenizerInfo),
            (c.post("/v1/completions", json={"prompt": 5}), out.ErrorResponse),
        ]
        doc = c.get("/openapi.json").json()
    for r, model in checks:
        model.model_validate(r.json())
        assert model.__name__ in doc["components"]["schemas"]
    assert checks[0][0].json()["object"] == "chat.completion" and len(checks[0][0].json()["choices"]) == 2


class _BuggyEngine(FakeEngine):
    """An engine whose detokenizer has a bug (an exception no handler knows)."""

    def decode(self, *args, **kwargs):
        raise KeyError("a bug")


def test_an_unexpected_exception_is_a_json_500_that_ends_the_request_not_the_connection():
    """Logged, in the OpenAI error shape, with the request's id; and not raised on into the
    server, which would close the keep-alive connection under the client's next request
    (the test client raises what the app raises)."""
    with TestClient(build_app(_BuggyEngine(), ServerSettings()), raise_server_exceptions=True) as c:
        r = c.post("/detokenize", json=BASES["/detokenize"], headers={"x-request-id": "bug-1"})
        assert r.status_code == 500 and r.headers["x-request-id"] == "bug-1", r.text
        assert r.json()["error"] == {
            "message": "internal server error: KeyError",
            "type": "server_error",
            "param": None,
            "code": None,
        }
        assert c.get("/health").status_code == 200
