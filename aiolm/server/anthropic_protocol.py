"""The request and answer bodies of Anthropic's Messages API (``/v1/messages`` and
``/v1/messages/count_tokens``), as pydantic models.

Requests follow protocol.py's rules (parsed once by ``protocol.parse``: unknown fields
are a 400 naming them, null is absent); answers, like output_models.py's, are what
``/openapi.json`` documents. The names and shapes are Anthropic's; anthropic_messages.py
maps a parsed request onto the chat path. Class names carry an ``Anthropic`` prefix where
the OpenAI models already use the plain one: /openapi.json keys its schemas by class name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from aiolm.server.output_models import Out
from aiolm.server.protocol import MAX_TOOLS, JsonSchema, NonEmptyStr, Strict, _one_of

_CACHE = "accepted for Anthropic compatibility; has no effect (prefix caching is automatic)"
# Anthropic's rule for tool names, which is also OpenAI's (tools.py checks the same).
ToolName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class AnthropicCacheControl(Strict):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class AnthropicTextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: AnthropicCacheControl | None = Field(None, description=_CACHE)
    citations: Annotated[list[Any], Field(max_length=0)] | None = Field(
        None, description="null or empty (an earlier turn's block as the SDK dumps it): no citations are made"
    )


class AnthropicToolUseBlock(Strict):
    """An earlier assistant turn's call: rendered as the chat template's tool call."""

    type: Literal["tool_use"]
    id: NonEmptyStr
    name: ToolName
    input: dict[str, Any]
    cache_control: AnthropicCacheControl | None = Field(None, description=_CACHE)
    caller: None = Field(None, description="null only (an earlier turn's block as the SDK dumps it)")
    toolset_name: None = Field(None, description="null only (an earlier turn's block as the SDK dumps it)")


class AnthropicToolResultBlock(Strict):
    """A tool's answer to the call ``tool_use_id``: rendered as a ``tool`` message."""

    type: Literal["tool_result"]
    tool_use_id: NonEmptyStr
    content: (
        _one_of(  # type: ignore[valid-type]
            "a string or a list of text blocks",
            text=str,
            list=Annotated[list[AnthropicTextBlock], Field(max_length=256)],
        )
        | None
    ) = None
    is_error: bool | None = Field(None, description="accepted; the content is shown to the model as it is")
    cache_control: AnthropicCacheControl | None = Field(None, description=_CACHE)


