"""What speculation is asked for, and which requests may take part."""

from __future__ import annotations

from dataclasses import dataclass

from aiolm.params import SamplingParams

METHODS = ("ngram",)


@dataclass(frozen=True)
class SpecConfig:
    """``--speculative ngram``: up to ``num_speculative_tokens`` drafts per step, copied from
    what followed the longest earlier match (``prompt_lookup_min``..``prompt_lookup_max``
    tokens) of the sequence's suffix within its last ``search_window`` tokens.

    Adaptive (``stats.AcceptanceWindow``): a request whose drafts were accepted at a
    rate below ``min_acceptance`` over its last ``window`` verifications stops drafting
    for ``backoff`` steps (doubling while it stays low), and each draft is at most one
    longer than the accepted run before it, so text that does not repeat pays little
    for the wider forward passes. On a CPU every verified position costs a good part
    of a decode step (docs/benchmarks/log.md, "Speculative decoding, n-gram"), so a low
    acceptance is a net loss there.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    search_window: int = 2048
    window: int = 8
    min_acceptance: float = 0.4
    backoff: int = 16

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative: {self.method!r} is not supported; supported: {', '.join(METHODS)}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if self.prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be >= 1, got {self.prompt_lookup_min}")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(
                f"prompt_lookup_max ({self.prompt_lookup_max}) must be >= prompt_lookup_min ({self.prompt_lookup_min})"
            )
        if self.search_window <= self.prompt_lookup_max:
            raise ValueError("search_window must exceed prompt_lookup_max")
        if self.window < 1 or self.backoff < 1 or not 0.0 <= self.min_acceptance <= 1.0:
            raise ValueError("window and backoff must be >= 1 and min_acceptance in [0, 1]")


def supports_speculation(params: SamplingParams) -> bool:
    """Whether a request's drafts can be verified exactly.

    The worker verifies position j of a step as its own sampling row whose history is
    the output plus drafts[:j] (``aiolm/sample/rejection.py``), which every history-
    derived logits processor (bias, allowed ids, bad words, min tokens, penalties)
    handles exactly. Two kinds of request cannot take part:

    * structured outputs: the grammar processor keeps one live matcher per request
      (``logits_processors/grammar.py``), which cannot be at several positions at once;
    * seeded random sampling: a resumed request replays one generator draw per output
      token (``worker/input_batch.py``), and verification draws one per position,
      accepted or not, so the replay would not continue the same sequence.
    """
    if params.structured_outputs is not None:
        return False
    if params.seed is not None and not (params.greedy or params.top_k == 1):
        return False
    return True
