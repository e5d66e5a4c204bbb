"""Token catch-up scheduler (vLLM v1 style), pure Python.

There is no prefill/decode split: every request has ``num_computed_tokens`` and
each step the scheduler hands out a token budget so requests catch up with
their ``num_tokens``. Chunked prefill, prefix caching and decode all fall out of
that one rule. Each step:

1. Running requests, in order, get ``min(remaining, budget, threshold)``
   tokens. When their blocks do not fit, the lowest-priority (priority policy)
   or latest (fcfs) running request is preempted by recompute: its blocks are
   freed, ``num_computed_tokens`` goes back to 0 and it waits at the front of
   the queue. If the request itself is the victim, the loop stops.
2. Only if nothing was preempted, waiting requests are admitted while there
   are free seats (``max_num_seqs``) and budget, after a prefix-cache lookup.
3. ``num_computed_tokens`` is advanced by what was scheduled, so
   ``update_from_output`` only appends sampled tokens and checks stops. Full
   blocks the step computes are published to the prefix cache as it is built:
   the workers run steps in the order sent, so a later step that hits them
   reads them after they are written.

Overlap (``async_scheduling``): the engine schedules step N+1 while step N runs.
A token step N samples is a *placeholder* until its result arrives
(``Request.num_output_placeholders``): step N+1 already computes it, and the
workers fill its input from the token they sampled themselves, so step N+1's
diff carries no sampled tokens. A request whose placeholders already reach
``max_tokens`` or the context is not scheduled again; one that stops on a token
(EOS, a stop token) at step N was also run in N+1, whose extra token is dropped.
A request preempted while a step that samples for it is in flight keeps that
token when it arrives, as it would have without overlap. Aborted, finished and
preempted requests free their blocks at once: any step that still writes them
was sent before any step that can reuse them, and the workers run steps in order.

Pipeline parallelism (``pipeline_depth`` P > 1): the engine keeps P steps in flight, one
per stage, and the placeholders mark which requests have a token in one of them. Such a
request is not scheduled again until that token is back (the first stage needs it as input,
and only the last stage samples it); the engine sends it in the next step's diff. Each step
takes at most 1/P of the running requests, so a decode batch is shared out among the steps
in flight and every stage has work. Prompt chunks need no token back: a request's next chunk
may follow its previous one into the pipeline (every stage runs steps in order).

Speculative decoding (``SchedulerConfig.speculative``): a running request in
decode gets n-gram drafts (``aiolm/spec_decode/``) and is scheduled for
``1 + len(drafts)`` tokens, its KV slots reserved for all of them (lookahead;
dropped again before anyone is preempted for them). ``update_from_output``
takes back the rejected drafts from ``num_computed_tokens``, so it counts only
tokens whose KV holds accepted tokens; the rejected drafts' slots stay with the
request (the next step's drafts write over them) until it finishes or is
preempted.

Grammar wait state (structured outputs): the worker builds a request's token
mask, so it must hold the compiled grammar before the request's first sampling
step. A request with a grammar is added as WAITING_FOR_GRAMMAR, outside the
waiting queue and holding no blocks; its grammar goes to the workers once in
``SchedulerOutput.grammars`` and compiles there in the background while other
requests step. When a ModelRunnerOutput names it in ``grammars_ready`` it joins
the waiting queue like any new request; ``grammar_errors`` finishes it with the
compiler's message. A step with nothing else to run still goes to the workers
(empty), so their answer arrives.

KV connector (``--kv-transfer-config``, aiolm/kv_transfer/): at admission, past the
pool's cached prefix, the connector may hold more of the prompt (blocks the pool evicted,
kept in its tiers). The request then gets blocks for that part and waits for it as
WAITING_FOR_REMOTE_KVS, outside the waiting queue and the batch; the load goes to the
workers in ``SchedulerOutput.kv_ops`` and comes back in ``ModelRunnerOutput.kv_loaded``
with how many blocks arrived intact, which count as computed (the rest is computed). The
request returns to the front of the queue holding its blocks; if a running or earlier
request needs blocks before it is admitted, it gives them back first (what it loaded stays
cached). An aborted request's blocks stay leased until its load is reported, since the
workers may still write them.

The SchedulerOutput is a diff against what the workers already hold (see
aiolm/core/step.py). The engine must call ``update_from_output`` after every
``schedule()``, with an empty ModelRunnerOutput (or None) when nothing ran:
requests the scheduler finishes by itself (too large for the KV cache) are
reported there.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

from aiolm.core.encoder_cache import EncoderCacheLedger
from aiolm.core.kv_cache import KVCacheBlock, KVCacheManager, PrefixCacheStats
from aiolm.core.request import Request, RequestStatus
from aiolm.core.step import (
    CachedRequestData,
    EngineCoreOutput,
    LogprobsLists,
    ModelRunnerOutput,
    NewRequestData,
    PromptLogprobs,
    SchedulerOutput,
)
from aiolm.core.step_cost import StepCost
from aiolm.kv_transfer.base import ConnectorScheduler
from aiolm.multimodal.inputs import ImageInput
from aiolm.params import ParamError
from aiolm.spec_decode import AcceptanceWindow, NgramProposer, SpecConfig, SpecDecodeStats, supports_speculation
from aiolm.structured.spec import StructuredOutputs

_RUNNING = RequestStatus.RUNNING
PREFILL_FLOOR_BLOCKS = 4  # under --max-step-ms, prompts still get this many blocks' worth a step
_WARMUP_STEPS = 2  # a process's first steps, not measured for --max-step-ms


@dataclass(kw_only=True)
class SchedulerConfig:
    """Limits of one scheduler; ``num_blocks`` counts the reserved null block."""

    num_blocks: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    long_prefill_token_threshold: int = 0  # 0 = off
    policy: Literal["fcfs", "priority"] = "fcfs"
    block_size: int = 16
    enable_prefix_caching: bool = True
    hash_seed: int | str | bytes | None = None
    speculative: SpecConfig | None = None  # None: no drafts
    async_scheduling: bool = False  # overlap: the engine schedules a step while the previous one runs
    # Pipeline parallelism: steps in flight at once (one per stage). A request runs in at most
    # one of them until its token comes back, and each step takes at most 1/depth of the
    # running requests, so the stages get equal shares of a decode batch.
    pipeline_depth: int = 1
    # False for encoder-only models: attention is bidirectional, so a prompt runs whole in one
    # step (a prompt over max_num_batched_tokens can never run, and is refused at admission).
    chunked_prefill: bool = True
    # --max-loras: most distinct LoRA adapters among the running requests (the model's slots);
    # a request whose adapter would be one more waits, and others go past it. 0: no LoRA.
    max_loras: int = 0
    # --max-step-ms: prompt tokens per step are capped so that a step's measured cost
    # (core/step_cost.py) stays within this many milliseconds, every running request still
    # getting its token and waiting prompts at least PREFILL_FLOOR_BLOCKS blocks' worth.
    # 0: no cap (max_num_batched_tokens alone). Not for unchunked (encoder) prompts.
    max_step_ms: float = 0.0
    # --max-num-encoder-input-tokens: image embeddings the workers may encode in one step
    # (0: max_num_batched_tokens), and how many embeddings their encoder cache holds (0: the
    # larger of that and max_num_batched_tokens). A vision-language model only.
    max_num_encoder_input_tokens: int = 0
    encoder_cache_size: int = 0
    # An image's placeholders run in one step, never split across chunks (Gemma 3: they
    # attend to each other both ways, so each needs the whole image in its step).
    whole_images: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if not self.max_step_ms >= 0:
            raise ValueError(f"max_step_ms must be >= 0, got {self.max_step_ms}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")


@dataclass
class _Load:
    """A KV connector load in progress: the request's blocks ``start .. start + asked - 1``."""

    request: Request
    start: int
    asked: int
    resumed: bool  # the request had run before (preempted): it goes back as PREEMPTED


