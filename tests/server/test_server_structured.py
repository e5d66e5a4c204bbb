"""Structured outputs: JSON schema, json_object, regex, choice and EBNF through the real server.

The fast part (field mapping, conflicts, the validator) runs on the fake engine;
the rest drives `aiolm serve` on the embedded model with the real `openai`
client, greedy and short, and checks every document with ``jsonschema``.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest
from server_helpers import API_KEY, FakeEngine
from starlette.testclient import TestClient

from aiolm.params import ParamError
from aiolm.server import build_app
from aiolm.server.settings import ServerSettings
from aiolm.structured.spec import StructuredOutputs
from aiolm.structured.validator import Validator

jsonschema = pytest.importorskip("jsonschema")

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TIMEOUT = 180.0


# -- the API edge, on the fake engine ----------------------------------------------------------


def _client(engine: FakeEngine) -> TestClient:
    return TestClient(build_app(engine, ServerSettings()), raise_server_exceptions=False)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
MAPPED = [
    ({"response_format": {"type": "json_object"}}, StructuredOutputs("json_object")),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
        StructuredOutputs("json", json.dumps(SCHEMA), True),
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": False}}},
        StructuredOutputs("json", json.dumps(SCHEMA), False),
    ),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputs("json", json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, StructuredOutputs("json", json.dumps(SCHEMA))),
    ({"structured_outputs": {"regex": "[0-9]+"}}, StructuredOutputs("regex", "[0-9]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutputs("grammar", 'root ::= "yes" | "no"')),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, StructuredOutputs("grammar", 'root ::= "a"')),
    ({"structured_outputs": {"json_object": True}}, StructuredOutputs("json_object")),
    ({"guided_json": SCHEMA}, StructuredOutputs("json", json.dumps(SCHEMA))),
    ({"guided_regex": "a|b"}, StructuredOutputs("regex", "a|b")),
    ({"guided_choice": ['say "hi"', "café"]}, StructuredOutputs("grammar", 'root ::= "say \\"hi\\"" | "café"')),
    ({"guided_grammar": 'root ::= "x"'}, StructuredOutputs("grammar", 'root ::= "x"')),
]


@pytest.mark.parametrize("extra,spec", MAPPED, ids=[next(iter(e)) + str(i) for i, (e, _) in enumerate(MAPPED)])
def test_fields_map_to_one_grammar(fake_engine, extra, spec, monkeypatch):
    seen = []
    add = fake_engine.add_request

    async def spy(prompt, params, *a, **kw):
        seen.append(params.structured_outputs)
        return await add(prompt, params, *a, **kw)

    monkeypatch.setattr(fake_engine, "add_request", spy)
    with _client(fake_engine) as c:
        for path, base in (("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "hi", "max_tokens": 2})):
            r = c.post(path, json={**base, **extra})
            assert r.status_code == 200, r.text
    assert seen == [spec, spec]


CONFLICTS = [
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json"),
    ({"structured_outputs": {"regex": "a", "grammar": 'root ::= "a"'}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"guided_json": "[1, 2]"}, "guided_json"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {}}, "structured_outputs"),  # no constraint at all (vLLM refuses it too)
    ({"structured_outputs": {"json_object": False}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
]


@pytest.mark.parametrize("extra,param", CONFLICTS, ids=[p for _, p in CONFLICTS])
def test_structured_field_errors_name_the_field(fake_engine, extra, param):
    with _client(fake_engine) as c:
        r = c.post("/v1/chat/completions", json={**CHAT, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert not fake_engine.live


def test_validator_caches_and_refuses_off_the_loop(real_source):
    async def run():
        v = Validator("xgrammar")
        v.configure(real_source.path, real_source.config.vocab_size)
        good = StructuredOutputs("regex", "[a-z]+")
        await asyncio.gather(*(v.check(good) for _ in range(8)))  # one shared check
        assert len(v._verdicts) == 1 and not v._jobs
        await v.check(StructuredOutputs("grammar", 'root ::= "café" | "日本"'))  # the text travels as UTF-8
        for spec, words in (
            (StructuredOutputs("regex", "(ab"), "invalid regex"),
            (StructuredOutputs("grammar", "root ::= missing_rule"), "invalid grammar"),
            (StructuredOutputs("json", '{"type": "no-such-type"}'), "invalid JSON schema"),
            (StructuredOutputs("regex", "[^\\s\\S]"), "invalid regex: no text"),
        ):
            with pytest.raises(ParamError) as e:
                await v.check(spec)
            assert e.value.param == "structured_outputs" and e.value.message.startswith(words), e.value.message
        await v.close()
        off = Validator("none")
        await off.check(None)
        with pytest.raises(ParamError, match="disabled"):
            await off.check(good)

    asyncio.run(run())


def test_backend_flag():
    from aiolm.server.settings import parse_serve_args

    args, _, _ = parse_serve_args(["--structured-outputs-backend", "none"])
    assert args.structured_outputs_backend == "none"
    assert parse_serve_args([])[0].structured_outputs_backend == "xgrammar"
    with pytest.raises(SystemExit):
        parse_serve_args(["--structured-outputs-backend", "outlines"])


# -- the real server, the real client ----------------------------------------------------------


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}
INVENTORY = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "enum": ["A1", "B2", "C3"]},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "temperature": {"type": "number", "minimum": -50, "maximum": 60},
        "rain": {"type": "boolean"},
    },
    "required": ["unit", "temperature", "rain"],
    "additionalProperties": False,
}
FLAGS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 4}
SCHEMAS = {
    "person": (PERSON, "Give a person's name, age and address as JSON."),
    "inventory": (INVENTORY, "List the items in stock as JSON."),
    "weather": (WEATHER, "What is the weather in Paris? Answer in JSON."),
    "numbers": (FLAGS, "Give a few small numbers as a JSON array."),
}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_documents_validate(client, model, name):
    schema, question = SCHEMAS[name]
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": question}],
        temperature=0,
        max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_schema_streams_the_same_document(client, model):
    schema, question = SCHEMAS["weather"]
    kw = dict(
        model=model,
        messages=[{"role": "user", "content": question}],
        temperature=0,
        max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
    )
    whole = client.chat.completions.create(**kw).choices[0].message.content
    pieces, finish = [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(pieces) == whole and finish == "stop"
    jsonschema.validate(json.loads(whole), schema)


def test_json_object_and_vllm_spellings(client, model):
    q = [{"role": "user", "content": "Describe a cat in JSON."}]
    out = client.chat.completions.create(
        model=model,
        messages=q,
        temperature=0,
        max_tokens=120,
        response_format={"type": "json_object"},
        extra_body={"repetition_penalty": 1.3},
    )  # this model loops otherwise
    assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    out = client.completions.create(
        model=model,
        prompt="A person as JSON:",
        temperature=0,
        max_tokens=120,
        extra_body={"structured_outputs": {"json": PERSON}},
    )
    jsonschema.validate(json.loads(out.choices[0].text), PERSON)
    out = client.completions.create(
        model=model, prompt="A person as JSON:", temperature=0, max_tokens=120, extra_body={"guided_json": INVENTORY}
    )
    jsonschema.validate(json.loads(out.choices[0].text), INVENTORY)


def test_regex_choice_and_grammar(client, model):
    q = [{"role": "user", "content": "What is the phone number of the office?"}]
    regex = r"\(\d{3}\) \d{3}-\d{4}"
    for extra in ({"guided_regex": regex}, {"structured_outputs": {"regex": regex}}):
        out = client.chat.completions.create(model=model, messages=q, temperature=0, max_tokens=30, extra_body=extra)
        assert re.fullmatch(regex, out.choices[0].message.content), out.choices[0].message.content
        assert out.choices[0].finish_reason == "stop"
    q = [{"role": "user", "content": "Is the sky green?"}]
    for extra in (
        {"guided_choice": ["yes", "no", "maybe so"]},
        {"structured_outputs": {"choice": ["yes", "no", "maybe so"]}},
    ):
        out = client.chat.completions.create(model=model, messages=q, temperature=0, max_tokens=10, extra_body=extra)
        assert out.choices[0].message.content in ("yes", "no", "maybe so")
    grammar = """root ::= greeting " " name "!"
