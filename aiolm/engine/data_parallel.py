"""Data-parallel replicas behind one API: ``--data-parallel-size N``.

A ``DataParallelEngine`` is the front end of N replicas, each an engine process of its
own (replica.py: scheduler, KV cache, output processing, its own workers and
tensor-parallel group), launched on this machine or, with ``--data-parallel-backend
ray``, as Ray actors across a cluster's nodes (replica_ray.py). It implements the same
``EngineClient`` protocol (client.py) as one ``AsyncEngine``, so the server, its
routes and its metrics do not know the difference. Why processes: one replica's
Python (scheduling, detokenizing) never slows another's or the API loop's, so a
replica adds what a second server would.

The front end keeps the model-level API itself (tokenizer, chat template, limits:
``AsyncEngine.load_model`` without workers): it tokenizes each prompt once, routes
the token ids, and relays the replica's outputs (replica_client.py).

Routing (router.py): by prefix-cache affinity (hashes of the first blocks of the
prompt's token ids) unless that replica is busier than the least loaded one by
more than a slack, then by load. Only replicas that can take requests count: a
recovering replica (its workers are being replaced) or a dead one is avoided.

Failures: each replica follows the reliability rules on its own. When a replica's
workers die, its in-flight requests are recomputed after the restart (recovery on)
or fail at once with EngineDeadError (recovery off, or the restart budget spent);
when the replica process itself dies, every request on it fails that way. A request
that failed before producing any output (still queued there) is resubmitted to a
live replica instead. The DataParallelEngine is dead only when every replica is,
and only then do its ``death_callbacks`` run.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from aiolm.config import EngineArgs
from aiolm.engine.async_engine import AsyncEngine, check_request_args
from aiolm.engine.client import EngineClient
from aiolm.engine.errors import EngineBusyError, EngineDeadError, EngineRecoveringError
from aiolm.engine.input import PromptType
from aiolm.engine.replica_client import Launcher, ProcessLauncher, RemoteRequest, ReplicaClient, ReplicaListener
from aiolm.engine.router import PrefixRouter
from aiolm.lora.request import LoRARequest
from aiolm.metrics import CombinedMetrics
from aiolm.outputs import PoolingRequestOutput, RequestOutput
from aiolm.params import ParamError, SamplingParams
from aiolm.pooling.config import PoolingConfig
from aiolm.pooling.params import PoolingParams

log = logging.getLogger(__name__)

# How long one replica may take to start its engine (load the model, start its workers).
REPLICA_START_TIMEOUT_S = 900.0


def create_engine(args: EngineArgs) -> EngineClient:
    """An AsyncEngine, or a DataParallelEngine when ``args.data_parallel_size`` > 1."""
    if args.data_parallel_size > 1:
        return DataParallelEngine(args)
    return AsyncEngine(args)


# What a request was submitted with: its prompt's ids, params, priority, timeout and adapter.
Submitted = tuple[dict[str, Any], SamplingParams, int, float | None, LoRARequest | None]


@dataclass
class RoutedRequest:
    """A request as the front end tracks it: where it runs and what to resubmit."""

    req_id: str
    replica: int
    remote: RemoteRequest
    submitted: Submitted
    deadline: float | None  # the loop time its timeout ends, kept across a resubmission


class DataParallelEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.model = AsyncEngine(args.replica())  # the model-level API: no workers of its own
        self.replicas: list[ReplicaClient] = []
        self.metrics = CombinedMetrics(lambda: [r.families for r in self.replicas])
        self.router = PrefixRouter(args.data_parallel_size, args.block_size, slack=max(1, args.max_num_seqs // 4))
        self.death_callbacks: list[Callable[[str], None]] = []
        self._listener: ReplicaListener | None = None
        self._ray: Any = None  # the Ray placement of the replicas (replica_ray.RayReplicas)
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
        try:
            launchers, host = await self._launchers()
            self._listener = ReplicaListener(host)
            await self._listener.start()
            self.replicas = [ReplicaClient(i, launcher) for i, launcher in enumerate(launchers)]
            results = await asyncio.gather(
                self.model.load_model(),
                *(r.start(self.args, self._listener, REPLICA_START_TIMEOUT_S) for r in self.replicas),
                return_exceptions=True,
            )
            failed = [e for e in results if isinstance(e, BaseException)]
            if failed:
                raise failed[0]
        except BaseException:
            await self.shutdown()
            raise
        self._started = True
        for i, r in enumerate(self.replicas):
            r.on_death = functools.partial(self._replica_died, i)
            if r.dead_reason is not None:  # died between its start and now
                self._replica_died(i, r.dead_reason)
        log.info("%d data-parallel replica processes started", len(self.replicas))

    async def _launchers(self) -> tuple[list[Launcher], str]:
        """One launcher per replica, and the address they connect back to."""
        a = self.args
        if a.data_parallel_backend != "ray":
            return [ProcessLauncher() for _ in range(a.data_parallel_size)], "127.0.0.1"
        from aiolm.engine.replica_ray import RayReplicas
        from aiolm.executor import ray_cluster
        from aiolm.executor.ray import _ray

        ranks = a.tensor_parallel_size * a.pipeline_parallel_size
        await asyncio.to_thread(ray_cluster.connect, a.ray_address, ranks * a.data_parallel_size)
        bundle = {"CPU": float(ranks)}
        if a.resolved_device().startswith("cuda"):
            bundle["GPU"] = float(ranks)
        self._ray = RayReplicas(a.data_parallel_size, bundle, a.ray_placement)
        launchers = await self._ray.place(REPLICA_START_TIMEOUT_S)
        await asyncio.gather(*(launcher.locate(REPLICA_START_TIMEOUT_S) for launcher in launchers))
        return list(launchers), str(_ray().util.get_node_ip_address())

    async def shutdown(self) -> None:
        if self._dead is None:
            self._dead = "engine shut down"
        await asyncio.gather(*(r.shutdown() for r in self.replicas), return_exceptions=True)
        if self._listener is not None:
            await self._listener.close()
            self._listener = None
        if self._ray is not None:
            await self._ray.remove()
            self._ray = None
        self._started = False

    def _replica_died(self, i: int, reason: str) -> None:
        if self._dead is None and all(r.dead_reason is not None for r in self.replicas):
            self._dead = f"every replica is dead (the last: {reason})"
            for cb in self.death_callbacks:
                try:
                    cb(self._dead)
                except Exception:
                    log.exception("an engine death callback failed")

    # -- health -----------------------------------------------------------------------

    def health(self) -> tuple[bool, str | None]:
        if self._dead is not None:
            return False, self._dead
        if not self._started:
            return False, "the engine is not running"
        if any(r.available for r in self.replicas):
            return True, None
        return False, "; ".join(f"replica {i}: {r.health()[1]}" for i, r in enumerate(self.replicas))

    def is_healthy(self) -> bool:
        return self.health()[0]

    def _status_reasons(self, key: str) -> str | None:
        """A status reason (recovering, stalled) of the replicas while none takes requests."""
        if self._dead is not None or any(r.available for r in self.replicas):
            return None
        why = [f"replica {i}: {r.status[key]}" for i, r in enumerate(self.replicas) if r.status.get(key)]
        return "; ".join(why) or None

    @property
    def recovering(self) -> str | None:
        """Why no replica takes requests while some are replacing workers, else None."""
        return self._status_reasons("recovering")

    @property
    def stalled(self) -> str | None:
        """Why no replica takes requests while some have a stalled worker, else None."""
        return self._status_reasons("stalled")

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    # -- requests ---------------------------------------------------------------------

    def _loads(self) -> list[int | None]:
        return [r.live if r.available else None for r in self.replicas]

    def _check_started(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if not self._started:
            raise EngineDeadError("engine not started (use `async with` or `await engine.start()`)")

    async def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        timeout: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RoutedRequest:
        self._check_started()
        check_request_args(request_id, priority, timeout)  # as a replica would, before routing
        inputs = self.model.inputs
        params = inputs.params(params)  # a bad request is refused before it is routed
        processed = await inputs.process(prompt)
        rid = request_id if request_id is not None else inputs.new_request_id()
        self._check_unused(rid)
        ids: dict[str, Any] = {"prompt_token_ids": processed.token_ids, "prompt": processed.prompt}
        if processed.images:
            ids["mm_inputs"] = processed.images
        if processed.cache_salt is not None:
            ids["cache_salt"] = processed.cache_salt
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        return await self._submit(rid, (ids, params, priority, timeout, lora_request), deadline, exclude=[])

    def _check_unused(self, rid: str) -> None:
        if any(rid in r.requests for r in self.replicas):
            raise ParamError("request_id", f"request id {rid!r} is already in use by a live request")

    async def _submit(
        self, rid: str, submitted: Submitted, deadline: float | None, exclude: list[int]
    ) -> RoutedRequest:
        """Route and add; a replica found dead, recovering or full on the way is skipped (its
        status was older than its state), so only the state of them all can refuse: a full
        one's refusal (429) only when every other replica refused too."""
        ids, params, priority, timeout, lora = submitted
        busy: EngineBusyError | None = None  # the first full replica's refusal
        while True:
            loads = self._loads()
            for i in exclude:
                loads[i] = None
            if all(load is None for load in loads):
                if busy is not None:
                    raise busy
                self._raise_unavailable()
            route = self.router.pick(ids["prompt_token_ids"], loads)
            i = route.replica
            if deadline is not None:
                timeout = max(deadline - asyncio.get_running_loop().time(), 1e-3)
            try:
                remote = await self.replicas[i].add_request(ids, params, rid, priority, timeout, lora)
            except (EngineDeadError, EngineBusyError) as e:
                full = e if isinstance(e, EngineBusyError) and not isinstance(e, EngineRecoveringError) else None
                (log.debug if full else log.warning)("replica %d refused request %r (%s); routing it again", i, rid, e)
                busy = busy or full
                exclude.append(i)
                continue
            self.router.record(route)
            return RoutedRequest(rid, i, remote, submitted, deadline)

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

    async def stream(self, state: RoutedRequest) -> AsyncGenerator[RequestOutput, None]:
        """The replica's stream; a request its dead replica failed before any output is
        resubmitted to another replica (the caller sees one stream)."""
        tried: list[int] = []
        while True:
            produced = False
            try:
                async with contextlib.aclosing(self.replicas[state.replica].stream(state.remote)) as outputs:
                    async for out in outputs:
                        produced = True
                        yield out
                return
            except EngineDeadError:
                if produced or self._dead is not None:
                    raise
                dead = state.replica
                tried.append(dead)
                try:
                    moved = await self._submit(state.req_id, state.submitted, state.deadline, exclude=tried)
                except (EngineDeadError, EngineRecoveringError):
                    raise EngineDeadError(
                        f"replica {dead} died and no other replica can take request {state.req_id!r}"
                    ) from None
                log.warning("request %r moved from dead replica %d to replica %d", state.req_id, dead, moved.replica)
                state.replica, state.remote = moved.replica, moved.remote

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
        self._check_started()
        rid = request_id if request_id is not None else self.model.inputs.new_request_id()
        self._check_unused(rid)
        tried: set[int] = set()
        while True:  # pooling holds nothing between steps: a dead replica's request is pooled again
            loads = [None if i in tried else load for i, load in enumerate(self._loads())]
            if all(load is None for load in loads):
                self._raise_unavailable()
            i = min((load, i) for i, load in enumerate(loads) if load is not None)[1]
            try:
                out = await self.replicas[i].encode(
                    rid, prompt, pooling_params, priority, truncate_prompt_tokens, timeout
                )
            except (EngineDeadError, EngineRecoveringError) as e:
                if self._dead is not None:
                    raise
                log.warning("replica %d failed pooling request %r (%s); pooling it elsewhere", i, rid, e)
                tried.add(i)
                continue
            yield out
            return

    def tokenize_pooled(self, text: str, truncate_prompt_tokens: int | None = None) -> dict[str, Any]:
        return self.model.tokenize_pooled(text, truncate_prompt_tokens)

    def tokenize_pair(self, text: str, text_pair: str, truncate_prompt_tokens: int | None = None) -> dict[str, Any]:
        return self.model.tokenize_pair(text, text_pair, truncate_prompt_tokens)

    # -- LoRA adapters: every replica serves the same ones --------------------------------

    async def load_lora(self, name: str, path: str, replace: bool = False) -> LoRARequest:
        lora = await self.model.load_lora(name, path, replace)  # checked once, here
        try:
            if replace:  # the replicas drop the one served under the name, if any
                live = [r for r in self.replicas if r.dead_reason is None]
                await asyncio.gather(*(r.call("remove_lora", name) for r in live), return_exceptions=True)
            await self._on_every_replica("add_lora", lora)
        except BaseException:
            # All or nothing: a replica that refused it must not leave the others serving it.
            await self.model.remove_lora(name)
            live = [r for r in self.replicas if r.dead_reason is None]
            await asyncio.gather(*(r.call("remove_lora", name) for r in live), return_exceptions=True)
            raise
        return lora

    async def remove_lora(self, name: str) -> LoRARequest:
        lora = await self.model.remove_lora(name)
        await self._on_every_replica("remove_lora", name)
        return lora

    async def _on_every_replica(self, kind: str, arg: Any) -> None:
        live = [r for r in self.replicas if r.dead_reason is None]
        results = await asyncio.gather(*(r.call(kind, arg) for r in live), return_exceptions=True)
        for r, res in zip(live, results):
            if isinstance(res, BaseException) and r.dead_reason is None:
                raise res

    def lora(self, name: str) -> LoRARequest | None:
        return self.model.lora(name)

    def list_loras(self) -> list[LoRARequest]:
        return self.model.list_loras()

    @property
    def runner(self) -> str:
        return self.model.runner

    @property
    def pooling_config(self) -> PoolingConfig | None:
        return self.model.pooling_config

    @property
    def hidden_size(self) -> int:
        return self.model.hidden_size

    async def abort(self, request_id: str) -> None:
        for r in self.replicas:
            if request_id in r.requests:
                r.abort(request_id)

    # -- what the server and metrics read ----------------------------------------------

    @property
    def stats(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for r in self.replicas:
            for k, v in r.status.get("stats", {}).items():
                total[k] = total.get(k, 0) + v
        return total

    def num_requests(self) -> tuple[int, int]:
        live = [r.status for r in self.replicas if r.dead_reason is None]
        return sum(s.get("running", 0) for s in live), sum(s.get("waiting", 0) for s in live)

    def kv_cache_usage(self) -> float:
        """Mean over replicas (each has a cache of the same size)."""
        return sum(r.status.get("kv_usage", 0.0) for r in self.replicas if r.dead_reason is None) / len(self.replicas)

    async def refresh_metrics(self) -> None:
        """Fetch every live replica's metric families (each renders its own, in its process)."""
        await asyncio.gather(*(r.refresh_metrics() for r in self.replicas))

    @property
    def metrics_registry(self) -> Any:
        """Every replica's series in one prometheus_client registry, as of the last refresh."""
        return self.metrics.registry

    def render_replica_metrics(self) -> str:
        """Routing and health per replica, after the engines' own series (Prometheus text)."""
        rows: list[tuple[str, str, Callable[[int, ReplicaClient], float]]] = [
            ("dp_replica_healthy", "gauge", lambda i, r: float(r.available)),
            # a dead replica runs nothing, whatever it said last
            (
                "dp_replica_requests_running",
                "gauge",
                lambda i, r: float(0 if r.dead_reason else r.status.get("running", 0)),
            ),
            ("dp_replica_routed_total", "counter", lambda i, r: float(self.router.stats.routed[i])),
            ("dp_replica_affinity_routed_total", "counter", lambda i, r: float(self.router.stats.affinity[i])),
            ("dp_replica_prefix_cache_queries_total", "counter", lambda i, r: float(r.status.get("prefix_queries", 0))),
            ("dp_replica_prefix_cache_hits_total", "counter", lambda i, r: float(r.status.get("prefix_hits", 0))),
        ]
        lines, p = [], self.args.metrics_prefix
        for name, kind, value in rows:
            lines.append(f"# TYPE {p}:{name} {kind}")
            for i, r in enumerate(self.replicas):
                lines.append(f'{p}:{name}{{replica="{i}"}} {value(i, r):g}')
        return "\n".join(lines) + "\n"

    # -- the model-level API: tokenizer, chat template, limits ---------------------------
    # The front end's own (AsyncEngine.load_model): none of it needs a replica.

    @property
    def model_name(self) -> str:
        return self.model.model_name

    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.model.eos_token_ids

    @property
    def generation_config(self) -> dict[str, Any]:
        return self.model.generation_config

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        return self.model.sampling_defaults

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.model.tokenize(text, add_special_tokens)

    def prompt_too_long(self, text: str) -> str | None:
        return self.model.prompt_too_long(text)

    def clip_prompt(self, text: str, keep_end: bool) -> str:
        return self.model.clip_prompt(text, keep_end)

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        return self.model.render_chat(messages, add_generation_prompt, **template_kwargs)

    async def render_chat_async(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        return await self.model.render_chat_async(messages, add_generation_prompt, **template_kwargs)

    @property
    def takes_images(self) -> bool:
        return self.model.takes_images

    async def prompt_with_images(self, text: str, urls: list[tuple[str, str]], field: str) -> dict[str, Any]:
        return await self.model.prompt_with_images(text, urls, field)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.model.decode(token_ids, skip_special_tokens)

    def token_strings(self, token_ids: list[int]) -> list[str]:
        return self.model.token_strings(token_ids)

    def tokenizer_info(self) -> dict[str, Any]:
        return self.model.tokenizer_info()
