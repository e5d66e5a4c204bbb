"""Data-parallel replicas behind one API: ``--data-parallel-size N``.

A ``DataParallelEngine`` holds N ``AsyncEngine`` replicas on the same event loop,
each with its own scheduler, KV cache and worker set (worker processes or Ray
actors, each set its own tensor-parallel group), and implements the same
``EngineClient`` protocol (client.py) as one ``AsyncEngine``, so the server, its
routes and its metrics do not know the difference. Why replicas on one loop,
not one engine process each: the loop's share of a step (scheduling, output
processing) is small next to the forward pass, which already runs in the
workers, so N replicas need no new process kind, no second IPC hop per token
and no new failure mode; the cost is that the loop's work grows with N
(docs/distributed.md says when that stops paying).

Routing (router.py): by prefix-cache affinity (hashes of the first blocks of the
prompt's token ids) unless that replica is busier than the least loaded one by
more than a slack, then by load. Only replicas that can take requests count: a
recovering replica (its workers are being replaced) or a dead one is avoided.

Failures: each replica follows the reliability rules on its own. When a
replica's workers die, its in-flight requests are recomputed after the restart
(recovery on) or fail at once with EngineDeadError (recovery off, or the restart
budget spent); a request that failed that way before producing any output is
resubmitted to a live replica instead of failing. The DataParallelEngine is dead
only when every replica is, and only then do its ``death_callbacks`` run.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import weakref
from collections.abc import AsyncGenerator, Callable
from typing import Any

from aiolm.config import EngineArgs
from aiolm.engine.async_engine import AsyncEngine
from aiolm.engine.client import EngineClient
from aiolm.engine.errors import EngineDeadError, EngineRecoveringError
from aiolm.engine.input import PromptType
from aiolm.engine.output_processor import RequestState
from aiolm.engine.router import PrefixRouter
from aiolm.lora.request import LoRARequest
from aiolm.metrics import CombinedMetrics
from aiolm.outputs import PoolingRequestOutput, RequestOutput
from aiolm.params import ParamError, SamplingParams
from aiolm.pooling.config import PoolingConfig
from aiolm.pooling.params import PoolingParams

log = logging.getLogger(__name__)


def create_engine(args: EngineArgs) -> EngineClient:
    """An AsyncEngine, or a DataParallelEngine when ``args.data_parallel_size`` > 1."""
    if args.data_parallel_size > 1:
        return DataParallelEngine(args)
    return AsyncEngine(args)


class DataParallelEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        one = dataclasses.replace(args, data_parallel_size=1)
        self.replicas = [AsyncEngine(one, engine_index=i) for i in range(args.data_parallel_size)]
        self.metrics = CombinedMetrics([r.metrics for r in self.replicas])
        self.router = PrefixRouter(len(self.replicas), args.block_size, slack=max(1, args.max_num_seqs // 4))
        self.death_callbacks: list[Callable[[str], None]] = []
        self._owner: weakref.WeakKeyDictionary[RequestState, int] = weakref.WeakKeyDictionary()
        self._submitted: weakref.WeakKeyDictionary[RequestState, tuple] = weakref.WeakKeyDictionary()
        self._dead: str | None = None
        self._started = False

    # -- life cycle -------------------------------------------------------------------

    async def __aenter__(self) -> DataParallelEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    async def start(self) -> None:
        if self._started:
            return
        if self.args.executor == "ray":
            from aiolm.executor import ray_cluster

            # One cluster for every replica, sized for all of them.
            await asyncio.to_thread(
                ray_cluster.connect,
                self.args.ray_address,
                self.args.tensor_parallel_size * self.args.pipeline_parallel_size * self.args.data_parallel_size,
            )
        # transformers imports lazily and not thread-safely: the replicas' tokenizer loads,
        # each in a thread, must not be the first to touch it.
        await asyncio.to_thread(lambda: __import__("transformers").PreTrainedTokenizerFast)
        results = await asyncio.gather(*(r.start() for r in self.replicas), return_exceptions=True)
        failed = [e for e in results if isinstance(e, BaseException)]
        if failed:
            await asyncio.gather(*(r.shutdown() for r in self.replicas), return_exceptions=True)
            raise failed[0]
        for i, r in enumerate(self.replicas):
            r.death_callbacks.append(functools.partial(self._replica_died, i))
        self._started = True
        log.info("%d data-parallel replicas started", len(self.replicas))

    async def shutdown(self) -> None:
        if self._dead is None:
            self._dead = "engine shut down"
        await asyncio.gather(*(r.shutdown() for r in self.replicas), return_exceptions=True)
        self._started = False

    def _replica_died(self, i: int, reason: str) -> None:
        log.error("data-parallel replica %d is dead: %s", i, reason)
        if self._dead is None and all(r.dead_reason is not None for r in self.replicas):
            self._dead = f"every replica is dead (the last: {reason})"
            for cb in self.death_callbacks:
                try:
                    cb(self._dead)
                except Exception:
                    log.exception("an engine death callback failed")

    # -- health -----------------------------------------------------------------------

    def _available(self, r: AsyncEngine) -> bool:
        return r.is_healthy()

    def health(self) -> tuple[bool, str | None]:
        if self._dead is not None:
            return False, self._dead
        if any(self._available(r) for r in self.replicas):
            return True, None
        return False, "; ".join(f"replica {i}: {r.health()[1]}" for i, r in enumerate(self.replicas))

    def is_healthy(self) -> bool:
        return self.health()[0]

    @property
    def recovering(self) -> str | None:
        """Why no replica takes requests while some are replacing workers, else None."""
        if self._dead is not None or any(self._available(r) for r in self.replicas):
            return None
        why = [r.recovering for r in self.replicas if r.recovering is not None]
        return why[0] if why else None

    @property
    def stalled(self) -> str | None:
        """Why no replica takes requests while some have a stalled worker, else None."""
        if self._dead is not None or any(self._available(r) for r in self.replicas):
            return None
        why = [f"replica {i}: {r.stalled}" for i, r in enumerate(self.replicas) if r.stalled is not None]
        return "; ".join(why) or None

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    # -- requests ---------------------------------------------------------------------

    def _loads(self) -> list[int | None]:
        return [len(r.output.children) if self._available(r) and r.output is not None else None for r in self.replicas]

    async def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        timeout: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestState:
        front = self._front()
        params = front.inputs.params(params)  # a bad request is refused before it is routed
        processed = await front.inputs.process(prompt)
        rid = request_id if request_id is not None else front.inputs.new_request_id()
        if any(r.output is not None and rid in r.output.requests for r in self.replicas):
            raise ParamError("request_id", f"request id {rid!r} is already in use by a live request")
        ids = {"prompt_token_ids": processed.token_ids, "prompt": processed.prompt}
        return await self._submit(ids, params, rid, priority, timeout, lora_request, exclude=())

    async def _submit(
        self,
        ids: dict[str, Any],
        params: SamplingParams | None,
        rid: str,
        priority: int,
        timeout: float | None,
        lora: LoRARequest | None,
        exclude: tuple[int, ...],
    ) -> RequestState:
        loads = self._loads()
        for i in exclude:
            loads[i] = None
        if all(load is None for load in loads):
            self._raise_unavailable()
        i = self.router.choose(ids["prompt_token_ids"], loads)
        state = await self.replicas[i].add_request(ids, params, rid, priority, timeout, lora)
        self._owner[state] = i
        self._submitted[state] = (ids, params, priority, timeout, lora)
        return state

    def _front(self) -> AsyncEngine:
        """A replica for tokenizing and templates (all share the model): a live one if any."""
        if not self._started:
            raise EngineDeadError("engine not started (use `async with` or `await engine.start()`)")
        for r in self.replicas:
            if r.dead_reason is None:
                return r
        raise EngineDeadError(self._dead or "every replica is dead")

    def _raise_unavailable(self) -> None:
        if self._dead is not None or all(r.dead_reason is not None for r in self.replicas):
            raise EngineDeadError(self._dead or "every replica is dead")
        raise EngineRecoveringError(
            f"no replica takes requests now ({self.health()[1]}); retry shortly", retry_after=5.0
        )

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        timeout: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        state = await self.add_request(prompt, params, request_id, priority, timeout, lora_request)
        async with contextlib.aclosing(self.stream(state)) as outputs:
            async for out in outputs:
                yield out

    async def stream(self, state: RequestState) -> AsyncGenerator[RequestOutput, None]:
        """The replica's stream; a request its dead replica failed before any output is
        resubmitted once to another replica (the caller sees one stream)."""
        tried: list[int] = []
        while True:
            i = self._owner[state]
            produced = False
            try:
                async with contextlib.aclosing(self.replicas[i].stream(state)) as outputs:
                    async for out in outputs:
                        produced = True
                        yield out
                return
            except EngineDeadError:
                if produced or self._dead is not None:
                    raise
                tried.append(i)
                ids, params, priority, timeout, lora = self._submitted[state]
                try:
                    new = await self._submit(ids, params, state.req_id, priority, timeout, lora, exclude=tuple(tried))
                except (EngineDeadError, EngineRecoveringError):
                    raise EngineDeadError(
                        f"replica {i} died and no other replica can take request {state.req_id!r}"
                    ) from None
                log.warning("request %r moved from dead replica %d to replica %d", state.req_id, i, self._owner[new])
                state = new

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        truncate_prompt_tokens: int | None = None,
        timeout: float | None = None,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """Pooled on the least loaded live replica (a pooling request holds no KV after it
        ends, so there is no prefix to follow)."""
        loads = self._loads()
        if all(load is None for load in loads):
            self._raise_unavailable()
        i = min((load, i) for i, load in enumerate(loads) if load is not None)[1]
        async with contextlib.aclosing(
            self.replicas[i].encode(prompt, pooling_params, request_id, priority, truncate_prompt_tokens, timeout)
        ) as outputs:
            async for out in outputs:
                yield out

    def tokenize_pair(self, text: str, text_pair: str, truncate_prompt_tokens: int | None = None) -> dict[str, Any]:
        return self._model().tokenize_pair(text, text_pair, truncate_prompt_tokens)

    # -- LoRA adapters: every replica serves the same ones --------------------------------

    async def load_lora(self, name: str, path: str) -> LoRARequest:
        lora = await self.replicas[0].load_lora(name, path)
        for r in self.replicas[1:]:
            await r.add_lora(lora)
        return lora

    async def remove_lora(self, name: str) -> LoRARequest:
        lora = await self.replicas[0].remove_lora(name)
        for r in self.replicas[1:]:
            await r.remove_lora(name)
        return lora

    def lora(self, name: str) -> LoRARequest | None:
        return self._model().lora(name)

    def list_loras(self) -> list[LoRARequest]:
        return self._model().list_loras()

    @property
    def runner(self) -> str:
        return self._model().runner

    @property
    def pooling_config(self) -> PoolingConfig | None:
        return self._model().pooling_config

    @property
    def hidden_size(self) -> int:
        return self._model().hidden_size

    async def abort(self, request_id: str) -> None:
        for r in self.replicas:
            if r.output is not None and request_id in r.output.requests:
                await r.abort(request_id)

    # -- what the server and metrics read ----------------------------------------------

    @property
    def stats(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for r in self.replicas:
            for k, v in r.stats.items():
                total[k] = total.get(k, 0) + v
        return total

    def num_requests(self) -> tuple[int, int]:
        running = waiting = 0
        for r in self.replicas:
            a, b = r.num_requests()
            running, waiting = running + a, waiting + b
        return running, waiting

    def kv_cache_usage(self) -> float:
        """Mean over replicas (each has a cache of the same size)."""
        return sum(r.kv_cache_usage() for r in self.replicas) / len(self.replicas)

    @property
    def metrics_registry(self) -> Any:
        """Every replica's series in one prometheus_client registry."""
        return self.metrics.registry

    def render_replica_metrics(self) -> str:
        """Routing and health per replica, after the engines' own series (Prometheus text)."""
        rows: list[tuple[str, str, Callable[[int, AsyncEngine], float]]] = [
            ("dp_replica_healthy", "gauge", lambda i, r: float(r.is_healthy())),
            ("dp_replica_requests_running", "gauge", lambda i, r: float(r.num_requests()[0])),
            ("dp_replica_routed_total", "counter", lambda i, r: float(self.router.stats.routed[i])),
            ("dp_replica_affinity_routed_total", "counter", lambda i, r: float(self.router.stats.affinity[i])),
            (
                "dp_replica_prefix_cache_queries_total",
                "counter",
                lambda i, r: float(r.scheduler.prefix_cache_stats.queries),
            ),
            ("dp_replica_prefix_cache_hits_total", "counter", lambda i, r: float(r.scheduler.prefix_cache_stats.hits)),
        ]
        lines, p = [], self.args.metrics_prefix
        for name, kind, value in rows:
            lines.append(f"# TYPE {p}:{name} {kind}")
            for i, r in enumerate(self.replicas):
                v = value(i, r) if hasattr(r, "scheduler") else 0.0
                lines.append(f'{p}:{name}{{replica="{i}"}} {v:g}')
        return "\n".join(lines) + "\n"

    # -- the model-level API: tokenizer, chat template, limits ---------------------------
    # From a live replica (any replica once none lives: these do not need workers).

    def _model(self) -> AsyncEngine:
        live = [r for r in self.replicas if r.dead_reason is None]
        return live[0] if live else self.replicas[0]

    @property
    def model_name(self) -> str:
        return self._model().model_name

    @property
    def max_model_len(self) -> int:
        return self._model().max_model_len

    @property
    def vocab_size(self) -> int:
        return self._model().vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._model().eos_token_ids

    @property
    def generation_config(self) -> dict[str, Any]:
        return self._model().generation_config

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._model().tokenize(text, add_special_tokens)

    def prompt_too_long(self, text: str) -> str | None:
        return self._model().prompt_too_long(text)

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        return self._model().render_chat(messages, add_generation_prompt, **template_kwargs)

    async def render_chat_async(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        return await self._model().render_chat_async(messages, add_generation_prompt, **template_kwargs)

    @property
    def takes_images(self) -> bool:
        return self._model().takes_images

    async def prompt_with_images(self, text: str, urls: list[tuple[str, str]], field: str) -> dict[str, Any]:
        return await self._model().prompt_with_images(text, urls, field)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._model().decode(token_ids, skip_special_tokens)

    def token_strings(self, token_ids: list[int]) -> list[str]:
        return self._model().token_strings(token_ids)

    def tokenizer_info(self) -> dict[str, Any]:
        return self._model().tokenizer_info()
