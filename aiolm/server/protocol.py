"""The request bodies of the OpenAI-compatible API, as pydantic models, and their mapping
to SamplingParams.

A request is parsed once, at the edge (``parse``), into one of these models; handlers
then read attributes. The models fix shapes and types only, plus the bounds an
operator sets (``Limits``); the sampling bounds live in ``SamplingParams``
(aiolm/params.py), whose ``ParamError`` becomes the 400. ``/openapi.json`` is
generated from the same models (openapi.py), so the documented API and the enforced
one cannot drift. A new request field is one attribute on a model here.

``null`` means "not given" for every field, as in OpenAI's API. A field no model
defines is a 400 naming it (OpenAI's "Unrecognized request argument"), so a client
never believes it got something the server silently dropped; with ``--lenient-fields``
it is a logged warning instead.
"""

from __future__ import annotations

import functools
import json
import logging
import operator
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    create_model,
    model_validator,
)
from pydantic.functional_validators import AfterValidator

from aiolm.config import EngineArgs
from aiolm.engine.client import EngineClient
from aiolm.params import (
    MAX_CACHE_SALT_CHARS,
    MAX_LOGPROB_TOKEN_IDS,
    MAX_STOP_TOKEN_IDS,
    SAMPLING_DEFAULT_KEYS,
    OutputKind,
    ParamError,
    SamplingParams,
)
from aiolm.server import client_json
from aiolm.server.errors import APIError, bad_request, clip, listed
from aiolm.structured.backend import unenforced
from aiolm.structured.spec import StructuredOutputs, choice_grammar

log = logging.getLogger("aiolm.server")

MAX_TOOLS = 128
MAX_CHOICES = 1024
MAX_BAD_WORDS = 256
MAX_BAD_WORD_CHARS = 1024  # each is tokenized twice on the event loop: bounded as stop strings are
MAX_BAD_WORDS_TOTAL_CHARS = 4096
_NOOP = "accepted for OpenAI compatibility; has no effect on this server"


@dataclass(frozen=True)
class Limits:
    """Per-request bounds an operator sets (``aiolm serve --max-n`` ...)."""

    max_n: int = 16
    max_prompts: int = 64  # prompts in one /v1/completions batch
    max_logprobs: int = EngineArgs.max_logprobs  # the engine's --max-logprobs
    lenient: bool = False  # unknown request fields: a logged warning instead of a 400


class Strict(BaseModel):
    """Every request object: unknown fields refused, no coercion ("1" is not 1), null is absent."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        known = _keys(cls)  # an unknown field stays, null or not, to be refused by name
        return {k: v for k, v in data.items() if v is not None or k not in known}


@functools.cache
def _keys(model: type[BaseModel]) -> frozenset[str]:
    """The JSON keys ``model`` accepts (a field's alias where it has one)."""
    return frozenset(f.alias or name for name, f in model.model_fields.items())


# -- shapes -------------------------------------------------------------------------------


# A union is told apart by the JSON type of its value (a list by its first item), so only
# one alternative is tried and its error is the precise one. Error paths drop the tags (_steps).
def _shape(value: Any) -> str | None:
    if isinstance(value, str):
        return "::text"
    if isinstance(value, dict):
        return "::object"
    if isinstance(value, list):
        first = value[0] if value else None
        if isinstance(first, int) and not isinstance(first, bool):
            return "::ids"
        if isinstance(first, list):
            return "::batch"
        return "::list"
    return None


def _one_of(what: str, **alternatives: Any) -> Any:
    """A union of ``alternatives`` (tag -> type); a value of no listed shape: 'must be {what}'."""
    members = tuple(Annotated[t, Tag("::" + tag)] for tag, t in alternatives.items())
    return Annotated[
        functools.reduce(operator.or_, members),
        Discriminator(
            _shape,
            custom_error_type="invalid_type",
            custom_error_message=f"must be {what}",
        ),
    ]


NonEmptyStr = Annotated[str, Field(min_length=1)]
CacheSalt = Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)]
CACHE_SALT_HELP = (
    "vLLM's: prefix-cache blocks are shared only among requests with the same salt "
    "(a tenant's secret, so cache hits reveal nothing of others' prompts)"
)
TokenId = Annotated[int, Field(ge=0)]
BadWord = Annotated[str, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS)]
JsonSchema = dict[str, Any]
# chat_template_kwargs: variables the template reads; the ones the server sets itself are not the client's
TemplateKwargs = Annotated[dict[str, Any], Field(max_length=64)]
SchemaValue = _one_of("a JSON schema (an object or its JSON text)", object=JsonSchema, text=NonEmptyStr)
Stop = _one_of("a non-empty string or a list of non-empty strings", text=NonEmptyStr, list=list[NonEmptyStr])
Choices = Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_CHOICES)]


