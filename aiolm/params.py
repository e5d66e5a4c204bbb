"""Sampling parameters: one validated object per request.

Validation happens at construction so a bad request fails at the API edge with
an error that names the offending field, never deep inside a worker. This is the
one place the sampling bounds live: the HTTP server's request models
(server/protocol.py) fix types only and turn a ``ParamError`` into the 400.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from aiolm.kv_transfer.params import check_kv_transfer_params
from aiolm.structured.spec import KINDS, StructuredOutputs


class ParamError(ValueError):
    """A request parameter is invalid; ``param`` names the field (OpenAI's ``param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled whole: a data-parallel replica's refusal reaches the front end as itself.
        return type(self), (self.param, self.message), self.__dict__


class OutputKind(enum.Enum):
    """Whether each streamed RequestOutput holds everything so far or only the new part."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


_GREEDY_EPS = 1e-5
_INT32_MAX = 2**31 - 1  # counts stay in a fixed-width integer wherever they travel (wire codec, tensors)
# Stop strings are searched on the event loop for every generated token of every
# sequence: their count and length bound that work (docs/reliability.md).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOTAL_CHARS = 4096
MAX_STOP_TOKEN_IDS = 1024
MAX_CACHE_SALT_CHARS = 1024  # a prompt's cache_salt, hashed into its first block
MAX_LOGPROB_TOKEN_IDS = 1024  # logprob_token_ids per request: each costs a gather per generated token


def _shown(v: Any) -> str:
    """A client's value in an error; an integer may have thousands of digits (past str()'s limit)."""
    if isinstance(v, int) and not isinstance(v, bool) and not -(2**63) <= v < 2**63:
        return "an integer past 64 bits"
    return repr(v)


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop, for one request (``n`` sequences)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # None: every token; else only these
    # Token sequences never to complete: the last token of each is forbidden whenever the
    # output so far ends with the ones before it (a one-token sequence: always).
    bad_words_token_ids: list[list[int]] | None = None
    max_tokens: int | None = 16  # None: until max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs besides the sampled one
    # vLLM's: these tokens' logprobs at every generated position, after the top ones (the
    # engine asks for the sampled token's alone when ``logprobs`` is None).
    logprob_token_ids: list[int] | None = None
    # Logprobs of each prompt token given the ones before it (the first has none), with
    # this many top alternatives; such a request does not reuse cached prefix blocks.
    prompt_logprobs: int | None = None
    # The output must match this grammar (aiolm/structured/); the engine validates its text.
    structured_outputs: StructuredOutputs | None = None
    # vLLM's: the most tokens a reasoning model may think; past them its end-of-thinking token
    # is forced. -1 or None: no limit. It needs ``thinking_markers``.
    thinking_token_budget: int | None = None
    # (end, opens): the one-token marker that ends the thinking, and the one that starts it where
    # the model chooses whether to think (None: the output starts inside the thinking). The
    # server fills them from --reasoning-parser (aiolm/server/reasoning.py).
    thinking_markers: tuple[int, int | None] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: OutputKind = OutputKind.CUMULATIVE
    # Filled by the engine from the model (generation_config / tokenizer), not by users:
    # the token ids that end a sequence unless ``ignore_eos``.
    eos_token_ids: tuple[int, ...] = ()
    # Prefill/decode disaggregation (aiolm/kv_transfer/params.py): vLLM's kv_transfer_params.
    kv_transfer_params: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.top_k == -1:
            self.top_k = 0
        if self.thinking_token_budget == -1:
            self.thinking_token_budget = None
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ParamError(name, msg)

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: Any) -> bool:  # finite: infinity or NaN would poison every logit it touches
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                return False
            return abs(v) < 2**1000 if isinstance(v, int) else math.isfinite(v)  # an int must fit a float

        def is_id(v: Any) -> bool:  # a token id: it crosses to the workers as a 64-bit integer
            return is_int(v) and 0 <= v < 2**63

        check(is_int(self.n) and self.n >= 1, "n", f"must be an integer >= 1, got {_shown(self.n)}")
        for name in (
            "include_stop_str_in_output",
            "ignore_eos",
            "skip_special_tokens",
            "spaces_between_special_tokens",
        ):
            v = getattr(self, name)
            check(isinstance(v, bool), name, f"must be true or false, got {v!r}")
        if self.kv_transfer_params is not None:
            why = check_kv_transfer_params(self.kv_transfer_params)
            check(why is None, "kv_transfer_params", why or "")
            check(self.n == 1, "kv_transfer_params", "needs n = 1 (one sequence's KV moves)")
        check(
            is_num(self.temperature) and self.temperature >= 0,
            "temperature",
            f"must be a number >= 0, got {_shown(self.temperature)}",
        )
        check(is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {_shown(self.top_p)}")
        check(
            is_int(self.top_k) and 0 <= self.top_k <= _INT32_MAX,
            "top_k",
            f"must be -1, 0 (disabled) or a positive 32-bit integer, got {_shown(self.top_k)}",
        )
        check(is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {_shown(self.min_p)}")
        check(
            self.seed is None or (is_int(self.seed) and -(2**63) <= self.seed < 2**63 - 1024),
            "seed",
            f"must be a 64-bit signed integer, got {_shown(self.seed)}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            check(is_num(v) and -2 <= v <= 2, name, f"must be in [-2, 2], got {_shown(v)}")
        check(
            is_num(self.repetition_penalty) and self.repetition_penalty > 0,  # any, as vLLM and HF take
            "repetition_penalty",
            f"must be a number > 0, got {_shown(self.repetition_penalty)}",
        )
        if self.logit_bias is not None:
            check(isinstance(self.logit_bias, dict), "logit_bias", "must be a map of token id to bias")
            clean: dict[int, float] = {}
            for k, v in self.logit_bias.items():
                # a token id, or its decimal digits as a JSON key carries it ("5", not "05", " 5",
                # "+5" or "1_0", which int() reads too and which could name one token twice)
                if is_int(k):
                    tok = k
                elif isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 19 and str(int(k)) == k:
                    tok = int(k)
                else:
                    raise ParamError("logit_bias", f"key {k!r} is not a token id")
                check(is_id(tok), "logit_bias", f"key {_shown(tok)} is not a token id")
                check(tok not in clean, "logit_bias", f"token {tok} is given twice")
                check(
                    is_num(v) and -100 <= v <= 100,
                    "logit_bias",
                    f"bias for token {tok} must be in [-100, 100], got {_shown(v)}",
                )
                clean[tok] = float(v)
            self.logit_bias = clean
        if self.allowed_token_ids is not None:
            check(
                isinstance(self.allowed_token_ids, list)
                and len(self.allowed_token_ids) > 0
                and all(is_id(t) for t in self.allowed_token_ids),
                "allowed_token_ids",
                "must be a non-empty list of non-negative integers",
            )
        if self.bad_words_token_ids is not None:
            check(
                isinstance(self.bad_words_token_ids, list)
                and all(isinstance(w, list) and w and all(is_id(t) for t in w) for w in self.bad_words_token_ids),
                "bad_words_token_ids",
                "must be a list of non-empty lists of non-negative integers",
            )
        check(
            self.max_tokens is None or (is_int(self.max_tokens) and 1 <= self.max_tokens < 2**63),
            "max_tokens",
            f"must be an integer from 1 to 2**63 - 1, got {_shown(self.max_tokens)}",
        )
        check(
            is_int(self.min_tokens) and 0 <= self.min_tokens <= _INT32_MAX,
            "min_tokens",
            f"must be an integer in [0, {_INT32_MAX}], got {_shown(self.min_tokens)}",
        )
        if self.max_tokens is not None:
            check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )
        check(
            isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "must be a non-empty string or a list of non-empty strings",
        )
        check(
            len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}"
        )
        longest = max((len(s) for s in self.stop), default=0)
        check(
            longest <= MAX_STOP_STRING_CHARS,
            "stop",
            f"each stop string may have at most {MAX_STOP_STRING_CHARS} characters, one has {longest}",
        )
        total = sum(len(s) for s in self.stop)
        check(
            total <= MAX_STOP_TOTAL_CHARS,
            "stop",
            f"the stop strings may have at most {MAX_STOP_TOTAL_CHARS} characters in all, got {total}",
        )
        check(
            isinstance(self.stop_token_ids, list) and all(is_id(t) for t in self.stop_token_ids),
            "stop_token_ids",
            "must be a list of non-negative integers",
        )
        check(
            len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
            "stop_token_ids",
            f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(self.stop_token_ids)}",
        )
        # The upper bound is the engine's --max-logprobs, checked where the engine is known
        # (engine/input.py), so one flag sets it for the server and the library alike.
        # -1 (vLLM's): every token of the vocabulary, resolved by the engine, which knows it.
        check(
            self.logprobs is None or (is_int(self.logprobs) and self.logprobs >= -1),
            "logprobs",
            f"must be an integer >= 0, or -1 for the whole vocabulary, got {_shown(self.logprobs)}",
        )
        check(
            self.prompt_logprobs is None or (is_int(self.prompt_logprobs) and self.prompt_logprobs >= -1),
            "prompt_logprobs",
            f"must be an integer >= 0, or -1 for the whole vocabulary, got {_shown(self.prompt_logprobs)}",
        )
        check(
            self.logprob_token_ids is None
            or (
                isinstance(self.logprob_token_ids, list)
                and 0 < len(self.logprob_token_ids) <= MAX_LOGPROB_TOKEN_IDS
                and all(is_id(t) for t in self.logprob_token_ids)
            ),
            "logprob_token_ids",
            f"must be a list of 1 to {MAX_LOGPROB_TOKEN_IDS} non-negative token ids",
        )
        if self.structured_outputs is not None:
            so = self.structured_outputs
            check(
                isinstance(so, StructuredOutputs) and so.kind in KINDS and isinstance(so.text, str),
                "structured_outputs",
                f"must be StructuredOutputs with a kind in {KINDS}",
            )
        if self.thinking_token_budget is not None:
            check(
                is_int(self.thinking_token_budget) and 0 <= self.thinking_token_budget <= _INT32_MAX,
                "thinking_token_budget",
                f"must be an integer >= 0, or -1 for no limit, got {_shown(self.thinking_token_budget)}",
            )
            check(
                self.thinking_markers is not None,
                "thinking_token_budget",
                "needs a reasoning model's thinking markers (serve with --reasoning-parser)",
            )
        if self.thinking_markers is not None:
            marks = self.thinking_markers
            check(
                isinstance(marks, tuple)
                and len(marks) == 2
                and is_id(marks[0])
                and (marks[1] is None or is_id(marks[1])),
                "thinking_markers",
                "must be (end token id, start token id or None)",
            )
        check(isinstance(self.output_kind, OutputKind), "output_kind", "must be an OutputKind")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            setattr(self, name, float(getattr(self, name)))  # an int of any size crosses to the workers as a float

    @property
    def greedy(self) -> bool:
        """Greedy rows take the argmax and stay exact whatever else is in the batch."""
        return self.temperature < _GREEDY_EPS

    def stop_ids(self) -> set[int]:
        """Token ids that finish a sequence (EOS unless ignored, plus ``stop_token_ids``)."""
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids.update(self.eos_token_ids)
        return ids

    def clone(self, **changes: Any) -> SamplingParams:
        return replace(self, **changes)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters (aiolm/engine/beam_search.py runs the search).

    ``temperature`` only picks each step's sampled token, which joins the top
    ``2 * beam_width`` candidates of its beam (scores are raw logprobs, so at 0 the
    search is exact and deterministic). ``length_penalty`` divides a finished beam's
    cumulative logprob by ``length ** length_penalty`` when beams are ranked.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    # aiolm's: token ids that end a beam besides the model's EOS (the server's stop_token_ids)
    stop_token_ids: list[int] = field(default_factory=list)
    skip_special_tokens: bool = True  # for each beam's text

    def __post_init__(self) -> None:
        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not (is_int(self.beam_width) and self.beam_width >= 1):
            raise ParamError("beam_width", f"must be an integer >= 1, got {_shown(self.beam_width)}")
        if not (is_int(self.max_tokens) and self.max_tokens >= 1):
            raise ParamError("max_tokens", f"must be an integer >= 1, got {_shown(self.max_tokens)}")
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
            raise ParamError("length_penalty", f"must be a finite number, got {lp!r}")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not (isinstance(self.stop_token_ids, list) and all(is_int(t) and t >= 0 for t in self.stop_token_ids)):
            raise ParamError("stop_token_ids", "must be a list of non-negative integers")
        # temperature: checked by the SamplingParams of each step
        SamplingParams(temperature=self.temperature, max_tokens=1)


# What a model's generation_config.json may set for a request that leaves it out (vLLM's
# --generation-config auto reads the same ones; do_sample is ignored, as vLLM ignores it).
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(generation_config: dict[str, Any]) -> dict[str, Any]:
    """The sampling defaults a model's generation_config.json recommends: those of
    SAMPLING_DEFAULT_KEYS it sets to a value SamplingParams takes (others are left out)."""
    out: dict[str, Any] = {}
    for key in SAMPLING_DEFAULT_KEYS:
        value = generation_config.get(key)
        if value is None:
            continue
        try:
            SamplingParams(**{key: value})
        except (ParamError, TypeError):
            continue
        out[key] = -1 if key == "top_k" and value == 0 else value  # HF's 0 (off) is vLLM's -1
    return out