class AnthropicThinkingBlock(Strict):
    """An earlier assistant turn's thinking: given to the chat template as that message's
    ``reasoning_content`` (most templates leave out past turns' thinking)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = Field(None, description="accepted; aiolm signs nothing, so checks nothing")
    cache_control: AnthropicCacheControl | None = Field(None, description=_CACHE)


class AnthropicRedactedThinkingBlock(Strict):
    """An earlier turn's encrypted thinking, from Anthropic's own models: left out of the prompt."""

    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[
    AnthropicTextBlock
    | AnthropicToolUseBlock
    | AnthropicToolResultBlock
    | AnthropicThinkingBlock
    | AnthropicRedactedThinkingBlock,
    Field(discriminator="type"),
]


class AnthropicMessage(Strict):
    role: Literal["user", "assistant"]
    content: _one_of(  # type: ignore[valid-type]
        "a string or a list of content blocks",
        text=str,
        list=Annotated[list[Block], Field(max_length=1024)],
    )


class AnthropicTool(Strict):
    type: Literal["custom"] | None = Field(None, description="only client tools ('custom')")
    name: ToolName
    description: str | None = None
    input_schema: JsonSchema = Field(description="a JSON schema of the input object")
    cache_control: AnthropicCacheControl | None = Field(None, description=_CACHE)


_PARALLEL = "true: at most one tool_use block"


class AnthropicToolChoiceAuto(Strict):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = Field(None, description=_PARALLEL)


class AnthropicToolChoiceAny(Strict):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = Field(None, description=_PARALLEL)


class AnthropicToolChoiceTool(Strict):
    type: Literal["tool"]
    name: NonEmptyStr
    disable_parallel_tool_use: bool | None = Field(None, description="accepted; one call of the named tool")


class AnthropicToolChoiceNone(Strict):
    type: Literal["none"]


AnthropicToolChoice = Annotated[
    AnthropicToolChoiceAuto | AnthropicToolChoiceAny | AnthropicToolChoiceTool | AnthropicToolChoiceNone,
    Field(discriminator="type"),
]


class AnthropicMetadata(Strict):
    user_id: Annotated[str, Field(max_length=256)] | None = Field(
        None, description="accepted; shown in the access log only"
    )


_DISPLAY = "summarized (the default) or absent: the thinking is returned as the model wrote it"


class AnthropicThinkingEnabled(Strict):
    """Thinking, capped at ``budget_tokens`` (then the end of the thinking is forced)."""

    type: Literal["enabled"]
    budget_tokens: Annotated[int, Field(ge=1024)]
    display: Literal["summarized"] | None = Field(None, description=_DISPLAY)


class AnthropicThinkingAdaptive(Strict):
    """Thinking as long as the model likes."""

    type: Literal["adaptive"]
    display: Literal["summarized"] | None = Field(None, description=_DISPLAY)


class AnthropicThinkingDisabled(Strict):
    """No thinking: the template is asked not to think, and a model that still opens its
    thinking has it closed at once."""

    type: Literal["disabled"]


AnthropicThinking = Annotated[
    AnthropicThinkingEnabled | AnthropicThinkingAdaptive | AnthropicThinkingDisabled,
    Field(discriminator="type"),
]


class MessagesPrompt(Strict):
    """What a prompt is made of: the fields /v1/messages and /v1/messages/count_tokens share."""

    model: str | None = Field(None, description="served model name")
    system: (
        _one_of(  # type: ignore[valid-type]
            "a string or a list of text blocks",
            text=str,
            list=Annotated[list[AnthropicTextBlock], Field(max_length=256)],
        )
        | None
    ) = Field(None, description="a system message placed before the messages")
    messages: Annotated[list[AnthropicMessage], Field(min_length=1, max_length=4096)] = Field(
        description="alternating user and assistant turns; a final assistant turn is continued"
    )
    tools: Annotated[list[AnthropicTool], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="client tools the model may call, rendered by the chat template"
    )
    tool_choice: AnthropicToolChoice | None = Field(
        None,
        description="auto (the default with tools; needs --tool-call-parser), any or tool (the call is "
        "generated to the schema), none",
    )
    cache_control: AnthropicCacheControl | None = Field(None, description=_CACHE)
    thinking: AnthropicThinking | None = Field(
        None,
        description="with --reasoning-parser: enabled (budget_tokens caps the thinking), adaptive, or "
        "disabled; absent: as the chat template decides",
    )


class MessagesRequest(MessagesPrompt):
    """Anthropic's Messages API, text and client tools."""

    max_tokens: Annotated[int, Field(ge=1)] = Field(description="most tokens to generate")
    stop_sequences: Annotated[list[NonEmptyStr], Field(max_length=64)] | None = Field(
        None, description="generation stops at the first of these; it is not part of the text"
    )
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = Field(0, description="0 disables")
    metadata: AnthropicMetadata | None = None
    stream: bool = Field(False, description="server-sent events named by their type")


class CountTokensRequest(MessagesPrompt):
    """The prompt of a /v1/messages request, counted as it would be rendered."""


# -- answers --------------------------------------------------------------------------------


class AnthropicUsage(Out):
    input_tokens: int = Field(description="prompt tokens not served from the prefix cache")
    output_tokens: int
    cache_read_input_tokens: int = Field(description="prompt tokens served from the prefix cache")
    cache_creation_input_tokens: int = Field(description="always 0: prefix caching is automatic")


class AnthropicContentBlock(Out):
    type: Literal["thinking", "text", "tool_use"]
    thinking: str | None = None
    signature: str | None = None
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None


class AnthropicMessageResponse(Out):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[AnthropicContentBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: AnthropicUsage


class AnthropicTokenCount(Out):
    input_tokens: int


class AnthropicErrorDetail(Out):
    type: str
    message: str


class AnthropicErrorResponse(Out):
    """Every failure on the /v1/messages routes has this body (anthropic_errors.py)."""

    type: Literal["error"]
    error: AnthropicErrorDetail


_EVENTS = (
    "`event: <type>` and `data: {event}` pairs: message_start, ping, then per content block "
    "content_block_start, content_block_delta (text_delta, or input_json_delta for a tool_use "
    "block), content_block_stop, then message_delta (stop_reason, stop_sequence, usage) and "
    "message_stop; an `error` event if the engine failed"
)
# (path, summary, request, answer, what a stream carries) of each route
ANTHROPIC_POSTS: list[tuple[str, str, type[Strict], type[Out], str | None]] = [
    ("/v1/messages", "Create message (Anthropic)", MessagesRequest, AnthropicMessageResponse, _EVENTS),
    ("/v1/messages/count_tokens", "Count message tokens (Anthropic)", CountTokensRequest, AnthropicTokenCount, None),
]
ANTHROPIC_REQUEST_MODELS: dict[str, type[Strict]] = {path: body for path, _, body, _, _ in ANTHROPIC_POSTS}