greeting ::= "Hello" | "Goodbye"
name ::= [A-Z] [a-z]+"""
    q = [{"role": "user", "content": "Greet someone."}]
    for extra in ({"guided_grammar": grammar}, {"structured_outputs": {"grammar": grammar}}):
        out = client.chat.completions.create(model=model, messages=q, temperature=0, max_tokens=20, extra_body=extra)
        assert re.fullmatch(r"(Hello|Goodbye) [A-Z][a-z]+!", out.choices[0].message.content), out.choices[0]
    # streamed, on completions, seeded sampling: the grammar holds for random picks too
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=model,
            prompt="Call me at",
            max_tokens=30,
            stream=True,
            temperature=1.0,
            seed=7,
            extra_body={"guided_regex": regex},
        )
        if c.choices
    )
    assert re.fullmatch(regex, text), text


@pytest.mark.parametrize(
    "extra,param,words",
    [
        ({"guided_regex": "(ab"}, "guided_regex", "invalid regex"),
        # grammars that match no text: every token was masked at the first step, token 0 drawn
        ({"guided_regex": "[^\\s\\S]"}, "guided_regex", "invalid regex: no text"),
        # keywords xgrammar compiles but does not enforce: the output could break them
        (
            {"guided_json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
            "guided_json",
            "invalid JSON schema: 'uniqueItems' is not enforced",
        ),
        (
            {"guided_json": {"type": "object", "properties": {"not": {"not": {"type": "string"}}}}},
            "guided_json",
            "invalid JSON schema: 'not' (at properties.not) is not enforced",
        ),
        ({"guided_json": {"allOf": [{"type": "string"}, {"maxLength": 3}]}}, "guided_json", "'allOf' of more"),
        # measured to be broken by the output before (the keyword dropped in silence)
        (
            {"guided_json": {"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "enum": ["AAA", "BBB"]}},
            "guided_json",
            "'$ref' beside enum",
        ),
        ({"guided_json": {"$ref": "https://example.com/schema.json"}}, "guided_json", "only references within"),
        ({"guided_json": {"type": "number", "multipleOf": 0.25}}, "guided_json", "'multipleOf' of a non-integer"),
        (
            {"guided_json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]}},
            "guided_json",
            "'required' 'b', which 'properties' does not list",
        ),
        # no schema at all: a 500 (unhashable), and a keyword "not enforced"
        (
            {"guided_json": {"type": "object", "properties": {"a": {}}, "required": [["a"]]}},
            "guided_json",
            "invalid JSON schema: 'required' must be a list of property names",
        ),
        (
            {"guided_json": {"type": "object", "properties": {"a": {"type": {}}}}},
            "guided_json",
            "invalid JSON schema: 'type' must be a type name or a list of them (at properties.a)",
        ),
        (
            {"structured_outputs": {"grammar": "root ::= undefined_rule"}},
            "structured_outputs.grammar",
            "invalid grammar",
        ),
        (
            {"guided_json": {"type": "object", "properties": {"a": {"type": "integr"}}}},
            "guided_json",
            "invalid JSON schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
            "response_format.json_schema.schema",
            "invalid JSON schema",
        ),
        # xgrammar drops the lengths beside a pattern: text past them was accepted
        (
            {"guided_json": {"type": "string", "pattern": "[a-z]+", "maxLength": 3}},
            "guided_json",
            "'pattern' beside 'minLength' or 'maxLength'",
        ),
        # a schema beside another type was dropped in silence
        (
            {"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
            "response_format.json_schema",
            "applies to type 'json_schema' only, not 'json_object'",
        ),
    ],
)
def test_invalid_grammars_are_a_400_with_the_compiler_message(client, model, extra, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], max_tokens=5, extra_body=extra
        )
    assert e.value.body["param"] == param and words in e.value.body["message"], e.value.body
    with pytest.raises(openai.BadRequestError) as e:  # and while streaming: refused before the stream starts
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], max_tokens=5, extra_body=extra, stream=True
        )
    assert e.value.body["param"] == param


@pytest.mark.parametrize("extra", [{"min_tokens": 5}, {"allowed_token_ids": [5]}])
def test_bans_beside_a_grammar_end_the_row_instead_of_drawing_token_0(client, model, extra):
    """min_tokens past a finished choice, or allowed tokens the grammar never allows, left a
    step with every token masked: token 0 was drawn (text on models where it is a word)."""
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Is the sky green?"}],
        max_tokens=12,
        temperature=0,
        extra_body={"guided_choice": ["yes", "no"], "return_token_ids": True, **extra},
    )
    choice = out.choices[0]
    # past the answer (one token) only end tokens: the embedded file's <|im_end|> (2) and, as
    # llama.cpp ends it, <|endoftext|> (0), which a masked row had drawn as text before
    assert len([t for t in choice.model_extra["token_ids"] if t not in (0, 2)]) <= 1, choice
    assert choice.finish_reason == "stop", choice
    assert choice.message.content in (("yes", "no") if "min_tokens" in extra else ("",)), choice


def test_a_slow_grammar_does_not_hold_up_others(server, model):
    """Many distinct schemas at once next to a plain request: the plain one is not queued behind them."""
    auth = {"authorization": f"Bearer {API_KEY}"}

    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, headers=auth, timeout=TIMEOUT) as c:
            schemas = [
                {
                    "type": "object",
                    "properties": {f"k{i}_{j}": {"type": "integer"} for j in range(30)},
                    "required": [f"k{i}_0"],
                }
                for i in range(12)
            ]
            constrained = [
                c.post("/v1/completions", json={"prompt": "JSON:", "max_tokens": 8, "temperature": 0, "guided_json": s})
                for s in schemas
            ]
            plain = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
            results = await asyncio.gather(plain, *constrained)
            assert all(r.status_code == 200 for r in results), [r.text for r in results if r.status_code != 200]

    asyncio.run(run())