def _metadata(value: dict[str, Any]) -> dict[str, Any]:
    if len(value) > 16 or not all(isinstance(v, str) and len(v) <= 512 for v in value.values()):
        raise ValueError("must map at most 16 keys to strings of at most 512 characters")
    return value


Metadata = Annotated[dict[str, Any], AfterValidator(_metadata)]


class NoopFields(Strict):
    """Fields OpenAI defines that do not apply to a self-hosted model: accepted, documented, unused."""

    store: bool | None = Field(None, description=_NOOP + " (nothing is stored)")
    metadata: Metadata | None = Field(None, description=_NOOP + " (nothing is stored)")
    service_tier: Annotated[str, Field(max_length=64)] | None = Field(None, description=_NOOP + " (one tier)")
    user: Annotated[str, Field(max_length=256)] | None = Field(None, description=_NOOP + " beyond the access log")
    safety_identifier: Annotated[str, Field(max_length=256)] | None = Field(None, description=_NOOP)
    prompt_cache_key: Annotated[str, Field(max_length=256)] | None = Field(
        None, description=_NOOP + " (prefix caching is automatic)"
    )


# -- chat messages and tools --------------------------------------------------------------


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ImageURL(Strict):
    url: Annotated[str, Field(min_length=1, description="data:image/...;base64,..., http(s):// or file://")]
    detail: Literal["auto", "low", "high"] | None = Field(
        None, description="accepted as OpenAI defines it; the model's processor decides the resolution"
    )


class ImagePart(Strict):
    """An image for a vision-language model (README: images); a text-only model answers 400."""

    type: Literal["image_url"]
    image_url: ImageURL


def _parts(what: str, **by_type: Any) -> Any:
    """A content part chosen by its ``type`` (tags ``::type``, which locations in 400s leave
    out); an unknown type is checked as the first kind, so the 400 names ``...type``."""
    members = tuple(Annotated[t, Tag("::" + kind)] for kind, t in by_type.items())
    first = next(iter(by_type))

    def kind(value: Any) -> str | None:
        if not isinstance(value, dict):
            return None
        t = value.get("type")
        return "::" + (t if isinstance(t, str) and t in by_type else first)

    return Annotated[
        functools.reduce(operator.or_, members),
        Discriminator(kind, custom_error_type="invalid_type", custom_error_message=f"must be {what}"),
    ]


ContentPart = _parts("a text or image_url part", text=TextPart, image_url=ImagePart)
Content = _one_of(
    "a string or a list of text and image_url parts",
    text=str,
    list=Annotated[list[ContentPart], Field(max_length=256)],  # type: ignore[valid-type]
)


class FunctionCall(Strict):
    name: NonEmptyStr
    arguments: str


class ToolCall(Strict):
    id: NonEmptyStr
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(Strict):
    """OpenAI's roles, or any other the chat template knows (``ipython``, ``document``, ...);
    fields beyond OpenAI's (``reasoning_content`` of an earlier turn, say) go to the
    template with the message, as vLLM passes them."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: Annotated[str, Field(min_length=1, max_length=64)] = Field(
        description="system, developer, user, assistant, tool, or a role the chat template knows"
    )
    content: Content | None = None  # type: ignore[valid-type]
    name: str | None = None
    refusal: str | None = Field(
        None, description=_NOOP + " (an earlier answer's refusal text is not shown to the model)"
    )
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="an earlier assistant turn's calls"
    )
    tool_call_id: NonEmptyStr | None = Field(None, description="a tool message: the call it answers")


Messages = Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)]


class FunctionDefinition(Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    parameters: JsonSchema | None = Field(None, description="a JSON schema of the arguments object")
    strict: bool | None = Field(None, description="calls are always generated to the schema when enforced")


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Strict):
    name: NonEmptyStr


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = _one_of(
    "'none', 'auto', 'required' or a named function", text=Literal["none", "auto", "required"], object=NamedToolChoice
)


# -- output constraints -------------------------------------------------------------------


class JsonSchemaFormat(Strict):
    name: Annotated[str, Field(max_length=256)] | None = Field(None, description=_NOOP + " (a label)")
    description: str | None = Field(None, description=_NOOP + " (not shown to the model)")
    schema_: JsonSchema | None = Field(None, alias="schema")
    strict: bool | None = Field(None, description="false: properties the schema does not list may be generated")


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(Strict):
    """vLLM's: exactly one of json, regex, choice, grammar, json_object."""

    json_: SchemaValue | None = Field(None, alias="json")  # type: ignore[valid-type]
    regex: NonEmptyStr | None = None
    choice: Choices | None = None
    grammar: NonEmptyStr | None = Field(None, description="EBNF/GBNF whose start rule is 'root'")
    json_object: bool | None = None


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


