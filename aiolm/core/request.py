"""One request's state inside the engine core.

The scheduler, the KV cache manager and the stop checks all read the same
``Request``: token lists grow by appending (never copied), block hashes are
extended incrementally as blocks fill, and ``num_computed_tokens`` is the one
counter the token catch-up scheduler chases ``num_tokens`` with.
Pure Python: no torch or numpy.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence

from aiolm.core.step import LogprobsLists
from aiolm.lora.request import LoRARequest
from aiolm.multimodal.inputs import ImageInput
from aiolm.params import SamplingParams
from aiolm.pooling.params import PoolingParams
from aiolm.spec_decode.stats import AcceptanceWindow


class RequestStatus(enum.IntEnum):
    """Lifecycle: [WAITING_FOR_GRAMMAR ->] WAITING [-> WAITING_FOR_REMOTE_KVS -> WAITING]
    -> RUNNING (-> PREEMPTED [-> WAITING_FOR_REMOTE_KVS -> PREEMPTED] -> RUNNING)* -> one FINISHED_*.

    WAITING_FOR_GRAMMAR: a structured-output request whose grammar the workers are still
    compiling; it holds no blocks and is not scheduled until they report it ready.
    WAITING_FOR_REMOTE_KVS: a KV connector is loading part of its prompt into blocks it
    holds (aiolm/kv_transfer/); it is not scheduled until the workers report the load.
    """

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    WAITING_FOR_GRAMMAR = 3
    WAITING_FOR_REMOTE_KVS = 4
    # Everything from here on is final; ``is_finished`` relies on the ordering.
    FINISHED_STOPPED = 5
    FINISHED_LENGTH = 6
    FINISHED_ABORTED = 7
    FINISHED_ERROR = 8

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI-style reason string, or None while the request is alive."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}

# Called with the request whenever tokens were appended; appends the hashes of
# any blocks that became full (see kv_cache.BlockHasher).
BlockHasherFn = Callable[["Request"], None]


class Request:
    """A single sequence being served (``n > 1`` is expanded before it gets here).

    Build it after ``sampling_params`` is final (``eos_token_ids`` filled in): the
    stop-token set is computed once here, not per token.
    """

    __slots__ = (
        "req_id",
        "prompt_token_ids",
        "output_token_ids",
        "all_token_ids",
        "num_tokens",
        "sampling_params",
        "arrival_time",
        "priority",
        "cache_salt",
        "status",
        "num_computed_tokens",
        "num_output_placeholders",
        "num_cached_tokens",
        "stop_reason",
        "error",
        "scheduled_time",
        "max_tokens",
        "min_tokens",
        "stop_token_ids",
        "block_hashes",
        "prompt_logprobs",
        "_block_hasher",
        "_next_hash_at",
        "_hash_block_size",
        "spec_window",
        "pooling_params",
        "lora_request",
        "kv_transfer_out",
        "mm_inputs",
    )

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
        mm_inputs: Sequence[ImageInput] = (),
    ) -> None:
        self.req_id = req_id
        # A vision-language prompt's images, in prompt order; their hashes are in its block hashes.
        self.mm_inputs: list[ImageInput] = list(mm_inputs)
        # The LoRA adapter it runs with; part of its block hashes, so no KV is shared across adapters.
        self.lora_request = lora_request
        # Set when it finishes on a prefill instance: where a decode instance finds its KV.
        self.kv_transfer_out: dict | None = None
        # A pooling request finishes when its prompt is computed, with the pooled vector.
        self.pooling_params = pooling_params
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        # Prompt followed by outputs, kept as its own list so reads never concatenate.
        # Plain attributes (not properties) because the scheduler reads them per step:
        # read them, never mutate them; append_output_token_ids keeps both in sync.
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_tokens = len(self.all_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority  # lower value is served first (as in vLLM)
        self.cache_salt = cache_salt
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Overlap scheduling: tokens sampled by steps still in flight, which the workers
        # already hold but this request has not appended yet (always 0 without overlap).
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first schedule; -1 = not yet
        self.scheduled_time: float | None = None  # time.monotonic() when first scheduled (queue-time metric)
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        # None means "until max_model_len"; resolve_max_tokens() turns it into a number.
        self.max_tokens: int | None = sampling_params.max_tokens
        self.min_tokens = sampling_params.min_tokens
        # Computed once: stop_ids() builds a fresh set and this is read for every token.
        self.stop_token_ids: frozenset[int] = frozenset(sampling_params.stop_ids())
        # Prompt logprobs gathered chunk by chunk (prompt tokens 1..), sent with the first token.
        self.prompt_logprobs: LogprobsLists | None = (
            LogprobsLists([], [], []) if sampling_params.prompt_logprobs is not None else None
        )
        self.block_hashes: list[bytes] = []  # one per full block, chained
        # Speculative decoding: the request's acceptance window, or None when it does not
        # draft (speculation off, or a request the verifier cannot handle exactly).
        self.spec_window: AcceptanceWindow | None = None
        self._block_hasher: BlockHasherFn | None = None
        self._hash_block_size = 0
        self._next_hash_at = 0  # token count at which the next block becomes full

    # -- sizes -------------------------------------------------------------

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    # -- mutation ------------------------------------------------------------

    def resolve_max_tokens(self, max_model_len: int) -> None:
        """``max_tokens=None`` means generate until the context is full."""
        if self.max_tokens is None:
            self.max_tokens = max(1, max_model_len - self.num_prompt_tokens)

    def set_block_hasher(self, hasher: BlockHasherFn, block_size: int) -> None:
        """Attach the prefix-cache hasher and hash the blocks that are already full."""
        self._block_hasher = hasher
        self._hash_block_size = block_size
        self._next_hash_at = (len(self.block_hashes) + 1) * block_size
        if self.num_tokens >= self._next_hash_at:
            self._rehash()

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """Append sampled tokens; hash a block only at the moment it fills."""
        if isinstance(token_ids, int):
            self.output_token_ids.append(token_ids)
            self.all_token_ids.append(token_ids)
        else:
            self.output_token_ids.extend(token_ids)
            self.all_token_ids.extend(token_ids)
        self.num_tokens = n = len(self.all_token_ids)
        if self._block_hasher is not None and n >= self._next_hash_at:
            self._rehash()

    def _rehash(self) -> None:
        assert self._block_hasher is not None
        self._block_hasher(self)
        self._next_hash_at = (len(self.block_hashes) + 1) * self._hash_block_size

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
