"""The request and answer bodies of the pooling APIs (``--runner pooling``), as pydantic models.

Requests follow protocol.py's rules (parsed once by ``protocol.parse``: unknown fields are
a 400, null is absent); answers, like output_models.py's, are what ``/openapi.json``
documents and what the tests validate real answers against. The shapes and names are
vLLM's (``/pooling``, ``/score``, ``/classify``), OpenAI's (``/v1/embeddings``) and
Jina's and Cohere's (``/rerank``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from aiolm.server.output_models import Out
from aiolm.server.protocol import NonEmptyStr, Strict, TokenId, _one_of

# Inputs (texts, token lists, documents, pairs) in one request: OpenAI's limit for an
# embeddings batch. Each is one engine request; how many of them are in the engine at
# once is pooling.py's window.
MAX_POOLING_INPUTS = 2048


TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Texts = Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_POOLING_INPUTS)]
PoolingInput = _one_of(
    "a non-empty string, a list of strings, a list of token ids or a list of lists of token ids",
    text=NonEmptyStr,
    list=Texts,
    ids=TokenIds,
    batch=Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_POOLING_INPUTS)],
)
TextOrTexts = _one_of("a non-empty string or a list of non-empty strings", text=NonEmptyStr, list=Texts)

_TRUNCATE = (
    "vLLM's: keep the first N tokens of each input (a positive N, or -1: as many as the model takes); "
    "without it, an input over the model's length is a 400"
)
_PRIORITY = "vLLM's: lower runs first (needs --allow-request-priority)"


class PoolingFields(Strict):
    """What every pooling request may carry."""

    model: str | None = Field(None, description="served model name; optional")
    truncate_prompt_tokens: int | None = Field(None, description=_TRUNCATE)
    priority: Annotated[int, Field(ge=-(2**31), le=2**31 - 1)] = Field(0, description=_PRIORITY)


class EmbeddingRequest(PoolingFields):
    """OpenAI's embeddings request, with vLLM's extensions."""

    input: PoolingInput = Field(  # type: ignore[valid-type]
        description=f"the texts or token ids to embed, at most {MAX_POOLING_INPUTS}"
    )
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: each embedding as the base64 of its little-endian float32 values"
    )
    dimensions: Annotated[int, Field(ge=1)] | None = Field(
        None, description="keep the first N values (matryoshka models only), normalised after the cut"
    )
    normalize: bool | None = Field(None, description="vLLM's: override the model's own choice to normalise")
    user: Annotated[str, Field(max_length=256)] | None = Field(
        None, description="accepted for OpenAI compatibility; logged only"
    )


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling: the model's raw pooled output per input (an embedding, or a
    classifier's logits)."""


class ScoreRequest(PoolingFields):
    """vLLM's /score: pairs 1-to-1, 1-to-N (one text_1) or N-to-N (zipped)."""

    text_1: TextOrTexts  # type: ignore[valid-type]
    text_2: TextOrTexts  # type: ignore[valid-type]


class RerankRequest(PoolingFields):
    """Jina's and Cohere's rerank request (vLLM's /rerank)."""

    query: NonEmptyStr
    documents: Texts
    top_n: Annotated[int, Field(ge=0)] | None = Field(None, description="the best N results; 0 or absent: all")
    return_documents: bool = Field(True, description="each result carries its document's text")


class ClassifyRequest(PoolingFields):
    """vLLM's /classify: a sequence classifier's label and probabilities per input."""

    input: PoolingInput = Field(  # type: ignore[valid-type]
        description=f"the texts or token ids to classify, at most {MAX_POOLING_INPUTS}"
    )
    user: Annotated[str, Field(max_length=256)] | None = Field(None, description="logged only")


# -- answers ------------------------------------------------------------------------------


class PoolingUsage(Out):
    prompt_tokens: int
    total_tokens: int


class Embedding(Out):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str = Field(description="floats, or their base64 with encoding_format 'base64'")


class EmbeddingList(Out):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[Embedding]
    usage: PoolingUsage


class PoolingData(Out):
    object: Literal["pooling"]
    index: int
    data: list[float] | str


class PoolingList(Out):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[PoolingData]
    usage: PoolingUsage


class ScoreData(Out):
    object: Literal["score"]
    index: int
    score: float


class ScoreList(Out):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankDocument(Out):
    text: str


class RerankResult(Out):
    index: int = Field(description="the document's position in the request")
    relevance_score: float
    document: RerankDocument | None = Field(None, description="absent when return_documents is false")


class RerankUsage(Out):
    total_tokens: int


class RerankResponse(Out):
    """Results best first."""

    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class Classification(Out):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassificationList(Out):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[Classification]
    usage: PoolingUsage


# (path, summary, request model, answer model) of each pooling route; a summary names its
# operation, so each is unique
POOLING_POSTS: list[tuple[str, str, type[Strict], type[Out]]] = [
    ("/v1/embeddings", "Create embeddings", EmbeddingRequest, EmbeddingList),
    ("/pooling", "Pool", PoolingRequest, PoolingList),
    ("/score", "Score", ScoreRequest, ScoreList),
    ("/v1/score", "Score (v1 path)", ScoreRequest, ScoreList),
    ("/rerank", "Rerank", RerankRequest, RerankResponse),
    ("/v1/rerank", "Rerank (v1 path)", RerankRequest, RerankResponse),
    ("/v2/rerank", "Rerank (v2 path)", RerankRequest, RerankResponse),
    ("/classify", "Classify", ClassifyRequest, ClassificationList),
]
POOLING_REQUEST_MODELS: dict[str, type[Strict]] = {path: body for path, _, body, _ in POOLING_POSTS}