# -- waiting queues -------------------------------------------------------------


class FCFSQueue:
    """Arrival order; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, req: Request) -> None:
        """At the back, but ahead of the requests that arrived after it: n > 1 siblings join
        once the first sequence has prefilled, and went behind every later request (their
        seats taken, as vLLM, which adds them at arrival, would not let happen)."""
        q = self._q
        at = len(q)
        while at and q[at - 1].arrival_time > req.arrival_time:
            at -= 1
        q.insert(at, req)

    def prepend(self, req: Request) -> None:
        self._q.appendleft(req)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, req: Request) -> None:
        self._q.remove(req)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    """Lowest (priority, arrival_time) first; a preempted request keeps its place."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def add(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.priority, req.arrival_time, next(self._seq), req))

    prepend = add

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, req: Request) -> None:
        self._heap = [e for e in self._heap if e[3] is not req]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap))


# -- the scheduler ----------------------------------------------------------------


class Scheduler:
    """Decides who runs each step and keeps request and block state consistent."""

    def __init__(self, config: SchedulerConfig, connector: ConnectorScheduler | None = None) -> None:
        self.config = config
        self.kv_cache_manager = KVCacheManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching, config.hash_seed
        )
        # KV connector (--kv-transfer-config): evicted prefixes kept elsewhere, loaded back.
        self.connector = connector
        if connector is not None:
            self.kv_cache_manager.pool.on_evict = connector.on_evict
        self.loading: dict[int, _Load] = {}  # load id -> load; its request is WAITING_FOR_REMOTE_KVS
        self._load_of: dict[str, int] = {}  # req_id -> its load id, while it waits for it
        self._load_ids = itertools.count(1)
        self.loaded_waiting: set[Request] = set()  # back from a load, in the queue, holding blocks
        self.requests: dict[str, Request] = {}
        self.waiting: FCFSQueue | PriorityQueue = PriorityQueue() if config.policy == "priority" else FCFSQueue()
        self.running: list[Request] = []
        # WAITING_FOR_GRAMMAR requests, and the grammars not yet sent to the workers.
        self.awaiting_grammar: dict[str, Request] = {}
        self._grammars_to_send: dict[str, StructuredOutputs] = {}
        self.step = 0
        self.num_preemptions = 0  # over the scheduler's life, for metrics
        # What the workers hold: req_id -> number of the request's tokens they have.
        self._worker_num_tokens: dict[str, int] = {}
        self._finished_req_ids: set[str] = set()  # to tell the workers next step
        self._pending_outputs: list[EngineCoreOutput] = []  # finished inside schedule()
        speculative = config.speculative
        self.proposer = (
            NgramProposer(
                speculative.num_speculative_tokens,
                speculative.prompt_lookup_min,
                speculative.prompt_lookup_max,
                speculative.search_window,
            )
            if speculative
            else None
        )
        self.spec_decode_stats: SpecDecodeStats | None = SpecDecodeStats() if speculative else None
        # The Request objects of each step not yet updated (step -> req_id -> request): a
        # result belongs to the request that was scheduled, never to a later one reusing its id.
        self._step_reqs: dict[int, dict[str, Request]] = {}
        self.step_cost = StepCost() if config.max_step_ms > 0 and config.chunked_prefill else None
        self.encoder_budget = config.max_num_encoder_input_tokens or config.max_num_batched_tokens
        self.encoder_cache = EncoderCacheLedger(
            config.encoder_cache_size or max(self.encoder_budget, config.max_num_batched_tokens)
        )
        self._encode: dict[str, list[int]] = {}  # this step's images to encode: req_id -> indices
        self._unmeasured_steps = _WARMUP_STEPS  # one-time costs (kernel builds, first touches) are no rate

    # -- intake ------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request. A prompt must leave room for one output token:
        ``1 <= len(prompt) <= max_model_len - 1``, else ParamError("prompt"); a pooling
        prompt outputs no token, so it may fill the context."""
        n = request.num_prompt_tokens
        limit = self.config.max_model_len - (request.pooling_params is None)
        if n == 0:
            raise ParamError("prompt", "the prompt is empty")
        if n > limit:
            raise ParamError(
                "prompt",
                f"the prompt has {n} tokens but at most {limit} fit "
                f"(max_model_len {self.config.max_model_len} minus one output token)",
            )
        if request.req_id in self.requests:
            raise ValueError(f"request id {request.req_id!r} is already in use")
        self.check_images(request.mm_inputs)
        request.resolve_max_tokens(self.config.max_model_len)
        speculative = self.config.speculative
        if speculative is not None and supports_speculation(request.sampling_params):
            request.spec_window = AcceptanceWindow(
                speculative.window, speculative.min_acceptance, speculative.backoff, speculative.num_speculative_tokens
            )
        self.kv_cache_manager.attach(request)
        self.requests[request.req_id] = request
        self._queue(request)

    def check_images(self, images: list[ImageInput]) -> None:
        """ParamError unless every image can ever be scheduled: its embeddings fit the
        encoder budget and cache, and (whole images) its placeholders fit one step."""
        cfg = self.config
        step = min(cfg.max_num_batched_tokens, cfg.long_prefill_token_threshold or cfg.max_num_batched_tokens)
        for image in images:
            if cfg.whole_images and image.length > step:
                raise ParamError(
                    "messages",
                    f"an image takes {image.length} tokens in one step, more than a step's {step} "
                    "(--max-num-batched-tokens, --long-prefill-token-threshold)",
                )
            if image.length > min(self.encoder_budget, self.encoder_cache.capacity):
                raise ParamError(
                    "messages",
                    f"an image takes {image.length} tokens, more than the encoder budget of "
                    f"{min(self.encoder_budget, self.encoder_cache.capacity)} "
                    "(--max-num-encoder-input-tokens)",
                )

    def _queue(self, request: Request) -> None:
        """Into the waiting queue, or first to the grammar wait when it has a grammar."""
        grammar = request.sampling_params.structured_outputs
        if grammar is None:
            request.status = RequestStatus.WAITING
            self.waiting.add(request)
        else:
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.awaiting_grammar[request.req_id] = request
            self._grammars_to_send[request.req_id] = grammar

    def abort_requests(self, req_ids: Iterable[str], error: str | None = None) -> list[EngineCoreOutput]:
        """Finish the given live requests now, freeing their blocks in this call; with
        ``error``, as failed (finish reason "error", the message saying why)."""
        outputs = []
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status == RequestStatus.WAITING_FOR_GRAMMAR:
                # A compile already sent finishes on the worker and is reported, then ignored.
                del self.awaiting_grammar[req_id]
                self._grammars_to_send.pop(req_id, None)
            elif req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                # Workers may still write its blocks: they stay leased until the load is reported.
                self.kv_cache_manager.lease(req, f"load-{self._load_of.pop(req_id)}")
            else:
                self.waiting.remove(req)
            if error is not None:
                req.error = f"request {req_id!r}: {error}"
            self._finish(req, RequestStatus.FINISHED_ABORTED if error is None else RequestStatus.FINISHED_ERROR)
            outputs.append(self._output(req, []))
        return outputs

    def reset_workers(self, num_blocks: int) -> None:
        """The workers were replaced and no KV survived: start a new block pool of
        ``num_blocks`` and queue every live request to be recomputed from its prompt
        plus the tokens it already generated (preemption by recompute, for all).
        Running requests go first, in batch order, ahead of those already waiting.
        The new workers hold no compiled grammar: requests with one wait for it again."""
        cfg = self.config
        cfg.num_blocks = num_blocks
        self._unmeasured_steps = _WARMUP_STEPS  # new processes: their first steps pay one-time costs again
        stats = self.kv_cache_manager.stats  # counted over the engine's life, not the pool's
        self.kv_cache_manager = KVCacheManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching, cfg.hash_seed)
        self.kv_cache_manager.stats = stats
        if self.connector is not None:
            self.connector.reset()
            self.kv_cache_manager.pool.on_evict = self.connector.on_evict
        loading = [load.request for load in self.loading.values() if not load.request.is_finished]
        self.loading.clear()
        self._load_of.clear()
        self.loaded_waiting.clear()
        self.encoder_cache.clear()  # the new workers hold no embeddings
        queued = [*self.running, *loading, *self.waiting, *self.awaiting_grammar.values()]
        self.running = []
        self.waiting = PriorityQueue() if cfg.policy == "priority" else FCFSQueue()
        self.awaiting_grammar = {}
        self._grammars_to_send = {}
        for req in queued:
            req.num_computed_tokens = 0
            req.num_output_placeholders = 0  # the steps that would have sampled them are lost
            req.block_hashes = []  # the new pool's hasher may have another root (a random one)
            self.kv_cache_manager.attach(req)
            started = req.status in (RequestStatus.RUNNING, RequestStatus.PREEMPTED) or req.num_output_tokens > 0
            self._queue(req)
            if started and req.status == RequestStatus.WAITING:
                req.status = RequestStatus.PREEMPTED
        self._worker_num_tokens.clear()
        self._finished_req_ids.clear()
        self._step_reqs.clear()

    # -- counts and stats ------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        """True while requests live, finished ones still await reporting, or a KV transfer is
        out (an aborted request's blocks are freed when its load is reported; a finished
        prompt's when another instance has read them)."""
        return (
            bool(self.requests)
            or bool(self._pending_outputs)
            or bool(self.loading)
            or (self.connector is not None and self.connector.pending)
        )

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.awaiting_grammar) + len(self._load_of)

    def lora_adapters(self) -> tuple[list[str], list[str]]:
        """The names of the LoRA adapters of the running and of the waiting requests, each
        once, sorted (``/metrics``' ``lora_requests_info``, as vLLM labels it)."""
        loading = [self.requests[rid] for rid in self._load_of if rid in self.requests]
        waiting = [*self.waiting, *self.awaiting_grammar.values(), *loading]
        return _adapter_names(self.running), _adapter_names(waiting)

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_cache_manager.usage

    @property
    def num_free_blocks(self) -> int:
        return self.kv_cache_manager.num_free_blocks

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.kv_cache_manager.stats

    def reset_prefix_cache(self) -> int:
        return self.kv_cache_manager.reset_prefix_cache()

    def get_request(self, req_id: str) -> Request | None:
        return self.requests.get(req_id)

    # -- scheduling ----------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts; see the module docstring."""
        cfg = self.config
        kv = self.kv_cache_manager
        if self.connector is not None and self.connector.pending:
            for transfer_id in self.connector.expired(time.monotonic()):
                kv.release(f"send-{transfer_id}")
        # a prompt that may not be chunked (an encoder's: it keeps no KV to attend to later)
        # runs whole, however long
        threshold = cfg.long_prefill_token_threshold if cfg.chunked_prefill else 0
        budget = cfg.max_num_batched_tokens
        prefill_left = self._prefill_cap()  # None: no cap beyond the budget
        encoder_left = self.encoder_budget
        num_scheduled: dict[str, int] = {}
        new_blocks_of: dict[str, list[KVCacheBlock]] = {}
        scheduled_running: list[Request] = []
        draft_tokens: dict[str, list[int]] = {}
        proposer = self.proposer
        preempted = False

        # 1. running requests catch up first.
        allocate = kv.allocate_slots
        req_blocks = kv.req_to_blocks
        bs = kv.block_size
        running = self.running
        max_model_len = cfg.max_model_len
        i = 0
        pipeline = cfg.pipeline_depth > 1
        rows_left = -(-len(running) // cfg.pipeline_depth) if pipeline else len(running)
        while i < len(running) and budget > 0 and rows_left > 0:
            req = running[i]
            ph = req.num_output_placeholders
            if ph and (
                pipeline  # its token is still in the pipeline: the engine sends it once known
                or len(req.output_token_ids) + ph >= req.max_tokens  # type: ignore[operator]
                or req.num_tokens + ph >= max_model_len
            ):
                i += 1  # its last token is already being sampled
                continue
            n = req.num_tokens + ph - req.num_computed_tokens
            drafts = None
            if n == 1 and proposer is not None and req.spec_window is not None and req.spec_window.allow():
                drafts = self._propose(req, budget)
                n += len(drafts)
            if threshold and n > threshold:
                n = threshold
            if n > budget:
                n = budget
            prefill = n > 1 and drafts is None
            if prefill and prefill_left is not None and n > prefill_left:
                n = prefill_left
            images: tuple[list[int], list[str]] | None = None
            if req.mm_inputs and n > 0:
                n, images = self._fit_images(req, req.num_computed_tokens, n, encoder_left, budget)
            if n <= 0:
                i += 1
                continue
            # Decode fast path (the common case): the last block still has room.
            # Same rule as allocate_slots' first check, inlined to save a call per request.
            blocks = req_blocks.get(req.req_id)
            new_blocks: list[KVCacheBlock] | None
            if blocks is not None and req.num_computed_tokens + n <= len(blocks) * bs:
                new_blocks = []
            else:
                new_blocks = None
            while new_blocks is None:
                new_blocks = allocate(req, n)
                if new_blocks is not None:
                    break
                if drafts:  # lookahead slots are optional: go without them before preempting anyone
                    n -= len(drafts)
                    drafts = None
                    continue
                if self._drop_loaded_blocks():
                    continue  # loaded prompts waiting for a seat give their blocks back first
                victim = self._pick_victim()
                if victim is req and len(self.running) == 1:
                    if req.num_output_placeholders:
                        break  # overlap: the token in flight may end it; decide once it is known
                    if not kv.held_elsewhere(req.req_id):
                        # Alone, nothing else holds a block, and still short of blocks: it can never run.
                        self.running.pop()
                        self._finish_error(req)
                        break
                    # blocks a lease or a load holds come back: it steps aside (below) and waits
                vi = self.running.index(victim)
                del self.running[vi]
                if vi < i:
                    i -= 1  # the priority policy may pick one scheduled earlier this step
                if victim.req_id in num_scheduled:
                    budget += num_scheduled.pop(victim.req_id)
                    rows_left += 1
                    new_blocks_of.pop(victim.req_id)
                    draft_tokens.pop(victim.req_id, None)
                    scheduled_running.remove(victim)
                    encoder_left += self._undo_encodes(victim)
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if new_blocks is None:
                if i < len(running) and running[i] is req:
                    i += 1  # still running, waiting for its token in flight
                continue  # else req left self.running; index i now points at the next one
            if images is not None and preempted:
                # a victim's images left the ledger: what this request reads may have gone with them
                n, images = self._fit_images(req, req.num_computed_tokens, n, encoder_left, n)
                if n <= 0:
                    i += 1  # it keeps the blocks it was given, for its next step
                    continue
            scheduled_running.append(req)
            num_scheduled[req.req_id] = n
            new_blocks_of[req.req_id] = new_blocks
            if images is not None:
                encoder_left -= self._encode_images(req, *images)
            if drafts:
                draft_tokens[req.req_id] = drafts
            budget -= n
            rows_left -= 1
            if prefill and prefill_left is not None:
                prefill_left -= n
            i += 1

        # 2. admit waiting requests, unless this step had to preempt.
        scheduled_new: list[Request] = []
        adapters = self._running_adapters() if cfg.max_loras else None
        skipped: list[Request] = []  # waiting for an adapter slot: back in front afterwards
        while (
            not preempted
            and budget > 0
            and (prefill_left is None or prefill_left > 0)
            and len(self.waiting)
            and len(self.running) < cfg.max_num_seqs
        ):
            req = self.waiting.peek()
            if req.num_output_placeholders:
                break  # preempted while its token is in flight: resumes once that arrives
            lora = req.lora_request
            if adapters is not None and lora is not None and lora.lora_int_id not in adapters:
                if len(adapters) >= cfg.max_loras:
                    skipped.append(self.waiting.pop())
                    continue
            if kv.num_blocks_needed(req.num_tokens) > kv.num_usable_blocks:
                self.waiting.pop()
                self._finish_error(req)
                continue
            hits: list[KVCacheBlock] = []
            num_hit = 0
            asks_connector = False
            if req.num_computed_tokens == 0 and req.prompt_logprobs is None:
                # Prompt logprobs need every prompt position computed, so no cached prefix.
                hits, num_hit = kv.get_computed_blocks(req)
                asks_connector = self.connector is not None
                if asks_connector and self._load_external(req, hits, num_hit):
                    continue
            n = req.num_tokens - req.num_computed_tokens - num_hit
            if not cfg.chunked_prefill:
                if n > cfg.max_num_batched_tokens:
                    self.waiting.pop()
                    self._finish_error(req, f"needs {n} tokens in one step, over max_num_batched_tokens")
                    continue
                if n > budget:
                    break  # whole or not at all: it runs in a later step
            if threshold and n > threshold:
                n = threshold
            if n > budget:
                n = budget
            if prefill_left is not None and n > prefill_left:
                n = prefill_left
            images = None
            if req.mm_inputs:
                n, images = self._fit_images(req, req.num_computed_tokens + num_hit, n, encoder_left, budget)
                if n <= 0:
                    break  # its next image waits for encoder budget or cache room: a later step
            new_blocks = kv.allocate_slots(req, n, num_hit, hits)
            if new_blocks is None and self._drop_loaded_blocks(keep=req):
                new_blocks = kv.allocate_slots(req, n, num_hit, hits)
            if new_blocks is None:
                if not self.running and not kv.held_elsewhere(req.req_id):
                    # Every block is free or evictable and it still does not fit (blocks a
                    # lease or a KV load holds come back: it waits for them).
                    self.waiting.pop()
                    self._finish_error(req)
                    continue
                break
            self.waiting.pop()
            self.loaded_waiting.discard(req)
            if asks_connector:
                self._count_external_query(req, num_hit)
            req.num_computed_tokens += num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            if req.scheduled_time is None:
                req.scheduled_time = time.monotonic()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled_new.append(req)
            num_scheduled[req.req_id] = n
            budget -= n
            if prefill_left is not None:
                prefill_left -= n
            if images is not None:
                encoder_left -= self._encode_images(req, *images)
            if adapters is not None and lora is not None:
                adapters.add(lora.lora_int_id)
        for req in reversed(skipped):
            self.waiting.prepend(req)

        return self._build_output(scheduled_new, scheduled_running, num_scheduled, new_blocks_of, draft_tokens)

    def _fit_images(
        self, req: Request, start: int, n: int, encoder_left: int, room: int
    ) -> tuple[int, tuple[list[int], list[str]]]:
        """Prompt positions [start, start + n) cut short of the first image the step cannot
        serve, with the images to encode and the held entries to read for the rest. An image
        is served when the workers hold its embeddings, or when it fits the encoder budget
        and the cache has room: the entries idle now, less the idle ones this chunk is to
        read, may be dropped for it. Pure: ``_encode_images`` commits it once the request
        has its blocks. An image's chunk may end mid-image (later positions read the held
        rest), unless whole_images keeps each image in one step: then a chunk that starts at
        an image grows to hold it whole when the step has ``room`` (token budget left), past
        --max-step-ms's cap, which could otherwise keep a long image waiting for ever."""
        cache = self.encoder_cache
        if self.config.whole_images:
            first = next((im for im in req.mm_inputs if im.overlaps(start, start + n)), None)
            if first is not None and first.offset <= start and first.offset + first.length > start + n:
                whole = first.offset + first.length - start
                if whole <= room:
                    n = whole
        encode: list[int] = []
        held: list[str] = []
        pending = kept = 0  # embeddings to add; idle embeddings this chunk keeps from eviction
        for idx, image in enumerate(req.mm_inputs):
            if not image.overlaps(start, start + n):
                continue
            cut = max(0, image.offset - start)  # the chunk stopped before this image
            if self.config.whole_images and image.offset + image.length > start + n:
                return cut, (encode, held)  # the image runs whole in a later step
            h = image.hash
            if h in held or any(req.mm_inputs[j].hash == h for j in encode):
                continue
            if cache.holds(h):
                extra = cache.size[h] if h in cache.idle else 0
                if extra and not cache.fits(pending, kept + extra):
                    return cut, (encode, held)  # the images before it took the room it stands in
                kept += extra
                held.append(h)
                continue
            if image.length > encoder_left - pending or not cache.fits(pending + image.length, kept):
                return cut, (encode, held)
            encode.append(idx)
            pending += image.length
        return n, (encode, held)

    def _encode_images(self, req: Request, encode: list[int], held: list[str]) -> int:
        """The scheduled request reads the held entries ``held`` and has its images ``encode``
        encoded this step: referenced first (so no addition evicts them), then added to the
        ledger and the step's list. Returns the encoder tokens they take."""
        cache = self.encoder_cache
        for h in held:
            cache.ref(req.req_id, h)
        if encode:
            self._encode.setdefault(req.req_id, []).extend(encode)
        tokens = 0
        for idx in encode:
            image = req.mm_inputs[idx]
            cache.add(req.req_id, image.hash, image.length)
            tokens += image.length
        return tokens

    def _undo_encodes(self, victim: Request) -> int:
        """A request scheduled earlier this step was preempted: the images it was to encode
        go to another scheduled request of this step that reads the same entry, or out of
        the ledger (never encoded). Returns the encoder tokens given back."""
        back = 0
        for idx in self._encode.pop(victim.req_id, []):
            image = victim.mm_inputs[idx]
            users = self.encoder_cache.refs.get(image.hash, set()) - {victim.req_id}
            heir = next((self.requests[u] for u in sorted(users) if u in self.requests), None)
            if heir is not None:
                j = next(k for k, im in enumerate(heir.mm_inputs) if im.hash == image.hash)
                self._encode.setdefault(heir.req_id, []).append(j)
            else:
                self.encoder_cache.forget(image.hash)
                back += image.length
        return back

    def _hold_images(self, req: Request) -> None:
        """After a step: the images whose placeholders the request has computed are let go;
        the one it is in the middle of stays referenced (its later positions read it)."""
        cache = self.encoder_cache
        done = req.num_computed_tokens
        for image in req.mm_inputs:
            if image.offset + image.length <= done:
                cache.release(req.req_id, [image.hash])

    def _load_external(self, req: Request, hits: list[KVCacheBlock], num_hit: int) -> bool:
        """Past the pool's cached prefix, the connector may hold more of the prompt: give
        the request blocks for it and wait for the load (WAITING_FOR_REMOTE_KVS). True when
        the request left the waiting queue for that; False to schedule it as it is."""
        assert self.connector is not None
        kv = self.kv_cache_manager
        bs = kv.block_size
        start = len(hits)
        # Blocks up to the one holding the prompt's second-to-last token: the last is computed
        # here, for its logits (a partly filled block counts; its loaded part is used).
        ext = self.connector.num_external_blocks(req, start, -(-(req.num_tokens - 1) // bs))
        if ext == 0:
            self.connector.skip_load(req)
            return False
        new_blocks = kv.allocate_slots(req, ext * bs, num_hit, hits)
        if new_blocks is None:
            return False  # no room for the load: the request computes (or waits) as usual
        self.waiting.pop()
        load_id = next(self._load_ids)
        resumed = req.status is RequestStatus.PREEMPTED or req.num_output_tokens > 0
        self._count_external_query(req, num_hit)
        self.loading[load_id] = _Load(req, start, ext, resumed)
        self._load_of[req.req_id] = load_id
        req.num_computed_tokens += num_hit
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.connector.start_load(load_id, req, start, [b.block_id for b in new_blocks])
        return True

    def _count_external_query(self, req: Request, num_hit: int) -> None:
        """vLLM's external prefix-cache query: the prompt's tokens past the local hit, once, at
        the request's first admission (a failed load's retry or a preempted request's is none)."""
        if req.num_cached_tokens < 0:
            self.connector.stats.queried_tokens += req.num_tokens - num_hit  # type: ignore[union-attr]

    def _loads_done(self, kv_loaded: dict[int, int]) -> None:
        """Loads the workers report: their intact blocks count as computed (and are cached
        again), and the request goes back to the front of the queue; an aborted request's
        leased blocks are freed now."""
        assert self.connector is not None
        kv = self.kv_cache_manager
        for load_id, intact in kv_loaded.items():
            load = self.loading.pop(load_id, None)
            if load is None:
                continue  # a load the workers of before a restart started
            req = load.request
            self.connector.loaded(req, load.start, load.asked, intact)
            if req.is_finished:
                kv.release(f"load-{load_id}")
                continue
            del self._load_of[req.req_id]
            before = req.num_computed_tokens
            req.num_computed_tokens = min(before + intact * kv.block_size, req.num_tokens - 1)
            if not load.resumed:
                self.connector.stats.loaded_tokens += req.num_computed_tokens - before
            if req.num_computed_tokens == 0:
                kv.free(req)  # nothing arrived: it starts clean, with a fresh prefix lookup
            kv.cache_blocks(req, req.num_computed_tokens)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = req.num_computed_tokens
            req.status = RequestStatus.PREEMPTED if load.resumed else RequestStatus.WAITING
            self.waiting.prepend(req)
            if req.num_computed_tokens:
                self.loaded_waiting.add(req)

    def _drop_loaded_blocks(self, keep: Request | None = None) -> bool:
        """Free the blocks of waiting requests that hold some (a KV load brought them back,
        and no seat or budget took them yet): running requests and the queue's head come
        before them. What they loaded stays cached, so a later lookup finds it again.
        True when some were freed."""
        if not self.loaded_waiting:
            return False
        freed = False
        for req in list(self.loaded_waiting):
            if req is keep:
                continue
            self.loaded_waiting.discard(req)
            self.kv_cache_manager.free(req)
            req.num_computed_tokens = 0
            freed = True
        return freed

    def _prefill_cap(self) -> int | None:
        """Prompt tokens this step may carry under ``max_step_ms``: what the measured step
        cost leaves after a token for every decoding request, and never under the floor;
        None when there is no cap, nothing measured yet, or no stream to keep fluid (every
        running request is still in its prompt: capping would only delay them all)."""
        if self.step_cost is None:
            return None
        decoding = sum(1 for r in self.running if r.num_computed_tokens >= r.num_prompt_tokens)
        if not decoding:
            return None
        fits = self.step_cost.max_tokens(self.config.max_step_ms / 1e3)
        if fits is None:
            return None
        return max(fits - decoding, PREFILL_FLOOR_BLOCKS * self.config.block_size)

    def _measure(self, tokens: int, worker_times: list[float]) -> None:
        """Teach the step cost what a step of ``tokens`` took rank 0 (preparing, running and
        sampling it), once past the process's first steps."""
        if not worker_times or self.step_cost is None:
            return
        if self._unmeasured_steps > 0:
            self._unmeasured_steps -= 1
            return
        self.step_cost.observe(tokens, sum(worker_times))

    def _running_adapters(self) -> set[int]:
        """The LoRA adapters of the running requests: the slots the workers hold now."""
        return {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}

    def _propose(self, req: Request, budget: int) -> list[int]:
        """Drafts for a decoding request, no more than the step's budget, the context and
        ``max_tokens`` leave room for (a step emits up to len(drafts) + 1 tokens)."""
        cfg = self.config
        assert req.spec_window is not None and self.proposer is not None
        k = min(
            req.spec_window.draft_len,
            budget - 1,
            cfg.max_model_len - req.num_tokens,
            req.max_tokens - req.num_output_tokens - 1,  # type: ignore[operator]
        )
        if cfg.long_prefill_token_threshold:
            k = min(k, cfg.long_prefill_token_threshold - 1)
        return self.proposer.propose(req.all_token_ids, k) if k > 0 else []

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, req: Request) -> None:
        """Recompute-style preemption: drop the KV, start over later (prefix cache helps)."""
        self.kv_cache_manager.free(req)
        if req.mm_inputs:
            self.encoder_cache.release(req.req_id, [image.hash for image in req.mm_inputs])
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self._forget_on_workers(req.req_id)
        self.waiting.prepend(req)

    def _build_output(
        self,
        scheduled_new: list[Request],
        scheduled_running: list[Request],
        num_scheduled: dict[str, int],
        new_blocks_of: dict[str, list[KVCacheBlock]],
        draft_tokens: dict[str, list[int]],
    ) -> SchedulerOutput:
        kv = self.kv_cache_manager
        worker_tokens = self._worker_num_tokens
        step_reqs: dict[str, Request] = {}
        new_data = []
        for req in scheduled_new:
            new_data.append(
                NewRequestData(
                    req_id=req.req_id,
                    prompt_token_ids=req.prompt_token_ids,  # never mutated after construction
                    output_token_ids=list(req.output_token_ids),
                    sampling_params=req.sampling_params,
                    block_ids=kv.get_block_ids(req.req_id),
                    num_computed_tokens=req.num_computed_tokens,
                    pooling_params=req.pooling_params,
                    lora_request=req.lora_request,
                    mm_inputs=req.mm_inputs or None,
                )
            )
            worker_tokens[req.req_id] = req.num_tokens
            step_reqs[req.req_id] = req
        cached = CachedRequestData()
        c_ids, c_toks, c_blocks, c_computed = (
            cached.req_ids,
            cached.new_token_ids,
            cached.new_block_ids,
            cached.num_computed_tokens,
        )
        for req in scheduled_running:
            rid = req.req_id
            known = worker_tokens[rid]
            total = req.num_tokens
            blocks = new_blocks_of[rid]
            c_ids.append(rid)
            c_toks.append(req.all_token_ids[known:total] if known < total else [])
            c_blocks.append([b.block_id for b in blocks] if blocks else [])
            c_computed.append(req.num_computed_tokens)
            worker_tokens[rid] = total
            step_reqs[rid] = req
        self._advance(step_reqs, num_scheduled, draft_tokens)
        for req in step_reqs.values():
            if req.mm_inputs:
                self._hold_images(req)
        encode, self._encode = self._encode, {}
        finished = self._finished_req_ids
        self._finished_req_ids = set()
        grammars = self._grammars_to_send
        if grammars:
            self._grammars_to_send = {}
        self.step += 1
        self._step_reqs[self.step] = step_reqs
        return SchedulerOutput(
            step=self.step,
            scheduled_new_reqs=new_data,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=finished,
            scheduled_spec_decode_tokens=draft_tokens,
            grammars=grammars,
            kv_ops=self.connector.take_ops() if self.connector is not None else None,
            encoder_inputs=encode,
            free_encoder_hashes=self.encoder_cache.take_freed(),
        )

    def _advance(
        self, step_reqs: dict[str, Request], num_scheduled: dict[str, int], draft_tokens: dict[str, list[int]]
    ) -> None:
        """Count the step's tokens as computed, publish the full blocks it computes to the
        prefix cache, and (overlap) add a placeholder for each token it samples. Draft
        positions are never published: their KV holds tokens that may be rejected; blocks
        that accepted drafts filled are published once the step's tokens come back."""
        kv = self.kv_cache_manager
        hashing = kv.block_hasher is not None
        bs = kv.block_size
        overlap = self.config.async_scheduling or self.config.pipeline_depth > 1
        for rid, req in step_reqs.items():
            c = req.num_computed_tokens
            req.num_computed_tokens = after = c + num_scheduled[rid]
            drafts = draft_tokens.get(rid)
            if drafts:
                if hashing:
                    kv.cache_blocks(req, after - len(drafts))
            # Only a step that crosses a block boundary can fill one, so most decodes skip the call.
            elif hashing and c // bs != after // bs:
                kv.cache_blocks(req, after)
            if overlap and after >= req.num_tokens + req.num_output_placeholders:
                req.num_output_placeholders += 1

    # -- results -------------------------------------------------------------------

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        model_runner_output: ModelRunnerOutput | None,
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, check stops, cache filled blocks, free finished requests."""
        outputs = self._pending_outputs
        self._pending_outputs = []
        step_reqs = self._step_reqs.pop(scheduler_output.step, None)
        if model_runner_output is None:
            return outputs
        if self.step_cost is not None and scheduler_output.total_num_scheduled_tokens:
            self._measure(scheduler_output.total_num_scheduled_tokens, model_runner_output.worker_times)
        if scheduler_output.scheduled_spec_decode_tokens:
            self._take_back_rejected(scheduler_output.scheduled_spec_decode_tokens, model_runner_output)
        if model_runner_output.grammars_ready or model_runner_output.grammar_errors:
            self._grammars_done(model_runner_output, outputs)
        if model_runner_output.kv_loaded:
            self._loads_done(model_runner_output.kv_loaded)
        if model_runner_output.kv_sent:
            assert self.connector is not None
            for transfer_id in self.connector.sent(model_runner_output.kv_sent):
                self.kv_cache_manager.release(f"send-{transfer_id}")
        requests = step_reqs if step_reqs is not None else self.requests
        overlap = self.config.async_scheduling or self.config.pipeline_depth > 1
        appended = self.config.async_scheduling  # the workers appended their token themselves
        worker_tokens = self._worker_num_tokens
        # Under overlap a block's last token was a placeholder when the step that computes its
        # KV was scheduled (_advance), so the block is hashed only now, when that token lands.
        kv = self.kv_cache_manager
        late_hashes = overlap and kv.block_hasher is not None
        any_finished = False
        for req_id, plp in model_runner_output.prompt_logprobs.items():
            req = requests.get(req_id)
            if req is not None and req.prompt_logprobs is not None:
                _merge_prompt_logprobs(req.prompt_logprobs, plp)
        if model_runner_output.pooled:
            any_finished = self._pooled(requests, model_runner_output.pooled, outputs)
        if model_runner_output.request_errors:
            any_finished |= self._failed(requests, model_runner_output.request_errors, outputs)
        logprobs = model_runner_output.logprobs
        max_model_len = self.config.max_model_len
        for req_id, tokens in zip(model_runner_output.req_ids, model_runner_output.sampled_token_ids):
            if not tokens:
                continue
            req = requests.get(req_id)
            if req is None:
                continue
            if req.status is not _RUNNING and not (
                req.status is RequestStatus.PREEMPTED and req.num_output_placeholders
            ):
                continue  # finished or aborted while the step ran (or preempted, without overlap)
            if overlap:
                req.num_output_placeholders -= 1
                if appended and req_id in worker_tokens:
                    worker_tokens[req_id] += len(tokens)  # the workers appended it themselves
            new_tokens = tokens
            status = None
            hashed = len(req.block_hashes)
            for k, tok in enumerate(tokens):
                req.append_output_token_ids(tok)
                # Cheap "could it stop?" filter; _check_stop decides.
                if (
                    tok in req.stop_token_ids
                    or len(req.output_token_ids) >= req.max_tokens  # type: ignore[operator]
                    or req.num_tokens >= max_model_len
                ):
                    status = self._check_stop(req, tok)
                    if status is not None:
                        new_tokens = tokens[: k + 1]
                        break
            # blocks filled by accepted drafts (more than one token) are full and computed now,
            # and with overlap a block's hash comes only now: published before _finish frees them
            if (late_hashes or len(tokens) > 1) and len(req.block_hashes) > hashed:
                kv.cache_blocks(req, req.num_computed_tokens)
            lp = logprobs.get(req_id) if logprobs else None
            if lp is not None and len(new_tokens) < len(tokens):
                lp = lp.slice(0, len(new_tokens))
            if status is None:
                out = EngineCoreOutput(req_id, new_tokens, None, None, lp, req.num_cached_tokens, None)
            else:
                any_finished = True
                if req.status is RequestStatus.PREEMPTED:
                    self.waiting.remove(req)
                self._finish(req, status)
                out = self._output(req, new_tokens, lp)
            if req.prompt_logprobs is not None:  # once, with the first token
                out.prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, None
            outputs.append(out)
        if any_finished:
            self.running = [r for r in self.running if r.status is _RUNNING]
        return outputs

    def _pooled(
        self, requests: dict[str, Request], pooled: dict[str, list[float]], outputs: list[EngineCoreOutput]
    ) -> bool:
        """Pooling requests whose prompt is computed end here, their vector in the output."""
        done = False
        for req_id, data in pooled.items():
            req = requests.get(req_id)
            if req is None or req.status is not _RUNNING:
                continue  # aborted (or preempted) while the step ran
            self._finish(req, RequestStatus.FINISHED_STOPPED)
            out = self._output(req, [])
            out.pooled = data
            outputs.append(out)
            done = True
        return done

    def _failed(self, requests: dict[str, Request], errors: dict[str, str], outputs: list[EngineCoreOutput]) -> bool:
        """Requests the workers could not run end here with the workers' message."""
        done = False
        for req_id, message in errors.items():
            req = requests.get(req_id)
            if req is None or req.status.is_finished:
                continue  # aborted while the step ran
            if req.status is RequestStatus.PREEMPTED:
                self.waiting.remove(req)
            self.kv_cache_manager.unpublish(req)
            req.error = message
            self._finish(req, RequestStatus.FINISHED_ERROR)
            outputs.append(self._output(req, []))
            done = True
        return done

    def _take_back_rejected(self, draft_tokens: dict[str, list[int]], runner_output: ModelRunnerOutput) -> None:
        """Count accepted drafts and roll ``num_computed_tokens`` back past the rejected ones.
        A verified request's sampled list holds its
        accepted drafts plus one token, so ``len - 1`` drafts were accepted."""
        stats = self.spec_decode_stats
        assert stats is not None
        sampled = dict(zip(runner_output.req_ids, runner_output.sampled_token_ids))
        for req_id, drafts in draft_tokens.items():
            req = self.requests.get(req_id)
            tokens = sampled.get(req_id)
            if req is None or req.status is not _RUNNING or not tokens:
                continue  # aborted during the step: its blocks are already free
            accepted = len(tokens) - 1
            stats.record(len(drafts), accepted)
            if req.spec_window is not None:
                req.spec_window.record(len(drafts), accepted)
            req.num_computed_tokens -= len(drafts) - accepted

    def _grammars_done(self, runner_output: ModelRunnerOutput, outputs: list[EngineCoreOutput]) -> None:
        """Ready grammars send their requests to the waiting queue; failed ones finish them.
        Ids no longer waiting (aborted meanwhile) are ignored."""
        for req_id in runner_output.grammars_ready:
            req = self.awaiting_grammar.pop(req_id, None)
            if req is not None:
                req.status = RequestStatus.WAITING
                self.waiting.add(req)
        for req_id, message in runner_output.grammar_errors.items():
            req = self.awaiting_grammar.pop(req_id, None)
            if req is not None:
                req.error = f"the worker could not compile the request's grammar: {message}"
                self._finish(req, RequestStatus.FINISHED_ERROR)
                outputs.append(self._output(req, []))

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        """In order: stop token (not before min_tokens outputs), max_tokens, context full."""
        num_out = len(req.output_token_ids)
        if token in req.stop_token_ids and num_out >= req.min_tokens:
            if token in req.sampling_params.stop_token_ids:
                req.stop_reason = token  # EOS leaves stop_reason None, as in OpenAI/vLLM
            return RequestStatus.FINISHED_STOPPED
        if req.max_tokens is not None and num_out >= req.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # -- finishing -----------------------------------------------------------------

    def _finish(self, req: Request, status: RequestStatus) -> None:
        """Final state: blocks back to the pool (cached ones stay findable), workers told."""
        req.status = status
        connector = self.connector
        if connector is not None:
            connector.forget(req)
            kv = self.kv_cache_manager
            params = connector.request_finished(req, kv.get_block_ids(req.req_id))
            if params is not None:  # another instance reads its KV: held until sent
                kv.lease(req, f"send-{params['remote_request_id']}")
                req.kv_transfer_out = params
        self.kv_cache_manager.free(req)
        if req.mm_inputs:
            self.encoder_cache.release(req.req_id, [image.hash for image in req.mm_inputs])
        self.loaded_waiting.discard(req)
        self._forget_on_workers(req.req_id)
        self.requests.pop(req.req_id, None)

    def _finish_error(self, req: Request, why: str | None = None) -> None:
        kv = self.kv_cache_manager
        req.error = (
            f"request {req.req_id!r} {why}"
            if why is not None
            else f"request {req.req_id!r} needs more KV cache than exists: {req.num_tokens} tokens need "
            f"{kv.num_blocks_needed(req.num_tokens + 1)} blocks of {kv.block_size} tokens, "
            f"the pool has {kv.num_usable_blocks}; raise num_blocks or lower max_model_len"
        )
        self._finish(req, RequestStatus.FINISHED_ERROR)
        self._pending_outputs.append(self._output(req, []))

    def _forget_on_workers(self, req_id: str) -> None:
        if self._worker_num_tokens.pop(req_id, None) is not None:
            self._finished_req_ids.add(req_id)

    @staticmethod
    def _output(req: Request, new_tokens: list[int], lp: LogprobsLists | None = None) -> EngineCoreOutput:
        return EngineCoreOutput(
            req_id=req.req_id,
            new_token_ids=new_tokens,
            finish_reason=req.status.finish_reason,
            stop_reason=req.stop_reason,
            new_logprobs=lp,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            error=req.error,
            kv_transfer_params=req.kv_transfer_out,
        )


def _adapter_names(reqs: Iterable[Request]) -> list[str]:
    return sorted({r.lora_request.lora_name for r in reqs if r.lora_request is not None})


def _merge_prompt_logprobs(into: LogprobsLists, chunk: PromptLogprobs) -> None:
    """Append a chunk's entries past what ``into`` holds (prompt token 1 is entry 0); a
    chunk recomputed after a preemption repeats entries already there and adds nothing."""
    skip = len(into.ranks) + 1 - chunk.start
    if skip < 0:
        return  # a gap cannot happen (chunks arrive in order); refuse to misalign rather than guess
    into.token_ids.extend(chunk.lists.token_ids[skip:])
    into.logprobs.extend(chunk.lists.logprobs[skip:])
    into.ranks.extend(chunk.lists.ranks[skip:])