# -- the request bodies -------------------------------------------------------------------


class SamplingRequest(NoopFields):
    """Fields chat and completions share (OpenAI's plus vLLM's usual extensions)."""

    model: str | None = Field(None, description="served model name; optional")
    n: Annotated[int, Field(le=Limits.max_n)] = Field(1, description="how many choices to generate")
    max_tokens: int | None = Field(None, description="most tokens to generate")
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = Field(0, description="-1 or 0 disables")
    min_p: float = 0.0
    seed: int | None = None
    stop: Stop | None = None  # type: ignore[valid-type]
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Annotated[dict[str, float], Field(max_length=1024)] | None = Field(None, description="token id -> bias")
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = Field(None, description="only with 'stream': true")
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Annotated[int, Field(ge=-(2**31), le=2**31 - 1)] = 0
    # -- vLLM's beam search (aiolm/server/beam.py) --
    use_beam_search: bool = Field(
        False, description="vLLM's: the choices are the n best beams of a beam search of width n, best first"
    )
    length_penalty: float = Field(
        1.0, description="vLLM's, with use_beam_search: beams rank by cumulative logprob / length ** length_penalty"
    )
    early_stopping: Literal[True, False, "never"] = Field(
        False,
        description="vLLM's, with use_beam_search; as in vLLM v1 it has no effect (the search runs max_tokens steps)",
    )
    # -- end of beam search --
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=1 << 20)] | None = Field(
        None, description="vLLM's: only these tokens may be generated"
    )
    bad_words: Annotated[list[BadWord], Field(max_length=MAX_BAD_WORDS)] | None = Field(
        None, description="vLLM's: words never generated (each as tokenized with and without a leading space)"
    )
    prompt_logprobs: Annotated[int, Field(ge=-1, le=Limits.max_logprobs)] | None = Field(
        None,
        description="vLLM's: each prompt token's logprob and this many alternatives "
        "('prompt_logprobs' in the response; not with stream)",
    )
    return_token_ids: bool = Field(
        False,
        description="vLLM's: the prompt's token ids ('prompt_token_ids') "
        "and each choice's ('token_ids') next to the text",
    )
    logprob_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_LOGPROB_TOKEN_IDS)] | None = Field(
        None,
        description="vLLM's: these tokens' logprobs at every generated position, shown in place of "
        "the top logprobs (chat: with logprobs true)",
    )
    return_tokens_as_token_ids: bool = Field(
        False,
        description="vLLM's: each token in logprobs spelt 'token_id:<id>' instead of its text "
        "(a token that is not whole UTF-8 on its own stays identifiable)",
    )
    response_format: ResponseFormat | None = Field(
        None, description="OpenAI's: json_object (any JSON object) or json_schema"
    )
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: SchemaValue | None = Field(  # type: ignore[valid-type]
        None, description="vLLM's older spelling of structured_outputs.json"
    )
    guided_regex: NonEmptyStr | None = Field(None, description="vLLM's older spelling of structured_outputs.regex")
    guided_choice: Choices | None = Field(None, description="vLLM's older spelling of structured_outputs.choice")
    guided_grammar: NonEmptyStr | None = Field(None, description="vLLM's older spelling of structured_outputs.grammar")
    cache_salt: CacheSalt | None = Field(None, description=CACHE_SALT_HELP)
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = Field(
        None,
        description="vLLM's: a longer prompt keeps this many of its tokens instead of being refused "
        "(-1: as many as the context takes, leaving one token to generate)",
    )
    truncation_side: Literal["left", "right"] | None = Field(
        None,
        description="vLLM's, with truncate_prompt_tokens: 'left' (the default) keeps the last tokens, 'right' the "
        "first",
    )
    kv_transfer_params: dict[str, Any] | None = Field(
        None,
        description='vLLM\'s prefill/decode disaggregation: {"do_remote_decode": true} to a prefill instance; '
        "its answer's kv_transfer_params to the decode instance (needs --kv-transfer-config)",
    )


