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

The SchedulerOutput is a diff against what the workers already hold (see
aiolm/core/outputs.py). The engine must call ``update_from_output`` after every
``schedule()``, with an empty ModelRunnerOutput (or None) when nothing ran:
requests the scheduler finishes by itself (too large for the KV cache) are
reported there.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

from aiolm.core.kv_cache import KVCacheBlock, KVCacheManager, PrefixCacheStats
from aiolm.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    LogprobsLists,
    ModelRunnerOutput,
    NewRequestData,
    PromptLogprobs,
    SchedulerOutput,
)
from aiolm.core.request import Request, RequestStatus
from aiolm.params import ParamError

_RUNNING = RequestStatus.RUNNING


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
    async_scheduling: bool = False  # overlap: the engine schedules a step while the previous one runs

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")


# -- waiting queues -------------------------------------------------------------


class FCFSQueue:
    """Arrival order; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self._q.append(req)

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

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv_cache_manager = KVCacheManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching, config.hash_seed)
        self.requests: dict[str, Request] = {}
        self.waiting: FCFSQueue | PriorityQueue = (
            PriorityQueue() if config.policy == "priority" else FCFSQueue())
        self.running: list[Request] = []
        self.step = 0
        # What the workers hold: req_id -> number of the request's tokens they have.
        self._worker_num_tokens: dict[str, int] = {}
        self._finished_req_ids: set[str] = set()  # to tell the workers next step
        self._pending_outputs: list[EngineCoreOutput] = []  # finished inside schedule()
        # The Request objects of each step not yet updated (step -> req_id -> request): a
        # result belongs to the request that was scheduled, never to a later one reusing its id.
        self._step_reqs: dict[int, dict[str, Request]] = {}

    # -- intake ------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request. A prompt must leave room for one output token:
        ``1 <= len(prompt) <= max_model_len - 1``, else ParamError("prompt")."""
        n = request.num_prompt_tokens
        limit = self.config.max_model_len - 1
        if n == 0:
            raise ParamError("prompt", "the prompt is empty")
        if n > limit:
            raise ParamError("prompt", f"the prompt has {n} tokens but at most {limit} fit "
                                       f"(max_model_len {self.config.max_model_len} minus one output token)")
        if request.req_id in self.requests:
            raise ValueError(f"request id {request.req_id!r} is already in use")
        request.resolve_max_tokens(self.config.max_model_len)
        self.kv_cache_manager.attach(request)
        request.status = RequestStatus.WAITING
        self.requests[request.req_id] = request
        self.waiting.add(request)

    def abort_requests(self, req_ids: Iterable[str]) -> list[EngineCoreOutput]:
        """Finish the given live requests now, freeing their blocks in this call."""
        outputs = []
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            outputs.append(self._output(req, []))
        return outputs

    def reset_workers(self, num_blocks: int) -> None:
        """The workers were replaced and no KV survived: start a new block pool of
        ``num_blocks`` and queue every live request to be recomputed from its prompt
        plus the tokens it already generated (preemption by recompute, for all).
        Running requests go first, in batch order, ahead of those already waiting."""
        cfg = self.config
        cfg.num_blocks = num_blocks
        self.kv_cache_manager = KVCacheManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching, cfg.hash_seed)
        queued = [*self.running, *self.waiting]
        self.running = []
        self.waiting = PriorityQueue() if cfg.policy == "priority" else FCFSQueue()
        for req in queued:
            req.num_computed_tokens = 0
            req.num_output_placeholders = 0  # the steps that would have sampled them are lost
            if req.status == RequestStatus.RUNNING:
                req.status = RequestStatus.PREEMPTED
            req.block_hashes = []  # the new pool's hasher may have another root (a random one)
            self.kv_cache_manager.attach(req)
            self.waiting.add(req)
        self._worker_num_tokens.clear()
        self._finished_req_ids.clear()
        self._step_reqs.clear()

    # -- counts and stats ------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        """True while requests live or finished ones still await reporting."""
        return bool(self.requests) or bool(self._pending_outputs)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

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
        threshold = cfg.long_prefill_token_threshold
        budget = cfg.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_blocks_of: dict[str, list[KVCacheBlock]] = {}
        scheduled_running: list[Request] = []
        preempted = False

        # 1. running requests catch up first.
        allocate = kv.allocate_slots
        req_blocks = kv.req_to_blocks
        bs = kv.block_size
        running = self.running
        max_model_len = cfg.max_model_len
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            ph = req.num_output_placeholders
            if ph and (len(req.output_token_ids) + ph >= req.max_tokens  # type: ignore[operator]
                       or req.num_tokens + ph >= max_model_len):
                i += 1  # its last token is already being sampled
                continue
            n = req.num_tokens + ph - req.num_computed_tokens
            if threshold and n > threshold:
                n = threshold
            if n > budget:
                n = budget
            if n <= 0:
                i += 1
                continue
            # Decode fast path (the common case): the last block still has room.
            # Same rule as allocate_slots' first check, inlined to save a call per request.
            blocks = req_blocks.get(req.req_id)
            if blocks is not None and req.num_computed_tokens + n <= len(blocks) * bs:
                new_blocks = []
            else:
                new_blocks = None
            while new_blocks is None:
                new_blocks = allocate(req, n)
                if new_blocks is not None:
                    break
                victim = self._pick_victim()
                if victim is req and len(self.running) == 1:
                    if req.num_output_placeholders:
                        break  # overlap: the token in flight may end it; decide once it is known
                    # Alone and still short of blocks: it can never run.
                    self.running.pop()
                    self._finish_error(req)
                    break
                vi = self.running.index(victim)
                del self.running[vi]
                if vi < i:
                    i -= 1  # the priority policy may pick one scheduled earlier this step
                if victim.req_id in num_scheduled:
                    budget += num_scheduled.pop(victim.req_id)
                    new_blocks_of.pop(victim.req_id)
                    scheduled_running.remove(victim)
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if new_blocks is None:
                if i < len(running) and running[i] is req:
                    i += 1  # still running, waiting for its token in flight
                continue  # else req left self.running; index i now points at the next one
            scheduled_running.append(req)
            num_scheduled[req.req_id] = n
            new_blocks_of[req.req_id] = new_blocks
            budget -= n
            i += 1

        # 2. admit waiting requests, unless this step had to preempt.
        scheduled_new: list[Request] = []
        while (not preempted and budget > 0 and len(self.waiting)
               and len(self.running) < cfg.max_num_seqs):
            req = self.waiting.peek()
            if req.num_output_placeholders:
                break  # preempted while its token is in flight: resumes once that arrives
            if kv.num_blocks_needed(req.num_tokens) > kv.num_usable_blocks:
                self.waiting.pop()
                self._finish_error(req)
                continue
            hits: list[KVCacheBlock] = []
            num_hit = 0
            if req.num_computed_tokens == 0 and req.prompt_logprobs is None:
                # Prompt logprobs need every prompt position computed, so no cached prefix.
                hits, num_hit = kv.get_computed_blocks(req)
            n = req.num_tokens - req.num_computed_tokens - num_hit
            if threshold and n > threshold:
                n = threshold
            if n > budget:
                n = budget
            new_blocks = kv.allocate_slots(req, n, num_hit, hits)
            if new_blocks is None:
                if not self.running:
                    # Every block is free or evictable and it still does not fit.
                    self.waiting.pop()
                    self._finish_error(req)
                    continue
                break
            self.waiting.pop()
            req.num_computed_tokens += num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled_new.append(req)
            num_scheduled[req.req_id] = n
            budget -= n

        return self._build_output(scheduled_new, scheduled_running, num_scheduled, new_blocks_of)

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, req: Request) -> None:
        """Recompute-style preemption: drop the KV, start over later (prefix cache helps)."""
        self.kv_cache_manager.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self._forget_on_workers(req.req_id)
        self.waiting.prepend(req)

    def _build_output(
        self,
        scheduled_new: list[Request],
        scheduled_running: list[Request],
        num_scheduled: dict[str, int],
        new_blocks_of: dict[str, list[KVCacheBlock]],
    ) -> SchedulerOutput:
        kv = self.kv_cache_manager
        worker_tokens = self._worker_num_tokens
        step_reqs: dict[str, Request] = {}
        new_data = []
        for req in scheduled_new:
            new_data.append(NewRequestData(
                req_id=req.req_id,
                prompt_token_ids=req.prompt_token_ids,  # never mutated after construction
                output_token_ids=list(req.output_token_ids),
                sampling_params=req.sampling_params,
                block_ids=kv.get_block_ids(req.req_id),
                num_computed_tokens=req.num_computed_tokens,
            ))
            worker_tokens[req.req_id] = req.num_tokens
            step_reqs[req.req_id] = req
        cached = CachedRequestData()
        c_ids, c_toks, c_blocks, c_computed = (
            cached.req_ids, cached.new_token_ids, cached.new_block_ids, cached.num_computed_tokens)
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
        self._advance(step_reqs, num_scheduled)
        finished = self._finished_req_ids
        self._finished_req_ids = set()
        self.step += 1
        self._step_reqs[self.step] = step_reqs
        return SchedulerOutput(
            step=self.step,
            scheduled_new_reqs=new_data,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=finished,
        )

    def _advance(self, step_reqs: dict[str, Request], num_scheduled: dict[str, int]) -> None:
        """Count the step's tokens as computed, publish the full blocks it computes to the
        prefix cache, and (overlap) add a placeholder for each token it samples."""
        kv = self.kv_cache_manager
        hashing = kv.block_hasher is not None
        bs = kv.block_size
        overlap = self.config.async_scheduling
        for rid, req in step_reqs.items():
            c = req.num_computed_tokens
            req.num_computed_tokens = after = c + num_scheduled[rid]
            # Only a step that crosses a block boundary can fill one, so most decodes skip the call.
            if hashing and c // bs != after // bs:
                kv.cache_blocks(req, after)
            if overlap and after >= req.num_tokens + req.num_output_placeholders:
                req.num_output_placeholders += 1

    # -- results -------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput | None,
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, check stops, cache filled blocks, free finished requests."""
        outputs = self._pending_outputs
        self._pending_outputs = []
        step_reqs = self._step_reqs.pop(scheduler_output.step, None)
        if model_runner_output is None:
            return outputs
        requests = step_reqs if step_reqs is not None else self.requests
        overlap = self.config.async_scheduling
        worker_tokens = self._worker_num_tokens
        any_finished = False
        for req_id, plp in model_runner_output.prompt_logprobs.items():
            req = requests.get(req_id)
            if req is not None and req.prompt_logprobs is not None:
                _merge_prompt_logprobs(req.prompt_logprobs, plp)
        logprobs = model_runner_output.logprobs
        max_model_len = self.config.max_model_len
        for req_id, tokens in zip(model_runner_output.req_ids, model_runner_output.sampled_token_ids):
            if not tokens:
                continue
            req = requests.get(req_id)
            if req is None:
                continue
            if req.status is not _RUNNING and not (
                    req.status is RequestStatus.PREEMPTED and req.num_output_placeholders):
                continue  # finished or aborted while the step ran (or preempted, without overlap)
            if overlap:
                req.num_output_placeholders -= 1
                if req_id in worker_tokens:
                    worker_tokens[req_id] += len(tokens)  # the workers appended it themselves
            new_tokens = tokens
            status = None
            for k, tok in enumerate(tokens):
                req.append_output_token_ids(tok)
                # Cheap "could it stop?" filter; _check_stop decides.
                if (tok in req.stop_token_ids or len(req.output_token_ids) >= req.max_tokens  # type: ignore[operator]
                        or req.num_tokens >= max_model_len):
                    status = self._check_stop(req, tok)
                    if status is not None:
                        new_tokens = tokens[:k + 1]
                        break
            lp = logprobs.get(req_id) if logprobs else None
            if lp is not None and len(new_tokens) < len(tokens):
                lp = _trim_logprobs(lp, len(new_tokens))
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
        self.kv_cache_manager.free(req)
        self._forget_on_workers(req.req_id)
        self.requests.pop(req.req_id, None)

    def _finish_error(self, req: Request) -> None:
        kv = self.kv_cache_manager
        req.error = (
            f"request {req.req_id!r} needs more KV cache than exists: {req.num_tokens} tokens need "
            f"{kv.num_blocks_needed(req.num_tokens + 1)} blocks of {kv.block_size} tokens, "
            f"the pool has {kv.num_usable_blocks}; raise num_blocks or lower max_model_len")
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
        )


def _merge_prompt_logprobs(into: LogprobsLists, chunk: PromptLogprobs) -> None:
    """Append a chunk's entries past what ``into`` holds (prompt token 1 is entry 0); a
    chunk recomputed after a preemption repeats entries already there and adds nothing."""
    skip = len(into.ranks) + 1 - chunk.start
    if skip < 0:
        return  # a gap cannot happen (chunks arrive in order); refuse to misalign rather than guess
    into.token_ids.extend(chunk.lists.token_ids[skip:])
    into.logprobs.extend(chunk.lists.logprobs[skip:])
    into.ranks.extend(chunk.lists.ranks[skip:])


def _trim_logprobs(lp: LogprobsLists, n: int) -> LogprobsLists:
    return LogprobsLists(token_ids=lp.token_ids[:n], logprobs=lp.logprobs[:n], ranks=lp.ranks[:n])
