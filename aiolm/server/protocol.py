"""The request bodies of the OpenAI-compatible API and their mapping to SamplingParams.

Field specs here are the single definition of each endpoint's input: they
validate requests (400 naming the field) and generate ``/openapi.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from aiolm.config import EngineArgs
from aiolm.params import OutputKind, ParamError, SamplingParams
from aiolm.server import client_json
from aiolm.server.errors import APIError, bad_request
from aiolm.server.schema import Bool, Enum, Field, Int, ListOf, MapOf, Num, Obj, OneOf, Spec, Str
from aiolm.server.tools import message_tool_fields, tool_fields
from aiolm.structured.spec import StructuredOutputs, choice_grammar

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP = 64
MAX_BAD_WORDS = 256


@dataclass(frozen=True)
class Limits:
    """Per-request bounds an operator sets (``aiolm serve --max-n`` ...)."""

    max_n: int = 16
    max_prompts: int = 64  # prompts in one /v1/completions batch
    max_logprobs: int = EngineArgs.max_logprobs  # the engine's --max-logprobs
    lenient: bool = False  # unknown request fields: a logged warning instead of a 400


_NOOP = "accepted for OpenAI compatibility; has no effect on this server"


def _noop_fields() -> dict[str, Field]:
    """Fields OpenAI defines that do not apply to a self-hosted model: accepted, documented, unused."""
    return {
        "store": Field(Bool(), doc=_NOOP + " (nothing is stored)"),
        "metadata": Field(MapOf(Str(max_len=512), max_items=16), doc=_NOOP + " (nothing is stored)"),
        "service_tier": Field(Str(max_len=64), doc=_NOOP + " (one tier)"),
        "user": Field(Str(max_len=256), doc=_NOOP + " beyond the access log"),
        "safety_identifier": Field(Str(max_len=256), doc=_NOOP),
        "prompt_cache_key": Field(Str(max_len=256), doc=_NOOP + " (prefix caching is automatic)"),
    }


def _sampling_fields(limits: Limits) -> dict[str, Field]:
    """Fields chat and completions share (OpenAI's plus vLLM's usual extensions)."""
    stop = OneOf(Str(min_len=1), ListOf(Str(min_len=1), max_items=MAX_STOP),
                 what="a non-empty string or a list of non-empty strings")
    return {
        "model": Field(Str(), doc="served model name; optional"),
        "n": Field(Int(1, limits.max_n), default=1, doc="how many choices to generate"),
        "max_tokens": Field(Int(ge=1), doc="most tokens to generate"),
        "temperature": Field(Num(ge=0), default=1.0),
        "top_p": Field(Num(gt=0, le=1), default=1.0),
        "top_k": Field(Int(-1, 2**31 - 1), default=0, doc="-1 or 0 disables"),
        "min_p": Field(Num(ge=0, le=1), default=0.0),
        "seed": Field(Int(INT64_MIN, INT64_MAX)),
        "stop": Field(stop),
        "stop_token_ids": Field(ListOf(Int(ge=0), max_items=MAX_STOP)),
        "presence_penalty": Field(Num(ge=-2, le=2), default=0.0),
        "frequency_penalty": Field(Num(ge=-2, le=2), default=0.0),
        "repetition_penalty": Field(Num(gt=0, le=2), default=1.0),
        "logit_bias": Field(MapOf(Num(ge=-100, le=100), max_items=1024), doc="token id -> bias"),
        "ignore_eos": Field(Bool(), default=False),
        "min_tokens": Field(Int(0, 2**31 - 1), default=0),
        **_noop_fields(),
        "stream": Field(Bool(), default=False),
        "stream_options": Field(Obj({"include_usage": Field(Bool(), default=False),
                                     "continuous_usage_stats": Field(Bool(), default=False)},
                                    lenient=limits.lenient),
                                doc="only with 'stream': true"),
        "skip_special_tokens": Field(Bool(), default=True),
        "spaces_between_special_tokens": Field(Bool(), default=True),
        "include_stop_str_in_output": Field(Bool(), default=False),
        "priority": Field(Int(-(2**31), 2**31 - 1), default=0),
        "allowed_token_ids": Field(ListOf(Int(ge=0), min_items=1, max_items=1 << 20),
                                   doc="vLLM's: only these tokens may be generated"),
        "bad_words": Field(ListOf(Str(min_len=1), max_items=MAX_BAD_WORDS),
                           doc="vLLM's: words never generated (each as tokenized with and without a "
                               "leading space)"),
        "prompt_logprobs": Field(Int(0, limits.max_logprobs),
                                 doc="vLLM's: each prompt token's logprob and this many alternatives "
                                     "('prompt_logprobs' in the response; not with stream)"),
        "return_token_ids": Field(Bool(), default=False,
                                  doc="vLLM's: the prompt's token ids ('prompt_token_ids') and each "
                                      "choice's ('token_ids') next to the text"),
        **_structured_fields(limits),
    }


MAX_CHOICES = 1024


def _structured_fields(limits: Limits) -> dict[str, Field]:
    """Output constraints, in OpenAI's and vLLM's spellings; at most one per request."""
    schema = OneOf(MapOf(_Any()), Str(min_len=1), what="a JSON schema (an object or its JSON text)")
    choices = ListOf(Str(min_len=1), min_items=1, max_items=MAX_CHOICES)
    lenient = limits.lenient
    return {
        "response_format": Field(Obj({
            "type": Field(Enum(("text", "json_object", "json_schema")), required=True),
            "json_schema": Field(Obj({"name": Field(Str(max_len=256), doc=_NOOP + " (a label)"),
                                      "description": Field(Str(), doc=_NOOP + " (not shown to the model)"),
                                      "schema": Field(MapOf(_Any())),
                                      "strict": Field(Bool(), doc="false: properties the schema does not "
                                                                  "list may be generated")}, lenient=lenient)),
        }, lenient=lenient), doc="OpenAI's: json_object (any JSON object) or json_schema"),
        "structured_outputs": Field(Obj({
            "json": Field(schema), "regex": Field(Str(min_len=1)), "choice": Field(choices),
            "grammar": Field(Str(min_len=1), doc="EBNF/GBNF whose start rule is 'root'"),
            "json_object": Field(Bool()),
        }, lenient=lenient), doc="vLLM's: exactly one of json, regex, choice, grammar, json_object"),
        "guided_json": Field(schema, doc="vLLM's older spelling of structured_outputs.json"),
        "guided_regex": Field(Str(min_len=1), doc="vLLM's older spelling of structured_outputs.regex"),
        "guided_choice": Field(choices, doc="vLLM's older spelling of structured_outputs.choice"),
        "guided_grammar": Field(Str(min_len=1), doc="vLLM's older spelling of structured_outputs.grammar"),
    }


def _schema_text(value: Any, param: str) -> str:
    if isinstance(value, str):
        try:
            value = client_json.loads(value)
        except client_json.TooDeep as e:
            raise bad_request(f"'{param}' is {e}", param=param) from None
        except ValueError as e:
            raise bad_request(f"'{param}' is not valid JSON: {e}", param=param) from None
    if not isinstance(value, (dict, bool)):
        raise bad_request(f"'{param}' must be a JSON schema object", param=param)
    return json.dumps(value)  # key order kept: it is the order properties are generated in


def structured_spec(req: dict[str, Any]) -> tuple[StructuredOutputs | None, str]:
    """The one output constraint a request asks for, and the field that asked (for errors)."""
    found: list[tuple[str, StructuredOutputs]] = []
    fmt = req.get("response_format")
    if fmt is not None and fmt["type"] == "json_object":
        found.append(("response_format", StructuredOutputs("json_object")))
    elif fmt is not None and fmt["type"] == "json_schema":
        js = fmt["json_schema"]
        if js is None or js["schema"] is None:
            raise bad_request("response_format 'json_schema' needs 'json_schema.schema'",
                              param="response_format.json_schema.schema" if js else "response_format.json_schema")
        param = "response_format.json_schema.schema"
        found.append((param, StructuredOutputs("json", _schema_text(js["schema"], param), js["strict"] is not False)))
    so = req.get("structured_outputs") or {}
    for key, value in so.items():
        if value is None or value is False:
            continue
        found.append((f"structured_outputs.{key}", _structured_one(key, value, f"structured_outputs.{key}")))
    for key in ("json", "regex", "choice", "grammar"):
        value = req.get(f"guided_{key}")
        if value is not None:
            found.append((f"guided_{key}", _structured_one(key, value, f"guided_{key}")))
    if len(found) > 1:
        raise bad_request(f"'{found[1][0]}' and '{found[0][0]}' both constrain the output; give one",
                          param=found[1][0])
    return (found[0][1], found[0][0]) if found else (None, "structured_outputs")


def text_format_spec(fmt: dict[str, Any] | None) -> StructuredOutputs | None:
    """The Responses API's ``text.format`` as the output constraint chat's ``response_format`` maps to."""
    if fmt is None or fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return StructuredOutputs("json_object")
    if fmt["schema"] is None:
        raise bad_request("text.format 'json_schema' needs 'text.format.schema'", param="text.format.schema")
    return StructuredOutputs("json", _schema_text(fmt["schema"], "text.format.schema"), fmt["strict"] is not False)


def _structured_one(key: str, value: Any, param: str) -> StructuredOutputs:
    if key == "json":
        return StructuredOutputs("json", _schema_text(value, param))
    if key == "json_object":
        return StructuredOutputs("json_object")
    if key == "choice":
        return StructuredOutputs("grammar", choice_grammar(value))
    return StructuredOutputs(key, value)  # regex, grammar


def _content_spec(lenient: bool) -> Spec:
    part = Obj({"type": Field(Enum(("text",)), required=True), "text": Field(Str(), required=True)},
               lenient=lenient)
    return OneOf(Str(), ListOf(part, max_items=256), what="a string or a list of text parts")


def chat_request(limits: Limits) -> Obj:
    message = Obj({
        "role": Field(Enum(("system", "developer", "user", "assistant", "tool")), required=True),
        "content": Field(_content_spec(limits.lenient)),
        "name": Field(Str()),
        "refusal": Field(Str(), doc=_NOOP + " (an earlier answer's refusal text is not shown to the model)"),
        **message_tool_fields(limits.lenient),
    }, lenient=limits.lenient)
    fields = {
        "messages": Field(ListOf(message, min_items=1, max_items=4096), required=True),
        **_sampling_fields(limits),
        "max_completion_tokens": Field(Int(ge=1), doc="most tokens to generate (wins over max_tokens)"),
        "logprobs": Field(Bool(), default=False),
        "top_logprobs": Field(Int(0, limits.max_logprobs)),
        **tool_fields(limits.lenient, _Any()),
        "modalities": Field(ListOf(Enum(("text",)), max_items=1), doc="only ['text']"),
        "add_generation_prompt": Field(Bool(), default=True),
        "continue_final_message": Field(Bool(), default=False),
    }
    return Obj(fields, lenient=limits.lenient)


def completion_request(limits: Limits) -> Obj:
    token_ids = ListOf(Int(ge=0), min_items=1)
    prompt = OneOf(Str(), ListOf(Str(), min_items=1, max_items=limits.max_prompts), token_ids,
                   ListOf(token_ids, min_items=1, max_items=limits.max_prompts),
                   what="a string, a list of strings, a list of token ids or a list of lists of token ids")
    fields = {
        "prompt": Field(prompt, required=True),
        **_sampling_fields(limits),
        "echo": Field(Bool(), default=False),
        "logprobs": Field(Int(0, limits.max_logprobs)),
        "best_of": Field(Int(1, limits.max_n)),
        "suffix": Field(Str()),
        "add_special_tokens": Field(Bool(), default=True),
    }
    fields["max_tokens"] = Field(Int(ge=1), default=16, doc="most tokens to generate")
    return Obj(fields, lenient=limits.lenient)


def responses_request(limits: Limits) -> Obj:
    """OpenAI's Responses API, text in and out. Nothing is stored, so nothing can be fetched
    or continued later: ``previous_response_id``, ``conversation`` and tools are refused."""
    lenient = limits.lenient
    part = Obj({
        "type": Field(Enum(("input_text", "output_text")), required=True),
        "text": Field(Str(), required=True),
        "annotations": Field(ListOf(_Any(), max_items=256), doc=_NOOP + " (an earlier output's citations)"),
        "logprobs": Field(ListOf(_Any()), doc=_NOOP + " (an earlier output's logprobs)"),
    }, lenient=lenient)
    item = Obj({
        "type": Field(Enum(("message",)), doc="only 'message' items"),
        "role": Field(Enum(("user", "system", "developer", "assistant")), required=True),
        "content": Field(OneOf(Str(), ListOf(part, max_items=256), what="a string or a list of text parts"),
                         required=True),
        "id": Field(Str(max_len=256), doc=_NOOP + " (an earlier output item's id)"),
        "status": Field(Enum(("in_progress", "completed", "incomplete")), doc=_NOOP),
    }, lenient=lenient)
    text_format = Obj({
        "type": Field(Enum(("text", "json_object", "json_schema")), required=True),
        "name": Field(Str(max_len=256), doc=_NOOP + " (a label)"),
        "description": Field(Str(), doc=_NOOP + " (not shown to the model)"),
        "schema": Field(MapOf(_Any()), doc="with type 'json_schema': the schema the output follows"),
        "strict": Field(Bool(), doc="false: properties the schema does not list may be generated"),
    }, lenient=lenient)
    return Obj({
        "model": Field(Str(), doc="served model name; optional"),
        "input": Field(OneOf(Str(), ListOf(item, min_items=1, max_items=4096),
                             what="a string or a list of message items"), required=True),
        "instructions": Field(Str(), doc="a system message placed before the input"),
        "max_output_tokens": Field(Int(ge=1), doc="most tokens to generate"),
        "temperature": Field(Num(ge=0), default=1.0),
        "top_p": Field(Num(gt=0, le=1), default=1.0),
        "stream": Field(Bool(), default=False, doc="server-sent events named by their type"),
        "text": Field(Obj({"format": Field(text_format)}, lenient=lenient),
                      doc="'format': text, json_object or json_schema (structured outputs)"),
        "truncation": Field(Enum(("disabled",)), doc="only 'disabled': an input too long for the context is a 400"),
        **_noop_fields(),
    }, lenient=lenient)


def tokenize_request(limits: Limits = Limits()) -> Obj:
    return Obj({
        "model": Field(Str()),
        "prompt": Field(Str()),
        "messages": Field(chat_request(limits).fields["messages"].spec),
        "add_special_tokens": Field(Bool(), default=True),
        "add_generation_prompt": Field(Bool(), default=True),
        "return_token_strs": Field(Bool(), default=False),
    }, lenient=limits.lenient)


def detokenize_request(limits: Limits = Limits()) -> Obj:
    return Obj({"model": Field(Str()), "tokens": Field(ListOf(Int(ge=0)), required=True)},
               lenient=limits.lenient)


class _Any(Spec):
    what = "any JSON value"

    def parse(self, value: Any, name: str) -> Any:
        return value

    def schema(self) -> dict[str, Any]:
        return {}


# -- from a validated body to engine inputs ------------------------------------------------


def sampling_params(req: dict[str, Any], max_tokens: int | None, logprobs: int | None,
                    kind: OutputKind, structured: StructuredOutputs | None = None,
                    prompt_logprobs: int | None = None, engine: Any = None) -> SamplingParams:
    """Build SamplingParams; anything the engine still refuses becomes a 400 naming the field."""
    try:
        return SamplingParams(
            n=req["n"], temperature=req["temperature"], top_p=req["top_p"], top_k=req["top_k"],
            min_p=req["min_p"], seed=req["seed"], presence_penalty=req["presence_penalty"],
            frequency_penalty=req["frequency_penalty"], repetition_penalty=req["repetition_penalty"],
            logit_bias=req["logit_bias"], max_tokens=max_tokens, min_tokens=req["min_tokens"],
            stop=list(req["stop"]) if isinstance(req["stop"], list) else (req["stop"] or []),
            stop_token_ids=list(req["stop_token_ids"] or []),
            include_stop_str_in_output=req["include_stop_str_in_output"], ignore_eos=req["ignore_eos"],
            logprobs=logprobs, skip_special_tokens=req["skip_special_tokens"],
            spaces_between_special_tokens=req["spaces_between_special_tokens"], output_kind=kind,
            structured_outputs=structured, prompt_logprobs=prompt_logprobs,
            **(token_constraints(req, engine) if engine is not None else {}))
    except ParamError as e:
        raise param_error(e) from None


def token_constraints(req: dict[str, Any], engine: Any) -> dict[str, Any]:
    """vLLM's ``allowed_token_ids`` (checked against the vocabulary) and ``bad_words``
    (tokenized with and without a leading space, as vLLM does)."""
    out: dict[str, Any] = {}
    allowed = req.get("allowed_token_ids")
    if allowed is not None:
        vocab = engine.vocab_size
        for i, t in enumerate(allowed):
            if t >= vocab:
                raise bad_request(f"token id {t} is outside the vocabulary [0, {vocab})",
                                  param=f"allowed_token_ids[{i}]")
        out["allowed_token_ids"] = list(allowed)
    words = req.get("bad_words")
    if words:
        seqs: list[list[int]] = []
        for w in words:
            for text in (w, " " + w) if not w.startswith(" ") else (w,):
                ids = engine.tokenize(text, False)
                if ids and ids not in seqs:
                    seqs.append(ids)
        out["bad_words_token_ids"] = seqs
    return out


def param_error(e: ParamError, rename: dict[str, str] | None = None) -> APIError:
    param = (rename or {}).get(e.param, e.param)
    return bad_request(f"'{param}': {e.message}", param=param)


def check_stream_options(req: dict[str, Any]) -> None:
    """OpenAI refuses stream options on a request that does not stream; so do we. vLLM
    refuses prompt logprobs on a stream."""
    if req["stream_options"] is not None and not req["stream"]:
        raise bad_request("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                          param="stream_options")
    if req["prompt_logprobs"] is not None and req["stream"]:
        raise bad_request("'prompt_logprobs' is not available when 'stream' is true", param="prompt_logprobs")


def check_unsupported_chat(req: dict[str, Any]) -> None:
    check_stream_options(req)
    if req["top_logprobs"] is not None and req["top_logprobs"] > 0 and not req["logprobs"]:
        raise bad_request("'top_logprobs' needs 'logprobs' set to true", param="top_logprobs")


def check_unsupported_completion(req: dict[str, Any]) -> None:
    check_stream_options(req)
    if req["suffix"]:
        raise bad_request("'suffix' is not supported", param="suffix")
    if req["best_of"] is not None and req["best_of"] != req["n"]:
        raise bad_request("'best_of' other than 'n' is not supported", param="best_of")