# vLLM's batched chat: several conversations in one request, each a prompt (as a
# completions batch is), its choices numbered after the ones before it.
ChatMessages = _one_of(
    "a list of messages, or a list of conversations (each a list of messages)",
    list=Messages,
    batch=Annotated[list[Messages], Field(min_length=1, max_length=Limits.max_prompts)],
)


class ChatCompletionRequest(SamplingRequest):
    messages: ChatMessages  # type: ignore[valid-type]
    max_completion_tokens: int | None = Field(None, description="most tokens to generate (wins over max_tokens)")
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=-1, le=Limits.max_logprobs)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="function tools the model may call"
    )
    tool_choice: ToolChoice | None = Field(  # type: ignore[valid-type]
        None,
        description="'none', 'auto' (needs --tool-call-parser), 'required' or "
        "{type: function, function: {name}}; default 'auto' with tools",
    )
    parallel_tool_calls: bool | None = Field(None, description="with 'required': false generates exactly one call")
    modalities: Annotated[list[Literal["text"]], Field(max_length=1)] | None = Field(None, description="only ['text']")
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    include_reasoning: bool = Field(
        True, description="vLLM's: with --reasoning-parser, false leaves the thinking out of the answer"
    )
    thinking_token_budget: Annotated[int, Field(ge=-1)] | None = Field(
        None,
        description="vLLM's: with --reasoning-parser, the most tokens the model may think before its "
        "end-of-thinking token is forced; -1: no limit",
    )
    echo: bool = Field(
        False,
        description="vLLM's: the answer starts with the final message's content when that is an "
        "assistant message being continued (continue_final_message, or add_generation_prompt false)",
    )

    @property
    def conversations(self) -> list[list[ChatMessage]]:
        """The request's conversations: one, or a batch's."""
        msgs: Any = self.messages
        return msgs if self.batched else [msgs]

    @property
    def batched(self) -> bool:
        msgs: Any = self.messages
        return isinstance(msgs[0], list)

    chat_template_kwargs: TemplateKwargs | None = Field(
        None, description="vLLM's: extra variables for the chat template (e.g. enable_thinking)"
    )
    documents: Annotated[list[dict[str, str]], Field(max_length=1024)] | None = Field(
        None, description="vLLM's: documents for a retrieval template, each a mapping of strings ('title', 'text')"
    )
    add_special_tokens: bool = Field(
        False, description="vLLM's: the tokenizer adds its special tokens (a BOS) to the rendered prompt too"
    )


def _prompt_type(max_prompts: int) -> Any:
    ids = Annotated[list[TokenId], Field(min_length=1)]
    return _one_of(
        "a string, a list of strings, a list of token ids or a list of lists of token ids",
        text=str,
        list=Annotated[list[str], Field(min_length=1, max_length=max_prompts)],
        ids=ids,
        batch=Annotated[list[ids], Field(min_length=1, max_length=max_prompts)],
    )


Prompt = _prompt_type(Limits.max_prompts)


