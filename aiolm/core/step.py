"""Messages that cross the scheduler/worker boundary.

Each is a ``msgspec.Struct`` of ints, floats, strings and lists (plus SamplingParams):
the type is the wire shape, so aiolm/ipc/codec.py encodes them without a schema of
its own. They carry only logical decisions: token ids and block ids, never tensors.
A step's SchedulerOutput is a *diff*: requests the workers have not seen come in
full, requests they already hold come as deltas.

``array_like``: encoded as arrays of field values, in the order declared here, not as
maps of names, so the two ends must run the same aiolm (workers are our children).
``gc=False``: the garbage collector does not track them; a message never refers back
to itself, so there is no cycle to collect, and a step of many requests adds no work
to the collector's passes. ``tag``: the two top-level messages name themselves, so one
decoder tells them apart.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import field

from aiolm.lora.request import LoRARequest
from aiolm.multimodal.inputs import ImageInput
from aiolm.params import SamplingParams
from aiolm.pooling.params import PoolingParams
from aiolm.structured.spec import StructuredOutputs


class NewRequestData(msgspec.Struct, array_like=True, gc=False):
    """A request the workers have not seen (or must rebuild after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    # Tokens generated so far (non-empty only for a request resumed after preemption).
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # tokens whose KV already sits in block_ids (prefix-cache hit)
    # A pooling request (--runner pooling): pooled once its prompt is computed, never sampled.
    pooling_params: PoolingParams | None = None
    # The LoRA adapter it runs with (--enable-lora); each rank loads it on first use.
    lora_request: LoRARequest | None = None
    # A vision-language prompt's images, in prompt order (aiolm/multimodal/inputs.py).
    mm_inputs: list[ImageInput] | None = None


class CachedRequestData(msgspec.Struct, array_like=True, gc=False):
    """Deltas for requests the workers already hold, one entry per list index."""

    req_ids: list[str] = field(default_factory=list)
    # Tokens appended to the request since the workers last saw it (the sampled ones).
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.req_ids)


class KVTransferOps(msgspec.Struct, array_like=True, gc=False):
    """What the KV connector's worker side does at the start of a step, before anything
    of the step writes the KV cache (aiolm/kv_transfer/).

    Saves come first: they are blocks the prefix cache evicted while this step was
    scheduled, still holding the cached prefix their hash names, which this step's
    tokens or loads may overwrite. Loads are read in the background and copied into
    their blocks at the start of the first later step by which every rank has read its
    share (aiolm/kv_transfer/loads.py); rank 0 reports each in ModelRunnerOutput.kv_loaded
    once copied, and only then is its request scheduled.
    """

    save_block_ids: list[int] = field(default_factory=list)
    save_hashes: list[bytes] = field(default_factory=list)
    # Per load: its id (unique in the engine's life), its request, the block hashes to
    # read, in prompt order, and the blocks they go to.
    load_ids: list[int] = field(default_factory=list)
    load_req_ids: list[str] = field(default_factory=list)
    load_hashes: list[list[bytes]] = field(default_factory=list)
    load_block_ids: list[list[int]] = field(default_factory=list)
    # Blocks the tiers no longer keep (their caps, least recently used first).
    drop_host: list[bytes] = field(default_factory=list)
    drop_disk: list[bytes] = field(default_factory=list)
    # Loads from another instance (TcpConnector), one entry per load above: the producer's
    # host:port (its rank 0's; rank r adds r), its transfer id and its block ids.
    load_sources: list[str] = field(default_factory=list)
    load_transfer_ids: list[str] = field(default_factory=list)
    load_remote_block_ids: list[list[int]] = field(default_factory=list)
    # A producer's finished prompts to serve (transfer id, block ids), and transfers to stop
    # serving (sent, or their lease ended).
    serve_ids: list[str] = field(default_factory=list)
    serve_block_ids: list[list[int]] = field(default_factory=list)
    unserve_ids: list[str] = field(default_factory=list)
    # A consumer's transfers it will not fetch (a local prefix hit held the whole prompt, or
    # the request left first): each rank asks its producer peer for none of the blocks,
    # which ends the producer's lease at once instead of after lease_seconds.
    release_sources: list[str] = field(default_factory=list)
    release_transfer_ids: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(
            self.save_block_ids
            or self.load_req_ids
            or self.drop_host
            or self.drop_disk
            or self.serve_ids
            or self.unserve_ids
            or self.release_transfer_ids
        )


