"""What users get back from generate(): vLLM-shaped, cumulative by default."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token and the top-N).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token: None for the first (nothing scores it), then as above.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    prompt_logprobs: PromptLogprobs | None = None  # when SamplingParams.prompt_logprobs asked
    # A prefill instance's answer (do_remote_decode): where a decode instance finds the KV.
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class PoolingOutput:
    """One input's pooled result: an embedding, a classifier's logits, or a pair's logits.
    The names vLLM users read are views of ``data``."""

    data: list[float]

    @property
    def embedding(self) -> list[float]:
        return self.data

    @property
    def logits(self) -> list[float]:
        return self.data


@dataclass
class PoolingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True
    prompt: str | None = None