class CompletionRequest(SamplingRequest):
    prompt: Prompt  # type: ignore[valid-type]
    max_tokens: int | None = Field(16, description="most tokens to generate")
    echo: bool = False
    logprobs: Annotated[int, Field(ge=-1, le=Limits.max_logprobs)] | None = None
    best_of: Annotated[int, Field(ge=1, le=Limits.max_n)] | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class InputPart(Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: Annotated[list[Any], Field(max_length=256)] | None = Field(
        None, description=_NOOP + " (an earlier output's citations)"
    )
    logprobs: list[Any] | None = Field(None, description=_NOOP + " (an earlier output's logprobs)")


class InputImagePart(Strict):
    """The Responses API's image: a URL as chat's image_url takes (data:, http(s)://, file://)."""

    type: Literal["input_image"]
    image_url: Annotated[str, Field(min_length=1)]
    detail: Literal["auto", "low", "high"] | None = Field(
        None, description="accepted as OpenAI defines it; the model's processor decides the resolution"
    )


InputContentPart = _parts(
    "an input_text, output_text or input_image part",
    input_text=InputPart,
    output_text=InputPart,
    input_image=InputImagePart,
)


class InputItem(Strict):
    type: Literal["message"] | None = Field(None, description="only 'message' items")
    role: Literal["user", "system", "developer", "assistant"]
    content: _one_of(  # type: ignore[valid-type]
        "a string or a list of input_text and input_image parts",
        text=str,
        list=Annotated[list[InputContentPart], Field(max_length=256)],
    )
    id: Annotated[str, Field(max_length=256)] | None = Field(None, description=_NOOP + " (an earlier output item's id)")
    status: Literal["in_progress", "completed", "incomplete"] | None = Field(None, description=_NOOP)
    phase: Annotated[str, Field(max_length=64)] | None = Field(None, description=_NOOP + " (an earlier output item's)")


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(max_length=256)] | None = Field(None, description=_NOOP + " (a label)")
    description: str | None = Field(None, description=_NOOP + " (not shown to the model)")
    schema_: JsonSchema | None = Field(
        None, alias="schema", description="with type 'json_schema': the schema the output follows"
    )
    strict: bool | None = Field(None, description="false: properties the schema does not list may be generated")


class TextConfig(Strict):
    format: TextFormat | None = None


class ResponsesRequest(NoopFields):
    """OpenAI's Responses API, text in and out. Nothing is stored, so nothing can be fetched
    or continued later: ``previous_response_id``, ``conversation`` and tools are refused."""

    model: str | None = Field(None, description="served model name; optional")
    input: _one_of(  # type: ignore[valid-type]
        "a string or a list of message items",
        text=str,
        list=Annotated[list[InputItem], Field(min_length=1, max_length=4096)],
    )
    instructions: str | None = Field(None, description="a system message placed before the input")
    max_output_tokens: int | None = Field(None, description="most tokens to generate")
    temperature: float = 1.0
    top_p: float = 1.0
    stream: bool = Field(False, description="server-sent events named by their type")
    text: TextConfig | None = Field(None, description="'format': text, json_object or json_schema (structured outputs)")
    truncation: Literal["disabled"] | None = Field(
        None, description="only 'disabled': an input too long for the context is a 400"
    )
    cache_salt: CacheSalt | None = Field(None, description=CACHE_SALT_HELP)


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="with messages: rendered by the chat template as a chat request's tools are"
    )
    chat_template_kwargs: TemplateKwargs | None = Field(
        None, description="with messages: extra variables for the chat template, as on chat"
    )
    documents: Annotated[list[dict[str, str]], Field(max_length=1024)] | None = Field(
        None, description="with messages: documents for a retrieval template, as on chat"
    )
    return_token_strs: bool = False


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[TokenId]


class LoadLoRAAdapterRequest(Strict):
    """vLLM's body: serve the PEFT folder ``lora_path`` as model ``lora_name``."""

    lora_name: str = Field(
        min_length=1,
        max_length=256,
        pattern=r"^[^\x00-\x20\x7f](?:[^\x00-\x1f\x7f]*[^\x00-\x20\x7f])?$",
        description="the model name requests use: printable, no leading or trailing space",
    )
    lora_path: str = Field(min_length=1, max_length=4096)
    load_inplace: bool = Field(
        False, description="vLLM's: true serves the folder in place of an adapter loaded under the name"
    )