class SchedulerOutput(msgspec.Struct, array_like=True, gc=False, tag=True):
    """One step's decisions: who runs, how many tokens each, which blocks."""

    step: int
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests that ended (finished, aborted or preempted) since the previous step;
    # workers drop them from their persistent batch before applying this step.
    finished_req_ids: set[str]
    # Speculative decoding: req_id -> draft tokens to verify this step (only requests that
    # have some). Their num_scheduled_tokens include the drafts, and the worker puts the
    # drafts after the request's known tokens without counting them as its tokens.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Grammars of requests that wait for them (req_id -> grammar), sent once: the workers
    # compile them in the background and name each one in ModelRunnerOutput.grammars_ready
    # (or grammar_errors) when done. Only then is the request scheduled.
    grammars: dict[str, StructuredOutputs] = field(default_factory=dict)
    # The KV connector's work for this step (--kv-transfer-config), or None.
    kv_ops: KVTransferOps | None = None
    # Images to encode before this step's forward pass (req_id -> indices into its
    # mm_inputs), and encoder-cache entries to drop first (core/encoder_cache.py).
    encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    free_encoder_hashes: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


class LogprobsLists(msgspec.Struct, array_like=True, gc=False):
    """Per sampled token: ids and logprobs, sampled token first, then the top-N."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]  # rank of the sampled token in the distribution (1 = argmax)
    # Every entry's rank, when some row asked for named tokens (logprob_token_ids), whose
    # ranks are not their places in the list; None otherwise: the top-N rank 1..N.
    entry_ranks: list[list[int]] | None = None

    def slice(self, start: int, stop: int) -> LogprobsLists:
        """Tokens ``start .. stop - 1`` (a step's tokens cut at a stop, or one request's rows)."""
        er = None if self.entry_ranks is None else self.entry_ranks[start:stop]
        return LogprobsLists(self.token_ids[start:stop], self.logprobs[start:stop], self.ranks[start:stop], er)


class PromptLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Logprobs of prompt tokens ``start``, ``start + 1``, ... (each scored by the position
    before it), computed in one prefill chunk; ``lists`` holds the actual token first."""

    start: int
    lists: LogprobsLists


class ModelRunnerOutput(msgspec.Struct, array_like=True, gc=False, tag=True):
    """What rank 0 sends back: a token for each request whose prefill is complete."""

    req_ids: list[str]
    # One list per request in req_ids; empty while a chunked prefill is still partial.
    # A request that verified drafts gets its accepted drafts plus one more token (1..k+1).
    sampled_token_ids: list[list[int]]
    # Only for requests that asked for logprobs: req_id -> logprobs of its new tokens.
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # Only for requests that asked for prompt logprobs and ran prompt tokens this step.
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    # Rank 0's seconds in [input preparation, forward pass, logits + sampling], for cost accounting.
    worker_times: list[float] = field(default_factory=list)
    # Rank 0's time.perf_counter() (CLOCK_MONOTONIC, shared by processes) when the step's message
    # was read and when this reply was written: splits the round trip into its two legs.
    worker_clock: list[float] = field(default_factory=list)
    # Requests whose grammar (SchedulerOutput.grammars) finished compiling since the last reply,
    # and those whose grammar failed to compile, with the compiler's message.
    grammars_ready: list[str] = field(default_factory=list)
    grammar_errors: dict[str, str] = field(default_factory=dict)
    # Pooling requests whose prompt was completed this step: req_id -> the pooled vector
    # (an embedding, or a classifier's logits); they sample nothing.
    pooled: dict[str, list[float]] = field(default_factory=dict)
    # Requests the workers could not run, with why (their LoRA adapter could not be read):
    # the scheduler finishes them with the message; their tokens this step are dropped.
    request_errors: dict[str, str] = field(default_factory=dict)
    # KV connector loads copied into their blocks since the last reply: load id -> how many
    # of its blocks, from the first, arrived intact (fewer than asked: the rest is missing
    # or corrupt, and the request computes it).
    kv_loaded: dict[int, int] = field(default_factory=dict)
    # Transfers every rank has sent to their consumer since the last reply (TcpConnector).
    kv_sent: list[str] = field(default_factory=list)


class EngineCoreOutput(msgspec.Struct, gc=False):
    """Per-request result of one step, handed from the core to output processing."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None  # the stop token id or string that ended it
    new_logprobs: LogprobsLists | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    # The whole prompt's logprobs (tokens 1..n-1), once, with the request's first token.
    prompt_logprobs: LogprobsLists | None = None
    pooled: list[float] | None = None  # a pooling request's result, with its finish
    # A prefill instance's answer for the decode instance (aiolm/kv_transfer/params.py), with its finish.
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
