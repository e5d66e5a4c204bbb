"""AsyncEngine: the public async API, composed of actors on the caller's event loop.

    async with AsyncEngine.from_args(EngineArgs()) as engine:
        async for out in engine.generate("Hello", SamplingParams(max_tokens=16)):
            print(out.outputs[0].text)

Leaving the ``async for`` early (break, cancellation, a client disconnect) aborts
the request and frees its KV blocks in the same step.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from typing import Any, AsyncIterator

from aiolm.config import EngineArgs, RunnerConfig
from aiolm.core.request import Request
from aiolm.core.scheduler import Scheduler, SchedulerConfig
from aiolm.engine.core import EngineCore
from aiolm.engine.errors import EngineDeadError
from aiolm.engine.input import InputProcessor, PromptType
from aiolm.engine.messages import AbortRequests, AddRequests
from aiolm.engine.output import OutputProcessor, RequestState
from aiolm.executor.base import Executor
from aiolm.outputs import RequestOutput
from aiolm.params import ParamError, SamplingParams
from aiolm.structured.backend import Validator

log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, args: EngineArgs | None = None, **kwargs: Any) -> None:
        self.args = args if args is not None else EngineArgs(**kwargs)
        self._started = False
        self._dead: str | None = None
        self.executor: Executor | None = None
        self.core: EngineCore | None = None
        self.output: OutputProcessor | None = None
        self.grammars = Validator(self.args.structured_outputs_backend)
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "requests_finished": 0}
        self._submissions = itertools.count()

    @classmethod
    def from_args(cls, args: EngineArgs | None = None, **kwargs: Any) -> "AsyncEngine":
        return cls(args, **kwargs)

    async def __aenter__(self) -> "AsyncEngine":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    # -- life cycle -----------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            return
        from aiolm.model.loader import resolve_model

        a = self.args
        self.source = await asyncio.to_thread(resolve_model, a.model)
        self.tokenizer = await asyncio.to_thread(self.source.load_tokenizer)
        mc = self.source.config
        self.max_model_len = a.max_model_len or min(mc.max_position_embeddings, 8192)
        self.model_name = a.served_model_name or self.source.name
        runner_cfg = RunnerConfig(
            model=str(self.source.origin), dtype=a.dtype, attention_backend=a.attention_backend,
            enforce_eager=a.enforce_eager, max_cudagraph_size=a.max_cudagraph_size,
            max_num_seqs=a.max_num_seqs,
            max_model_len=self.max_model_len, block_size=a.block_size,
            kv_cache_memory=a.kv_cache_memory, num_threads=a.num_threads, seed=a.seed,
            device=a.resolved_device(), gpu_memory_utilization=a.gpu_memory_utilization,
            max_num_batched_tokens=a.max_num_batched_tokens,
            structured_outputs=a.structured_outputs_backend != "none")
        if a.executor == "local":
            from aiolm.executor.local import LocalExecutor

            self.executor = LocalExecutor(runner_cfg)
        else:
            from aiolm.executor.multiproc import MultiprocExecutor

            self.executor = MultiprocExecutor(runner_cfg, a.tensor_parallel_size, on_death=self._on_worker_death)
        await self.executor.start()
        self.scheduler = Scheduler(SchedulerConfig(
            num_blocks=self.executor.num_blocks, max_num_seqs=a.max_num_seqs,
            max_num_batched_tokens=max(a.max_num_batched_tokens, 1),
            max_model_len=self.max_model_len, block_size=a.block_size,
            long_prefill_token_threshold=a.long_prefill_token_threshold,
            policy=a.scheduling_policy, enable_prefix_caching=a.enable_prefix_caching))
        self.grammars.configure(self.tokenizer, mc.vocab_size)
        self.inputs = InputProcessor(self.tokenizer, mc.vocab_size, self.max_model_len,
                                     self.source.eos_token_ids, a.max_logprobs)
        self.output = OutputProcessor(self.tokenizer, self._abort_children, self._on_finish, self.stats,
                                      self._add_siblings)
        self.core = EngineCore(self.scheduler, self.executor, self.output, log_steps=a.log_step_costs)
        self.output.start(self._on_crash)
        self.core.start(self._on_crash)
        self._started = True

    async def shutdown(self) -> None:
        if self._dead is None:
            self._dead = "engine shut down"
        if self.output is not None:
            self.output.fail_all(EngineDeadError(self._dead))
        for actor in (self.core, self.output):
            if actor is not None:
                await actor.stop()
        if self.executor is not None:
            await self.executor.shutdown()
        self.grammars.close()
        self._started = False

    def _on_crash(self, actor: Any, error: BaseException) -> None:
        self._die(f"{actor.name} failed: {type(error).__name__}: {error}")

    def _on_worker_death(self, reason: str) -> None:
        self._die(reason)

    def _die(self, reason: str) -> None:
        if self._dead is not None:
            return
        self._dead = reason
        log.error("engine is dead: %s", reason)
        if self.output is not None:
            self.output.fail_all(EngineDeadError(reason))

    def is_healthy(self) -> bool:
        return (self._started and self._dead is None and self.executor is not None
                and self.executor.is_alive() and self.core is not None and self.core.running
                and self.output is not None and self.output.running)

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if not self._started:
            raise EngineDeadError("engine not started (use `async with` or `await engine.start()`)")

    # -- requests -------------------------------------------------------------------

    async def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                          request_id: str | None = None, priority: int = 0) -> RequestState:
        """Validate and queue a request; returns its state (read it with ``stream``)."""
        self._check_alive()
        assert self.output is not None and self.core is not None
        params = self.inputs.params(params)
        await self.grammars.check(params.structured_outputs)  # off the loop, cached by the grammar's text
        processed = await self.inputs.process(prompt)
        self._check_alive()
        rid = request_id if request_id is not None else self.inputs.new_request_id()
        if rid in self.output.requests:
            raise ParamError("request_id", f"request id {rid!r} is already in use by a live request")
        n = params.n
        # Internal ids are unique per submission, so a user id reused after an abort can never
        # receive the old request's late outputs (a stale abort or token still in a mailbox).
        base = f"{rid}@{next(self._submissions)}"
        child_ids = [base] if n == 1 else [f"{base}#{i}" for i in range(n)]
        state = self.output.register(rid, processed.prompt, processed.token_ids, params, child_ids)
        reqs = []
        for i, cid in enumerate(child_ids):
            p = params if n == 1 else params.clone(n=1, seed=None if params.seed is None else params.seed + i)
            reqs.append(Request(cid, processed.token_ids, p, priority=priority))
        self.stats["prompt_tokens"] += len(processed.token_ids) * n
        # n > 1: the siblings join once the first sequence's prompt is in the KV cache,
        # so they reuse its full blocks through the prefix cache instead of recomputing them.
        state.pending_siblings = reqs[1:]
        self.core.send(AddRequests(reqs[:1]))
        return state

    async def generate(self, prompt: PromptType, params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        state = await self.add_request(prompt, params, request_id, priority)
        # aclosing: when the caller leaves early, the inner stream (and its abort) is closed
        # right here, not later by the garbage collector's async-generator finaliser.
        async with contextlib.aclosing(self.stream(state)) as outputs:
            async for out in outputs:
                yield out

    async def stream(self, state: RequestState) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                out = await state.next_output()
                if out is None:
                    finished = True
                    return
                if out.finished:
                    finished = True
                yield out
                if finished:
                    return
        finally:
            if not finished:
                await self.abort(state.req_id)

    async def abort(self, request_id: str) -> None:
        if self.output is None or self.core is None:
            return
        children = self.output.abort(request_id)
        if children:
            self.core.send(AbortRequests(children))

    def _add_siblings(self, reqs: list[Request]) -> None:
        if self.core is not None:
            self.core.send(AddRequests(reqs))

    def _abort_children(self, child_ids: list[str]) -> None:
        if self.core is not None:
            self.core.send(AbortRequests(child_ids))

    def _on_finish(self, state: RequestState) -> None:
        self.stats["requests_finished"] += 1

    # -- introspection ----------------------------------------------------------------

    def kv_cache_usage(self) -> float:
        return self.scheduler.kv_cache_usage if self._started else 0.0

    def num_requests(self) -> tuple[int, int]:
        """(running, waiting) in the scheduler."""
        if not self._started:
            return 0, 0
        return self.scheduler.num_running, self.scheduler.num_waiting

    # -- what servers and tools may use: the model's tokenizer and chat template -------

    @property
    def vocab_size(self) -> int:
        return self.inputs.vocab_size

    @property
    def generation_config(self) -> dict[str, Any]:
        """The model's generation_config.json (sampling defaults), empty when it has none."""
        return dict(self.source.generation_config)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.inputs.encode(text, add_special_tokens)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenize(text, add_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **template_kwargs: Any) -> str:
        """The prompt text of ``messages`` through the model's chat template (ParamError if unusable)."""
        return self.inputs.chat_prompt(messages, add_generation_prompt=add_generation_prompt, **template_kwargs)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """The tokenizer's own string for each id (byte-level pieces, not decoded text)."""
        return self.tokenizer.convert_ids_to_tokens(token_ids)