class UnloadLoRAAdapterRequest(Strict):
    """vLLM's body: stop serving adapter ``lora_name`` (``lora_int_id``, if given, must be its id)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


# -- Limits: the operator's bounds on top of the static models ----------------------------

M = TypeVar("M", bound=BaseModel)


@functools.cache
def bounded(model: type[M], limits: Limits) -> type[M]:
    """``model`` with ``limits``' bounds on the fields they apply to (cached: one class per pair)."""
    # -1 asks for the whole vocabulary; the engine refuses it unless --max-logprobs is -1 (no bound)
    most = None if limits.max_logprobs == -1 else limits.max_logprobs
    logprobs = Annotated[int, Field(ge=-1, le=most)] | None
    types: dict[str, Any] = {
        "n": Annotated[int, Field(le=limits.max_n)],
        "prompt_logprobs": logprobs,
        "top_logprobs": logprobs,
        "best_of": Annotated[int, Field(ge=1, le=limits.max_n)] | None,
    }
    if issubclass(model, CompletionRequest):  # chat's logprobs is a boolean; /tokenize's prompt one string
        types["logprobs"] = logprobs
        types["prompt"] = _prompt_type(limits.max_prompts)
    fields: dict[str, Any] = {}
    for name, typ in types.items():
        f = model.model_fields.get(name)
        if f is not None:
            fields[name] = (typ, Field(... if f.is_required() else f.default, description=f.description))
    made = create_model(model.__name__, __base__=model, __doc__=model.__doc__, **fields)
    return made


REQUEST_MODELS: dict[str, type[Strict]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/v1/load_lora_adapter": LoadLoRAAdapterRequest,
    "/v1/unload_lora_adapter": UnloadLoRAAdapterRequest,
}


# -- parsing: a ValidationError becomes one 400 naming the field ---------------------------


def parse(model: type[M], body: Any, limits: Limits) -> M:
    """``body`` (parsed JSON) as ``model`` under ``limits``; a 400 naming the field if it does not fit."""
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {_type_name(body)}")
    cls = bounded(model, limits)
    if cls.model_config.get("extra") == "forbid":
        # Unknown top-level keys are found here, in one pass: pydantic's error for each of
        # thousands of them would cost the event loop seconds.
        known = _keys(model)  # bounded() re-types fields, never adds or renames them
        extra = [k for k in body if k not in known]
        if extra:
            _unrecognized(extra, limits)
            body = {k: v for k, v in body.items() if k in known}
    while True:
        try:
            return cls.model_validate(body)
        except ValidationError as e:
            errors = e.errors(include_url=False)
        unknown = [_steps(body, err["loc"]) for err in errors if err["type"] == "extra_forbidden"]
        if not unknown:
            raise _first_error(errors[0], body)
        _unrecognized(list(dict.fromkeys(_path(steps) for steps in unknown)), limits)
        for steps in unknown:
            where = body
            for step in steps[:-1]:
                where = where[step]
            where.pop(steps[-1], None)


def _unrecognized(paths: list[str], limits: Limits) -> None:
    """Refuse the request's unknown fields (``paths``) with a 400 naming them, or, on a lenient
    server, log them and return (the caller drops them)."""
    names = listed(paths)
    if not limits.lenient:
        raise bad_request(
            f"Unrecognized request argument supplied: {names} (this server does not "
            f"implement {'it' if len(paths) == 1 else 'them'})",
            param=clip(paths[0]),
            code="unrecognized_argument",
        )
    log.warning("ignoring request fields this server does not implement: %s", names)


def _is_tag(part: int | str) -> bool:
    """A union's tag in an error location (``::shape`` or ``::type``, and dicts' ``[key]``)."""
    return isinstance(part, str) and (part.startswith("::") or part == "[key]")


def _steps(body: Any, loc: tuple[int | str, ...]) -> list[int | str]:
    """The keys and indexes of ``loc`` that are in the body (a union's tag is not; a missing
    field's name is, as the last step). Walked alongside the body, so a client's key that
    happens to look like a tag is still a key."""
    steps: list[int | str] = []
    for part in loc:
        if isinstance(body, dict) and part in body or isinstance(body, list) and isinstance(part, int):
            body = body[part]  # type: ignore[index]
        elif _is_tag(part):
            continue
        else:
            body = None
        steps.append(part)
    return steps


def _path(steps: list[int | str]) -> str:
    out = ""
    for part in steps:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _first_error(err: Any, body: Any) -> APIError:
    path = _path(_steps(body, err["loc"]))
    if err["type"] == "missing":
        return bad_request(f"'{path}' is required", param=path, code="missing_required_parameter")
    if err["type"] == "invalid_type":  # one of our unions: the message says what fits
        return bad_request(f"'{path}' {err['msg']}, got {_type_name(err['input'])}", param=path)
    msg = (
        "Input should be a JSON object"
        if err["type"] in ("model_type", "dict_type")
        else err["msg"].removeprefix("Value error, ")
    )
    return bad_request(f"'{path}': {msg} (got {_describe(err['input'])})", param=path)


