"""The response bodies of the OpenAI-compatible API, as pydantic models.

Handlers build their JSON directly (the hot streaming path stays plain dicts); these
models are what ``/openapi.json`` documents for each answer, and the server tests
validate real answers against them, so the document cannot drift from what is sent.
Unknown keys are allowed: a client must ignore fields it does not know.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(Out):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Out):
    """Every failure has this body (errors.py), whatever the status."""

    error: ErrorDetail


class PromptTokensDetails(Out):
    cached_tokens: int


class Usage(Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class Choice(Out):
    index: int
    finish_reason: str | None = None


class CompletionLike(Out):
    id: str
    object: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = Field(
        None, description="a prefill instance's answer to do_remote_decode: where a decode instance reads the KV"
    )


class ChatCompletion(CompletionLike):
    """``object`` 'chat.completion'; a stream sends 'chat.completion.chunk' objects of the same shape."""


class Completion(CompletionLike):
    """``object`` 'text_completion', in a stream too."""


class OutputText(Out):
    type: Literal["output_text"]
    text: str
    annotations: list[Any] = Field(max_length=0)
    logprobs: list[Any] = Field(max_length=0)


class OutputMessage(Out):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: str
    content: list[OutputText]


class ReasoningText(Out):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(Out):
    """With --reasoning-parser: the thinking, before the message."""

    id: str
    type: Literal["reasoning"]
    summary: list[Any]
    content: list[ReasoningText]
    status: str


class IncompleteDetails(Out):
    reason: Literal["max_output_tokens"]


class InputTokensDetails(Out):
    cached_tokens: int


class OutputTokensDetails(Out):
    reasoning_tokens: int


class ResponseUsage(Out):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens_details: OutputTokensDetails


class Response(Out):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, Any] = {}
    model: str
    temperature: float
    top_p: float
    text: dict[str, Any]
    user: str | None = None
    output: list[Annotated[ReasoningItem | OutputMessage, Field(discriminator="type")]]
    usage: ResponseUsage | None


class TokenizeResponse(Out):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = Field(description="null unless 'return_token_strs'")


class DetokenizeResponse(Out):
    prompt: str


class TokenizerInfo(Out):
    """The tokenizer's configuration (tokenizer_config.json's keys, less file paths)."""

    tokenizer_class: str
    vocab_size: int
    max_model_len: int
    model_max_length: float | None = Field(None, description="the tokenizer's own limit")
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None


class ModelCard(Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str = Field(description="the base model's name, or a LoRA adapter's folder")
    parent: str | None = Field(description="a LoRA adapter's base model; null for the base model")
    max_model_len: int


class ModelList(Out):
    object: Literal["list"]
    data: list[ModelCard]


class ServerLoad(Out):
    server_load: int = Field(description="generation requests being served now")


class Status(Out):
    status: str


class Version(Out):
    version: str