def _describe(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return _type_name(value)
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _type_name(v: Any) -> str:
    names = {
        type(None): "null",
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
    }
    return names.get(type(v), type(v).__name__)


# -- from a parsed request to engine inputs -----------------------------------------------


def sampling_params(
    req: SamplingRequest,
    max_tokens: int | None,
    logprobs: int | None,
    kind: OutputKind,
    structured: StructuredOutputs | None = None,
    prompt_logprobs: int | None = None,
    engine: EngineClient | None = None,
    rename: dict[str, str] | None = None,
) -> SamplingParams:
    """Build SamplingParams, which holds the sampling bounds: a ParamError is a 400 naming the
    field. The sampling fields a request leaves out take the model's defaults, if it has any."""
    sampling = with_model_defaults(req, engine, SAMPLING_DEFAULT_KEYS)
    try:
        return SamplingParams(
            n=req.n,
            **sampling,
            seed=req.seed,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            max_tokens=max_tokens,
            logit_bias=req.logit_bias,  # type: ignore[arg-type]  # JSON keys: SamplingParams reads them as ids
            min_tokens=req.min_tokens,
            stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
            stop_token_ids=list(req.stop_token_ids or []),
            include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            logprob_token_ids=req.logprob_token_ids,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            output_kind=kind,
            structured_outputs=structured,
            prompt_logprobs=prompt_logprobs,
            kv_transfer_params=getattr(req, "kv_transfer_params", None),
            **(token_constraints(req, engine) if engine is not None else {}),
        )
    except ParamError as e:
        raise param_error(e, rename) from None


def with_model_defaults(req: BaseModel, engine: EngineClient | None, names: tuple[str, ...]) -> dict[str, Any]:
    """The request's ``names`` fields, each it leaves out as the model's generation_config.json
    recommends (``engine.sampling_defaults``), else as the request model's default; a name
    the request has no field for is the model's or left out (Responses has no top_k)."""
    defaults = engine.sampling_defaults if engine is not None else {}
    out = {}
    for n in names:
        if n in req.model_fields_set or (n not in defaults and n in type(req).model_fields):
            out[n] = getattr(req, n)
        elif n in defaults:
            out[n] = defaults[n]
    return out


def token_constraints(req: SamplingRequest, engine: EngineClient) -> dict[str, Any]:
    """vLLM's ``allowed_token_ids`` (the engine checks them against the vocabulary) and
    ``bad_words`` (tokenized with and without a leading space, as vLLM does)."""
    out: dict[str, Any] = {}
    if req.allowed_token_ids is not None:
        out["allowed_token_ids"] = list(req.allowed_token_ids)
    if req.bad_words:
        total = sum(len(w) for w in req.bad_words)
        if total > MAX_BAD_WORDS_TOTAL_CHARS:
            raise bad_request(
                f"the bad words may have at most {MAX_BAD_WORDS_TOTAL_CHARS} characters in all, got {total}",
                param="bad_words",
            )
        seqs: list[list[int]] = []
        for w in req.bad_words:
            for text in (w, " " + w) if not w.startswith(" ") else (w,):
                ids = engine.tokenize(text, False)
                if ids and ids not in seqs:
                    seqs.append(ids)
        out["bad_words_token_ids"] = seqs
    return out


def param_error(e: ParamError, rename: dict[str, str] | None = None) -> APIError:
    param = (rename or {}).get(e.param, e.param)
    return bad_request(f"'{param}': {e.message}", param=param)


def check_stream_options(req: SamplingRequest) -> None:
    """OpenAI refuses stream options on a request that does not stream; so do we. vLLM
    refuses prompt logprobs on a stream."""
    if req.stream_options is not None and not req.stream:
        raise bad_request(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.", param="stream_options"
        )
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("'prompt_logprobs' is not available when 'stream' is true", param="prompt_logprobs")


def check_unsupported_chat(req: ChatCompletionRequest) -> None:
    check_stream_options(req)
    if req.top_logprobs and not req.logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs' set to true", param="top_logprobs")
    if req.logprob_token_ids is not None and not req.logprobs:
        raise bad_request("'logprob_token_ids' needs 'logprobs' set to true", param="logprob_token_ids")
    _check_named_logprobs(req, req.top_logprobs)


def _check_named_logprobs(req: SamplingRequest, top: int | None) -> None:
    """The named tokens are shown in place of the top ones: asking for both is ambiguous."""
    if req.logprob_token_ids is not None and top:
        raise bad_request(
            "'logprob_token_ids' shows those tokens in place of the top logprobs; ask for one or the other",
            param="logprob_token_ids",
        )


def check_unsupported_completion(req: CompletionRequest) -> None:
    check_stream_options(req)
    if req.suffix:
        raise bad_request("'suffix' is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("'best_of' other than 'n' is not supported", param="best_of")
    _check_named_logprobs(req, req.logprobs)


# -- output constraints -------------------------------------------------------------------


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
    why = unenforced(value)
    if why is not None:
        raise bad_request(f"'{param}': invalid JSON schema: {why}", param=param)
    return json.dumps(value)  # key order kept: it is the order properties are generated in


def structured_spec(req: SamplingRequest) -> tuple[StructuredOutputs | None, str]:
    """The one output constraint a request asks for, and the field that asked (for errors)."""
    found: list[tuple[str, StructuredOutputs]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type != "json_schema" and fmt.json_schema is not None:
        raise bad_request(
            f"'response_format.json_schema' applies to type 'json_schema' only, not {fmt.type!r}",
            param="response_format.json_schema",
        )
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", StructuredOutputs("json_object")))
    elif fmt is not None and fmt.type == "json_schema":
        js = fmt.json_schema
        if js is None or js.schema_ is None:
            raise bad_request(
                "response_format 'json_schema' needs 'json_schema.schema'",
                param="response_format.json_schema.schema" if js else "response_format.json_schema",
            )
        param = "response_format.json_schema.schema"
        found.append((param, StructuredOutputs("json", _schema_text(js.schema_, param), js.strict is not False)))
    so = req.structured_outputs
    if so is not None:
        for key, value in (
            ("json", so.json_),
            ("regex", so.regex),
            ("choice", so.choice),
            ("grammar", so.grammar),
            ("json_object", so.json_object),
        ):
            if value is not None and value is not False:
                found.append((f"structured_outputs.{key}", _structured_one(key, value, f"structured_outputs.{key}")))
        if not found or not found[-1][0].startswith("structured_outputs."):  # as vLLM: one kind, not none
            raise bad_request(
                "'structured_outputs' needs one of json, regex, choice, grammar or json_object",
                param="structured_outputs",
            )
    for key, value in (
        ("json", req.guided_json),
        ("regex", req.guided_regex),
        ("choice", req.guided_choice),
        ("grammar", req.guided_grammar),
    ):
        if value is not None:
            found.append((f"guided_{key}", _structured_one(key, value, f"guided_{key}")))
    if len(found) > 1:
        raise bad_request(f"'{found[1][0]}' and '{found[0][0]}' both constrain the output; give one", param=found[1][0])
    return (found[0][1], found[0][0]) if found else (None, "structured_outputs")


def text_format_spec(fmt: TextFormat | None) -> StructuredOutputs | None:
    """The Responses API's ``text.format`` as the output constraint chat's ``response_format`` maps to."""
    if fmt is not None and fmt.type != "json_schema":  # OpenAI's text and json_object take their type alone
        extra = next((k for k in ("name", "description", "schema_", "strict") if getattr(fmt, k) is not None), None)
        if extra is not None:
            key = extra.rstrip("_")
            raise bad_request(
                f"'text.format.{key}' applies to type 'json_schema' only, not {fmt.type!r}", param=f"text.format.{key}"
            )
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputs("json_object")
    if fmt.schema_ is None:
        raise bad_request("text.format 'json_schema' needs 'text.format.schema'", param="text.format.schema")
    return StructuredOutputs("json", _schema_text(fmt.schema_, "text.format.schema"), fmt.strict is not False)


def _structured_one(key: str, value: Any, param: str) -> StructuredOutputs:
    if key == "json":
        return StructuredOutputs("json", _schema_text(value, param))
    if key == "json_object":
        return StructuredOutputs("json_object")
    if key == "choice":
        return StructuredOutputs("grammar", choice_grammar(value))
    return StructuredOutputs(key, value)  # regex, grammar
