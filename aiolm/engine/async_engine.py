"""AsyncEngine: the public async API, composed of actors on the caller's event loop.

    async with AsyncEngine.from_args(EngineArgs()) as engine:
        async for out in engine.generate("Hello", SamplingParams(max_tokens=16)):
            print(out.outputs[0].text)

Leaving the ``async for`` early (break, cancellation, a client disconnect) aborts
the request and frees its KV blocks in the same step.

Failures: a failed worker set is replaced and in-flight requests are recomputed
(aiolm/engine/recovery.py); meanwhile new requests get EngineRecoveringError. When
recovery is off or gives up, the engine dies: every stream fails with
EngineDeadError, both actors and the executor stop, and ``death_callbacks`` run.
Admission may be bounded: beyond ``max_num_seqs + max_waiting_requests`` live
sequences a new request gets EngineBusyError; ``timeout`` bounds one request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import gc
import itertools
import logging
import math
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import msgspec

from aiolm.checkpoint.config import ModelConfig
from aiolm.checkpoint.moe import MoEConfig
from aiolm.config import EngineArgs, RunnerConfig
from aiolm.core.request import Request
from aiolm.core.scheduler import Scheduler, SchedulerConfig
from aiolm.engine.core import EngineCore
from aiolm.engine.drain import DrainEstimate
from aiolm.engine.errors import (
    EngineBusyError,
    EngineDeadError,
    EngineRecoveringError,
    RequestError,
    RequestTimeoutError,
)
from aiolm.engine.input import InputProcessor, PromptType, check_token_types, resolve_truncation
from aiolm.engine.messages import AbortRequests, AddRequests, WorkerFailed
from aiolm.engine.output_processor import OutputProcessor, RequestState
from aiolm.engine.recovery import WorkerSupervisor
from aiolm.engine.tokenizer_info import tokenizer_config
from aiolm.executor.base import Executor
from aiolm.kv_transfer.base import ConnectorScheduler
from aiolm.kv_transfer.block_files import HEADER_BYTES, existing_blocks, fingerprint, model_signature
from aiolm.kv_transfer.config import KVTransferConfig, check_disk_path
from aiolm.kv_transfer.offload_scheduler import OffloadScheduler
from aiolm.kv_transfer.params import wants_remote_decode, wants_remote_prefill
from aiolm.kv_transfer.pd_scheduler import PDScheduler
from aiolm.lora.adapter import read_adapter
from aiolm.lora.registry import LoRARegistry
from aiolm.lora.request import LoRARequest
from aiolm.metrics import EngineMetrics
from aiolm.multimodal.media import MediaLimits
from aiolm.multimodal.processor import ImagePrompts
from aiolm.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput
from aiolm.params import OutputKind, ParamError, SamplingParams, sampling_defaults
from aiolm.pooling.config import PoolingConfig, read_pooling_config
from aiolm.pooling.params import PoolingParams
from aiolm.spec_decode import SpecDecodeStats
from aiolm.structured.validator import Validator

if TYPE_CHECKING:
    from aiolm.checkpoint.source import ModelSource

log = logging.getLogger(__name__)


def position_limit(mc: ModelConfig) -> int:
    """The longest sequence a model's positions cover: its position table (less the offset a
    RoBERTa-style table starts at), or RoPE's trained length times the factor of a scaling
    that stretches it (as vLLM derives it; llama3 and longrope configs give the stretched one)."""
    limit = mc.max_position_embeddings - getattr(mc, "position_offset", 0)
    scaling = mc.rope_scaling or {}
    kind, factor = scaling.get("rope_type", scaling.get("type")), scaling.get("factor")
    stretched = kind not in (None, "default", "su", "longrope", "llama3") and mc.architecture != "gemma3"
    if stretched and isinstance(factor, (int, float)) and factor > 1:  # Gemma 3 states the stretched length
        base = scaling.get("original_max_position_embeddings", limit) if kind == "yarn" else limit
        limit = int(base * factor)
    return limit


def check_model_args(args: EngineArgs) -> ModelSource:
    """The ModelSource ``args.model`` names, checked against the engine flags that depend on
    the model (the tensor-parallel split). Raises ModelLoadError or ValueError with a
    one-line message, before any worker starts; the CLI shows that line alone (exit 2)."""
    from aiolm.checkpoint.source import resolve_model
    from aiolm.distributed.sharding import experts_split_error, split_error

    source = resolve_model(args.model)
    mc = source.config
    dense = mc.intermediate_size
    if isinstance(mc, MoEConfig) and all(mc.sparse_layers):
        dense = 0  # no dense MLP to split (Mixtral's intermediate_size is its experts')
    why = split_error(args.tensor_parallel_size, mc.num_heads, mc.num_kv_heads, dense)
    if why is None and isinstance(mc, MoEConfig):
        why = experts_split_error(args.tensor_parallel_size, mc, args.enable_expert_parallel)
    if why is None:
        why = pipeline_error(args, source)
    limit = position_limit(mc)
    if why is None and args.max_model_len is not None and args.max_model_len > limit:
        # past its positions a model's answers are garbage, or its position table's lookup fails
        why = f"--max-model-len {args.max_model_len} is more than the {limit} positions this model has"
    if why is not None:
        raise ValueError(f"{source.name}: {why}")
    kv_transfer = args.kv_transfer()
    if kv_transfer is not None and kv_transfer.disk_path:
        check_disk_path(kv_transfer.disk_path)
    if args.enable_lora:
        if isinstance(mc, MoEConfig) or mc.encoder_only:
            kind = "an encoder" if mc.encoder_only else "a mixture of experts"
            raise ValueError(f"{source.name}: --enable-lora serves adapters of dense decoders; this is {kind}")
        for name, path in args.lora_specs():
            try:
                read_adapter(path, mc, args.max_lora_rank)
            except ParamError as e:
                raise ValueError(f"--lora-modules {name}={path}: {e.message}") from None
    if args.chat_template is not None:
        from aiolm.checkpoint.source import read_chat_template

        source = dataclasses.replace(source, chat_template=read_chat_template(args.chat_template), template_given=True)
    return source


def pipeline_error(args: EngineArgs, source: ModelSource) -> str | None:
    """Why ``--pipeline-parallel-size`` cannot split this model here, or None."""
    from aiolm.checkpoint.families import family_of

    pp, mc = args.pipeline_parallel_size, source.config
    if pp == 1:
        return None
    if args.resolved_device() != "cpu":
        return f"pipeline_parallel_size {pp} runs on CPU workers for now (--device cpu)"
    if family_of(mc.architecture).module not in ("llama", "moe"):
        return (
            f"pipeline_parallel_size {pp}: only the Llama family (Llama, Mistral, Qwen2, Qwen3) and "
            f"mixtures of experts are split into stages; this is {mc.architecture}"
        )
    if mc.num_layers < pp:
        return f"pipeline_parallel_size {pp} needs at least one layer per stage; the model has {mc.num_layers}"
    return None


def resolve_runner(runner: str, source: ModelSource) -> tuple[str, PoolingConfig | None]:
    """``--runner`` for this model: ("generate", None) or ("pooling", how it pools).
    auto pools with encoder-only models, sequence classifiers and sentence-transformers
    folders (modules.json), and generates with everything else."""
    mc = source.config
    archs = source.hf_config.get("architectures") or []
    classifier = any(a.endswith("ForSequenceClassification") for a in archs)
    if runner == "auto":
        st_folder = source.origin.is_dir() and (source.path / "modules.json").is_file()
        runner = "pooling" if mc.encoder_only or classifier or st_folder else "generate"
    if runner == "generate":
        if mc.encoder_only or classifier:
            raise ValueError(
                f"{source.name}: an encoder or classifier cannot generate text; serve it with --runner pooling"
            )
        return runner, None
    return runner, read_pooling_config(str(source.path), source.hf_config, mc.encoder_only)


def check_request_args(request_id: Any, priority: Any, timeout: Any) -> None:
    """ParamError for a request id that is not a string, a priority that is not an integer,
    a timeout that is not a positive number of seconds."""
    if request_id is not None and not isinstance(request_id, str):
        raise ParamError("request_id", f"must be a string, got {type(request_id).__name__}")
    _check_priority(priority)
    _check_timeout(timeout)


def _check_priority(priority: Any) -> None:
    """The scheduler orders requests by it: anything but an integer would fail there."""
    if isinstance(priority, bool) or not isinstance(priority, int) or not -(2**63) <= priority < 2**63:
        raise ParamError("priority", f"must be a 64-bit integer, got {priority!r}")


def _sibling_seed(seed: int | None, i: int) -> int | None:
    """Sequence ``i``'s seed of a request with ``n`` > 1 (None stays None)."""
    if seed is None:
        return None
    if seed + i >= 2**63 - 1024:
        raise ParamError("seed", f"sequence {i} samples with seed + {i}, past the 64-bit bound: use a smaller seed")
    return seed + i


def _check_timeout(timeout: float | None) -> None:
    ok = isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and 0 < timeout < math.inf
    if timeout is not None and not ok:
        raise ParamError("timeout", f"must be a positive number of seconds, got {timeout!r}")


class AsyncEngine:
    def __init__(self, args: EngineArgs | None = None, *, engine_index: int = 0, **kwargs: Any) -> None:
        self.args = args if args is not None else EngineArgs(**kwargs)
        if self.args.data_parallel_size > 1:
            raise ValueError(
                "data_parallel_size > 1 needs several engines: use "
                "aiolm.engine.data_parallel.create_engine(args) (aiolm serve does)"
            )
        self._started = False
        self._model_loaded = False
        self._dead: str | None = None
        self._executor: Executor | None = None
        self._starting: set[Executor] = set()  # started or starting, not yet handed over (_make_executor)
        self.core: EngineCore | None = None
        self.output: OutputProcessor | None = None
        self.grammars = Validator(self.args.structured_outputs_backend, self.args.structured_outputs_compile_timeout)
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "requests_finished": 0}
        # Prometheus metrics in the engine's own registry (aiolm/metrics.py): expose
        # ``metrics_registry`` with prometheus_client, or serve ``metrics.render()``.
        # ``engine_index`` is the replica's number under data parallelism (its ``engine`` label).
        self.metrics = EngineMetrics(self, self.args.metrics_prefix, engine_index)
        self.engine_index = engine_index
        self._submissions = itertools.count()
        self.drain = DrainEstimate()  # how fast seats free up: the Retry-After of a 429
        self.supervisor: WorkerSupervisor | None = None
        self.death_callbacks: list[Callable[[str], None]] = []  # called once, with the reason
        self._stopping: asyncio.Task[None] | None = None
        self._side_tasks: set[asyncio.Task[None]] = set()  # fire-and-forget work, held until done
        self.expert_tokens: list[list[int]] = []  # expert_load()'s running totals
        self.runner = "generate"  # or "pooling" (EngineArgs.runner, resolved for the model at start)
        self.pooling_config: PoolingConfig | None = None  # how a pooling model pools; None when generating
        self.loras: LoRARegistry | None = None  # the adapters served (enable_lora), set at start
        self.kv_transfer: KVTransferConfig | None = None  # the KV connector (--kv-transfer-config), set at start

    @property
    def executor(self) -> Executor | None:
        """The current executor (the core's: recovery replaces it)."""
        return self.core.executor if self.core is not None else self._executor

    @classmethod
    def from_args(cls, args: EngineArgs | None = None, **kwargs: Any) -> AsyncEngine:
        return cls(args, **kwargs)

    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    # -- life cycle -----------------------------------------------------------------

    async def load_model(self) -> None:
        """Read the model's config and tokenizer: the model-level API (tokenizing, templates,
        limits, adapters' registry) without workers. ``start`` does the same, loading the
        tokenizer while the workers start; a data-parallel front end (data_parallel.py) uses
        it alone, its replicas run in their own processes."""
        if self._model_loaded:
            return
        await self._read_model()
        await self._load_inputs()

    async def _read_model(self) -> None:
        """The model's config and what the engine derives from it: all that the workers need."""
        a = self.args
        self.source = await asyncio.to_thread(check_model_args, a)
        mc = self.source.config
        self.runner, pc = resolve_runner(a.runner, self.source)
        self.pooling_config = pc
        pooling = pc is not None
        if pooling and a.pipeline_parallel_size > 1:
            raise ValueError(
                f"{self.source.name}: pipeline_parallel_size {a.pipeline_parallel_size} runs generating "
                f"models; this one pools (--runner pooling)"
            )
        if pooling and a.speculative is not None:
            raise ValueError(
                f"{self.source.name}: speculative {a.speculative!r} drafts generated tokens; this model pools "
                f"(--runner pooling) and generates none"
            )
        self.max_model_len = a.max_model_len or min(position_limit(mc), 8192)
        if a.max_model_len is None and pc is not None and pc.max_seq_length:
            self.max_model_len = min(self.max_model_len, pc.max_seq_length)
        self.model_name = a.served_model_name or self.source.name
        if a.enable_lora:
            self.loras = LoRARegistry(mc, self.model_name, a.max_lora_rank)
            for name, path in a.lora_specs():
                self.loras.add(self.loras.new_request(name, path))
        if isinstance(mc, MoEConfig):
            self.expert_tokens = [[0] * mc.num_experts for layer in mc.sparse_layers if layer]

    async def _load_inputs(self) -> None:
        """The tokenizer and the input processor: the front end's half, which no worker needs."""
        a, mc = self.args, self.source.config
        self.tokenizer = await asyncio.to_thread(self.source.load_tokenizer)
        self.inputs = InputProcessor(
            self.tokenizer,
            mc.vocab_size,
            self.max_model_len,
            self.source.eos_token_ids,
            a.max_logprobs,
            images=self._image_prompts(mc),
            media_limits=MediaLimits(
                allowed_domains=tuple(a.allowed_media_domains) if a.allowed_media_domains is not None else None,
                allowed_local_path=Path(a.allowed_local_media_path) if a.allowed_local_media_path else None,
                fetch_timeout_s=a.media_fetch_timeout,
                max_pixels=a.max_image_pixels,
            ),
        )
        self.inputs.lower_case = self.pooling_config is not None and self.pooling_config.lower_case
        self._model_loaded = True

    async def start(self) -> None:
        if self._started:
            return
        if self._dead is not None:  # its actors and workers are gone for good
            raise EngineDeadError(f"{self._dead}: an engine does not start again; make a new one")
        # The workers start while this process loads the tokenizer: each takes a second or
        # more, and the workers need only the model's config.
        inputs: asyncio.Future[None] | None = None
        if not self._model_loaded:
            await self._read_model()
            inputs = asyncio.ensure_future(self._load_inputs())
        try:
            await self._start(inputs)
        except BaseException:
            if inputs is not None:
                await asyncio.gather(inputs, return_exceptions=True)
            await self._stop_all()  # whatever had started (the workers, say) stops before the error goes up
            raise

    async def _start(self, inputs: asyncio.Future[None] | None) -> None:
        a, mc, pc = self.args, self.source.config, self.pooling_config
        pooling = pc is not None
        overlap = a.overlap_scheduling(pooling)
        # Prefix hits skip computing the prompt's first tokens: only last-token pooling of a
        # decoder can use them (an encoder's every state depends on the whole prompt).
        prefix_caching = a.enable_prefix_caching and (pc is None or (not mc.encoder_only and pc.pooling_type == "last"))
        kv_transfer = self.kv_transfer = a.kv_transfer()
        if kv_transfer is not None and pooling:
            raise ValueError("kv_transfer_config: a pooling model keeps no KV cache to move")
        kv_fingerprint = self._kv_fingerprint() if kv_transfer is not None else ""
        runner_cfg = RunnerConfig(
            model=str(self.source.origin),
            dtype=a.dtype,
            attention_backend=a.attention_backend,
            kv_cache_dtype=a.kv_cache_dtype,
            enforce_eager=a.enforce_eager,
            max_cudagraph_size=a.max_cudagraph_size,
            max_num_seqs=a.max_num_seqs,
            max_model_len=self.max_model_len,
            block_size=a.block_size,
            kv_cache_memory=a.kv_cache_memory,
            num_threads=a.num_threads,
            seed=a.seed,
            device=a.resolved_device(),
            device_offset=self._device_offset(),
            gpu_memory_utilization=a.gpu_memory_utilization,
            max_num_batched_tokens=a.max_num_batched_tokens,
            structured_outputs=a.structured_outputs_backend != "none",
            async_scheduling=overlap,
            enable_expert_parallel=a.enable_expert_parallel,
            runner=self.runner,
            max_loras=a.max_loras if a.enable_lora else 0,
            max_lora_rank=a.max_lora_rank,
            max_cpu_loras=a.max_cpu_loras or a.max_loras,
            kv_transfer=kv_transfer,
            kv_fingerprint=kv_fingerprint,
        )
        # One for the engine's life: a worker set started by recovery keeps the measured rate.
        self.step_watch = a.step_watch()
        self.supervisor = WorkerSupervisor(
            lambda k: self._make_executor(runner_cfg, k),
            a.worker_recovery,
            a.max_worker_restarts,
            a.worker_restart_window,
        )
        self._executor = executor = await self._make_executor(runner_cfg, 0)
        if inputs is not None:
            await inputs  # the tokenizer, loaded meanwhile
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=executor.num_blocks,
                max_num_seqs=a.max_num_seqs,
                max_num_batched_tokens=max(a.max_num_batched_tokens, 1),
                max_model_len=self.max_model_len,
                block_size=a.block_size,
                long_prefill_token_threshold=a.long_prefill_token_threshold,
                max_step_ms=a.max_step_ms,
                policy=cast(Literal["fcfs", "priority"], a.scheduling_policy),
                enable_prefix_caching=prefix_caching,
                speculative=None if pooling else a.spec_config(),
                async_scheduling=overlap,
                pipeline_depth=a.pipeline_parallel_size,
                chunked_prefill=not mc.encoder_only,
                max_loras=a.max_loras if a.enable_lora else 0,
                # at least one image's worth, as vLLM sizes it, so every image can be encoded
                whole_images=getattr(mc, "bidirectional_images", False),
                max_num_encoder_input_tokens=max(
                    a.max_num_encoder_input_tokens or a.max_num_batched_tokens, getattr(mc, "image_tokens", 0)
                ),
                # A disk tier outlives the engine: its blocks keep their names across restarts.
                hash_seed=kv_fingerprint if kv_transfer is not None and kv_transfer.disk_path else None,
            ),
            connector=self._kv_connector(kv_transfer, kv_fingerprint, executor) if kv_transfer is not None else None,
        )
        self.grammars.configure(self.source.path, mc.vocab_size)
        self.grammars.on_first_grammar = lambda: self._prepare_worker_grammars(self.executor)
        self.output = OutputProcessor(
            self.tokenizer, self._abort_children, self._on_finish, self.stats, self._add_siblings, self.metrics
        )
        self.core = EngineCore(
            self.scheduler,
            executor,
            self.output,
            log_steps=a.log_step_costs,
            supervisor=self.supervisor,
            metrics=self.metrics,
            overlap=overlap,
            pipeline_depth=a.pipeline_parallel_size,
        )
        self.metrics.configure(self.model_name, self.max_model_len)
        self.output.start(self._on_crash)
        self.core.start(self._on_crash)
        self._started = True
        # The start-up heap (transformers, tokenizer, jinja) lives as long as the process;
        # left in the collector's oldest generation, each full collection would walk all
        # of it on the event loop (a pause that grows with the heap). Freeze it instead.
        gc.collect()
        gc.freeze()

    def _prepare_worker_grammars(self, executor: Executor | None) -> None:
        """Grammars are in use (the first one's check has begun, in a compile process that
        takes seconds; or a replacement worker set has started): ``executor``'s workers build
        their own compilers meanwhile, so a request does not wait for the two in turn."""
        if executor is None or self._dead is not None:
            return

        async def ask(executor: Executor) -> None:
            try:
                await executor.collective_rpc("prepare_grammars")
            except Exception as e:  # a stopping or dead worker set: its first grammar builds it
                log.debug("workers' grammar compilers not prepared: %s", e)

        self._side_tasks.add(task := asyncio.get_running_loop().create_task(ask(executor)))
        task.add_done_callback(self._side_tasks.discard)

    def _device_offset(self) -> int:
        """The first device of this replica's ranks: replicas on one machine take consecutive
        ones; a Ray replica sees only its own (Ray sets CUDA_VISIBLE_DEVICES for its actor)."""
        a = self.args
        if a.data_parallel_backend == "ray":
            return 0
        return self.engine_index * a.tensor_parallel_size * a.pipeline_parallel_size

    def _check_kv_transfer(self, params: dict[str, Any]) -> None:
        """kv_transfer_params need a TcpConnector in the matching role."""
        kt = self.kv_transfer
        if kt is None or kt.kv_connector != "TcpConnector":
            raise ParamError(
                "kv_transfer_params", "this server moves no KV between instances (start it with --kv-transfer-config)"
            )
        if wants_remote_decode(params) and not kt.produces:
            raise ParamError("kv_transfer_params", f"do_remote_decode needs a kv_producer or kv_both, not {kt.kv_role}")
        if wants_remote_prefill(params) and not kt.consumes:
            raise ParamError(
                "kv_transfer_params", f"do_remote_prefill needs a kv_consumer or kv_both, not {kt.kv_role}"
            )

    def _kv_fingerprint(self) -> str:
        """What decides the meaning of a KV block's bytes here (block_files.fingerprint)."""
        a = self.args
        assert self.source is not None
        return fingerprint(
            {
                "format": 1,
                "model": str(self.source.origin),
                "files": model_signature(str(self.source.origin)),
                "dtype": a.dtype,
                "kv_cache_dtype": a.kv_cache_dtype,
                "device": a.resolved_device().split(":")[0],
                "block_size": a.block_size,
                "tensor_parallel_size": a.tensor_parallel_size,
                "replica": self.engine_index,
            }
        )

    def _image_prompts(self, mc: Any) -> ImagePrompts | None:
        """A vision-language model's processor (its folder's own, from transformers); None
        for a text-only model, whose requests with images are refused."""
        image_token = getattr(mc, "image_token_id", None)
        if image_token is None:
            return None
        return ImagePrompts(
            self.source.path, image_token, mc.image_tokens, self.args.max_images(), self.args.max_image_pixels
        )

    def _kv_connector(self, cfg: KVTransferConfig, fp: str, executor: Executor) -> ConnectorScheduler:
        """The connector's scheduler side; the offloading one sized from the workers' block bytes."""
        if cfg.kv_connector == "TcpConnector":
            return PDScheduler(cfg, self.args.tensor_parallel_size)
        file_bytes = executor.block_bytes + HEADER_BYTES
        disk_blocks = cfg.disk_bytes // file_bytes if cfg.disk_path else 0
        on_disk = existing_blocks(cfg.disk_path, fp) if cfg.disk_path else []
        host_blocks = cfg.cpu_blocks(executor.block_bytes)
        # a tier that holds no block: the workers would keep every saved one, the scheduler
        # none of them to drop
        if cfg.cpu_bytes and not host_blocks:
            raise ValueError(
                f"--kv-transfer-config: cpu_bytes {cfg.cpu_bytes} holds no KV block of this model "
                f"({executor.block_bytes} bytes a block); give at least that, or leave it out"
            )
        if cfg.disk_path and not disk_blocks:
            raise ValueError(
                f"--kv-transfer-config: disk_bytes {cfg.disk_bytes} holds no KV block file of this model "
                f"({file_bytes} bytes a file); give at least that"
            )
        return OffloadScheduler(host_blocks, disk_blocks, on_disk)

    async def _make_executor(self, runner_cfg: RunnerConfig, incarnation: int) -> Executor:
        """A started executor; ``incarnation`` counts the worker sets before it."""
        a = self.args
        if a.executor == "local":
            from aiolm.executor.local import LocalExecutor

            ex: Executor = LocalExecutor(runner_cfg)
        else:
            from aiolm.executor.multiproc import MultiprocExecutor

            holder: list[Executor] = []
            kwargs: dict[str, Any] = dict(
                on_death=lambda reason: self._on_worker_death(holder[0], reason),
                step_watch=self.step_watch,
                incarnation=incarnation,
                all_reduce=a.all_reduce,
                cpu_bind=a.cpu_bind,
            )
            if a.executor == "ray":
                from aiolm.executor.ray import RayExecutor

                ex = RayExecutor(
                    runner_cfg,
                    a.tensor_parallel_size,
                    address=a.ray_address,
                    min_cluster_cpus=a.tensor_parallel_size * a.pipeline_parallel_size * a.data_parallel_size,
                    pipeline_size=a.pipeline_parallel_size,
                    placement=a.ray_placement,
                    **kwargs,
                )
            else:
                ex = MultiprocExecutor(
                    runner_cfg, a.tensor_parallel_size, pipeline_size=a.pipeline_parallel_size, **kwargs
                )
            holder.append(ex)
        # Until start returns, only this call knows the executor: a shutdown meanwhile must
        # still stop its workers (_stop_all). One that failed to start stays here till then.
        self._starting.add(ex)
        await ex.start()
        self._starting.discard(ex)
        if incarnation and self.grammars.pool is not None:  # a replacement set, where grammars are in use
            self._prepare_worker_grammars(ex)
        return ex

    async def shutdown(self) -> None:
        if self._dead is None:
            self._dead = "engine shut down"
        stats = self.spec_decode_stats
        if stats is not None and stats.num_drafts:
            log.info("%s", stats.summary())
        await self._stop_all()
        if self._stopping is not None:
            await asyncio.gather(self._stopping, return_exceptions=True)
        self._started = False

    async def _stop_all(self) -> None:
        """Fail every stream, stop both actors, then the executor (the core's current one)."""
        if self.output is not None:
            self.output.fail_all(EngineDeadError(self._dead or "engine stopped"))
        for actor in (self.core, self.output):
            if actor is not None:
                await actor.stop()
        await self.grammars.close()  # kills the compile processes: quick, and first
        for ex in {id(e): e for e in (self.executor, self._executor, *self._starting) if e is not None}.values():
            try:
                await ex.shutdown()
            except Exception:  # the others must still stop
                log.exception("stopping a worker set failed")
        self._starting.clear()

    def _on_crash(self, actor: Any, error: BaseException) -> None:
        if isinstance(error, EngineDeadError):
            self._die(str(error))
        else:
            self._die(f"{actor.name} failed: {type(error).__name__}: {error}")

    def _on_worker_death(self, executor: Executor, reason: str) -> None:
        if self.core is not None and self.core.running:
            self.core.send(WorkerFailed(executor, reason))  # the core recovers, or dies trying
        else:
            self._die(reason)

    def _die(self, reason: str) -> None:
        """Fail every stream now; stop actors and workers in the background; tell listeners."""
        if self._dead is not None:
            return
        self._dead = reason
        log.error("engine is dead: %s", reason)
        if self.output is not None:
            self.output.fail_all(EngineDeadError(reason))
        self._stopping = asyncio.get_running_loop().create_task(self._stop_all(), name="engine-stop")
        for cb in self.death_callbacks:
            try:
                cb(reason)
            except Exception:
                log.exception("an engine death callback failed")

    def is_healthy(self) -> bool:
        return self.health()[0]

    def health(self) -> tuple[bool, str | None]:
        """(serving normally, why not): dead, recovering, stalled, or not started."""
        if self._dead is not None:
            return False, self._dead
        if not self._started or self.core is None or self.output is None:
            return False, "the engine is not running"
        if not (self.core.running and self.output.running):
            return False, "an engine actor stopped"
        recovering = self.recovering
        if recovering is not None:
            return False, f"recovering from a worker failure: {recovering}"
        stalled = self.stalled
        if stalled is not None:
            return False, f"stalled: {stalled}"
        return True, None

    @property
    def stalled(self) -> str | None:
        """Why the workers make no progress right now (a rank stopped beating), else None.
        Requests are still taken: they wait, and run once the rank beats again or the step
        time limit replaces it."""
        if self._dead is not None or self.core is None:
            return None
        return getattr(self.core.executor, "stalled", None)

    @property
    def recovering(self) -> str | None:
        """Why the workers are failed or being replaced right now, else None."""
        if self._dead is not None or self.core is None:
            return None
        if self.supervisor is not None and self.supervisor.recovering is not None:
            return self.supervisor.recovering
        if not self.core.executor.is_alive():
            return "a worker failed; its replacement is starting"
        return None

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if not self._started:
            raise EngineDeadError("engine not started (use `async with` or `await engine.start()`)")
        if self.recovering is not None:
            raise EngineRecoveringError(
                f"the engine is replacing failed workers ({self.recovering}); retry shortly", retry_after=5.0
            )

    # -- requests -------------------------------------------------------------------

    async def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        timeout: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestState:
        """Validate and queue a request; returns its state (read it with ``stream``).

        ``timeout``: seconds from now after which the request is aborted (its blocks
        freed) and its stream raises RequestTimeoutError. ``lora_request``: the LoRA
        adapter to run it with (an engine started with ``enable_lora``).
        """
        self._check_alive()
        assert self.output is not None and self.core is not None
        if self.pooling_config is not None:
            raise ParamError(
                "model", f"{self.model_name} is served with --runner pooling: it embeds, scores and classifies only"
            )
        check_request_args(request_id, priority, timeout)
        params = self.inputs.params(params)
        n = params.n
        _sibling_seed(params.seed, n - 1)  # sequence i samples with seed + i: refused before anything is registered
        if params.kv_transfer_params is not None:
            self._check_kv_transfer(params.kv_transfer_params)
        await self.grammars.check(params.structured_outputs)  # in a compile process, cached by the grammar
        if lora_request is not None:
            await self._check_lora(lora_request)
        processed = await self.inputs.process(prompt)
        self._check_alive()
        if processed.images:
            self.scheduler.check_images(processed.images)  # a 400 now, not a failed request later
        rid = self._claim_id(request_id)
        self._admit(n)
        # Internal ids are unique per submission, so a user id reused after an abort can never
        # receive the old request's late outputs (a stale abort or token still in a mailbox).
        base = f"{rid}@{next(self._submissions)}"
        child_ids = [base] if n == 1 else [f"{base}#{i}" for i in range(n)]
        state = self.output.register(rid, processed.prompt, processed.token_ids, params, child_ids)
        reqs = []
        for i, cid in enumerate(child_ids):
            p = params if n == 1 else params.clone(n=1, seed=_sibling_seed(params.seed, i))
            ids, images = processed.token_ids, processed.images
            salt = processed.cache_salt
            reqs.append(
                Request(cid, ids, p, priority=priority, lora_request=lora_request, mm_inputs=images, cache_salt=salt)
            )
        self.stats["prompt_tokens"] += len(processed.token_ids) * n
        # n > 1: the siblings join once the first sequence's prompt is in the KV cache,
        # so they reuse its full blocks through the prefix cache instead of recomputing them.
        state.pending_siblings = reqs[1:]
        state.core_request = reqs[0]
        if timeout is not None:
            state.expiry = asyncio.get_running_loop().call_later(timeout, self._expire, state, timeout)
        self.core.send(AddRequests(reqs[:1]))
        return state

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        truncate_prompt_tokens: int | None = None,
        timeout: float | None = None,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """Pool one prompt (a string, token ids, ``{"prompt_token_ids": ..., "token_type_ids":
        ...}``) on a pooling model: yields one PoolingRequestOutput, its embedding (cut to
        ``dimensions`` and normalised as asked) or its classifier's logits.
        ``truncate_prompt_tokens``: keep the first N tokens (-1: max_model_len) instead of
        refusing a longer prompt. Leaving early aborts the request, as in ``generate``."""
        state = await self._add_pooling_request(
            prompt, pooling_params, request_id, priority, truncate_prompt_tokens, timeout
        )
        async with contextlib.aclosing(self.stream(state)) as outputs:
            async for _ in outputs:
                pass
        if state.pooled is None:  # finished without a vector: aborted or failed
            raise state.error or RequestError(f"request {state.req_id!r} ended without a pooled result")
        yield PoolingRequestOutput(state.req_id, state.prompt_ids, PoolingOutput(state.pooled), True, state.prompt)

    async def _add_pooling_request(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams | None,
        request_id: str | None,
        priority: int,
        truncate: int | None,
        timeout: float | None,
    ) -> RequestState:
        self._check_alive()
        assert self.output is not None and self.core is not None
        if self.pooling_config is None:
            raise ParamError(
                "model",
                f"{self.model_name} is served for generation; pooling needs a server started with --runner pooling",
            )
        check_request_args(request_id, priority, timeout)
        params = self._pooling_params(pooling_params if pooling_params is not None else PoolingParams())
        processed, types = await self.inputs.process_pooling(prompt, truncate, self.max_pooling_tokens)
        if types is not None and params.token_type_ids is not None:
            raise ParamError("token_type_ids", "give them once: with the prompt or in the pooling params")
        types = types if types is not None else params.token_type_ids
        type_vocab = getattr(self.source.config, "type_vocab_size", 0)
        if types is not None and not type_vocab and isinstance(types, list) and not any(types):
            types = None  # all segment 0, as a decoder's tokenizer may give a pair: nothing to say
        if types is not None:  # a bad one failed in the workers' embedding lookup (or forward)
            types = check_token_types(types, len(processed.token_ids), type_vocab)
        params = msgspec.structs.replace(params, token_type_ids=types)
        self._check_alive()
        rid = self._claim_id(request_id)
        self._admit(1)
        cid = f"{rid}@{next(self._submissions)}"
        sp = SamplingParams(max_tokens=1, output_kind=OutputKind.FINAL_ONLY)
        state = self.output.register(rid, processed.prompt, processed.token_ids, sp, [cid])
        state.core_request = req = Request(cid, processed.token_ids, sp, priority=priority, pooling_params=params)
        if timeout is not None:
            state.expiry = asyncio.get_running_loop().call_later(timeout, self._expire, state, timeout)
        self.stats["prompt_tokens"] += len(processed.token_ids)
        self.core.send(AddRequests([req]))
        return state

    def _claim_id(self, request_id: str | None) -> str:
        """The request's id: the caller's, unless a live request holds it, else a new one."""
        assert self.output is not None
        rid = request_id if request_id is not None else self.inputs.new_request_id()
        if rid in self.output.requests:
            raise ParamError("request_id", f"request id {rid!r} is already in use by a live request")
        return rid

    def _pooling_params(self, p: PoolingParams) -> PoolingParams:
        """``p`` checked against the model: its task, and ``dimensions`` (matryoshka models only)."""
        pc = self.pooling_config
        assert pc is not None
        if not isinstance(p, PoolingParams):
            raise ParamError("pooling_params", f"must be PoolingParams, got {type(p).__name__}")
        if pc.is_classifier and p.task == "embed":
            raise ParamError("model", f"{self.model_name} is a classifier: it classifies and scores, not embeds")
        if not pc.is_classifier and p.task != "embed":
            raise ParamError(
                "model", f"{self.model_name} is an embedding model: it cannot {p.task} (no classifier head)"
            )
        if p.dimensions is not None:
            dims = pc.matryoshka_dimensions
            if dims is None:
                raise ParamError(
                    "dimensions", f"{self.model_name} does not support matryoshka representation: leave dimensions out"
                )
            if (dims and p.dimensions not in dims) or p.dimensions > self.hidden_size:
                allowed = ", ".join(map(str, dims)) if dims else f"1 to {self.hidden_size}"
                raise ParamError("dimensions", f"{p.dimensions} is not a size this model offers ({allowed})")
        return p

    @property
    def hidden_size(self) -> int:
        """The size of the model's embeddings (before any ``dimensions`` cut)."""
        return self.source.config.hidden_size

    @property
    def max_pooling_tokens(self) -> int:
        """The longest prompt a pooling request may have: the context, and for an encoder
        (whose prompt runs whole in one step) the step's token budget too."""
        n = self.max_model_len
        if self.source.config.encoder_only:
            n = min(n, self.args.max_num_batched_tokens)
        return n

    def tokenize_pooled(self, text: str, truncate_prompt_tokens: int | None = None) -> dict[str, Any]:
        """A pooling input's token ids as ``encode`` takes them, tokenized now (a caller with
        many texts tokenizes them together, off the event loop)."""
        truncate = resolve_truncation(truncate_prompt_tokens, self.max_pooling_tokens)
        return {"prompt_token_ids": self.inputs.pooled_ids(text, truncate)}

    def tokenize_pair(self, text: str, text_pair: str, truncate_prompt_tokens: int | None = None) -> dict[str, Any]:
        """A cross-encoder's input for (``text``, ``text_pair``): the pair's token ids and,
        where the tokenizer has segments, their token type ids."""
        return self.inputs.encode_pair(text, text_pair, truncate_prompt_tokens, self.max_pooling_tokens)

    def _admit(self, n: int) -> None:
        """Refuse ``n`` more sequences when running seats plus the waiting bound are taken.

        Counted over live sequences (registered, not finished), so requests still in the
        core's mailbox count too; no await separates this check from the registration.
        """
        assert self.output is not None
        a = self.args
        if a.max_waiting_requests is None:
            return
        live = len(self.output.children)
        room = a.max_num_seqs + a.max_waiting_requests - live
        if n > room:
            # Retry when the sequences queued ahead (and these n) would have seats.
            running = len(self.scheduler.running) or a.max_num_seqs
            wait = self.drain.seconds_for(live + n - running, running)
            raise EngineBusyError(
                f"the engine is full: {live} sequences live, room for "
                f"{a.max_num_seqs} running and {a.max_waiting_requests} waiting "
                f"(--max-waiting-requests); retry in about {wait:.0f} s",
                retry_after=wait,
            )

    def _expire(self, state: RequestState, timeout: float) -> None:
        if self.output is None or self.output.requests.get(state.req_id) is not state:
            return  # finished or aborted meanwhile
        children = self.output.expire(
            state.req_id,
            RequestTimeoutError(f"request {state.req_id!r} ran past its timeout of {timeout:g} s and was aborted"),
        )
        if children and self.core is not None:
            self.core.send(AbortRequests(children))

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        timeout: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        state = await self.add_request(prompt, params, request_id, priority, timeout, lora_request)
        # aclosing: when the caller leaves early, the inner stream (and its abort) is closed
        # right here, not later by the garbage collector's async-generator finaliser.
        async with contextlib.aclosing(self.stream(state)) as outputs:
            async for out in outputs:
                yield out

    async def stream(self, state: RequestState) -> AsyncGenerator[RequestOutput, None]:
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

    # -- LoRA adapters --------------------------------------------------------------------

    def _lora_registry(self, param: str = "lora_request") -> LoRARegistry:
        if self.loras is None:
            raise ParamError(param, f"{self.model_name} is served without LoRA adapters (start it with --enable-lora)")
        return self.loras

    async def _check_lora(self, lora: LoRARequest) -> None:
        if not isinstance(lora, LoRARequest):
            raise ParamError("lora_request", f"must be a LoRARequest, got {type(lora).__name__}")
        await self._lora_registry().check(lora)

    async def add_lora(self, lora: LoRARequest, replace: bool = False) -> None:
        """Serve ``lora`` under its name from now on (requests pick it by that name); its
        folder is checked first (ParamError naming the problem). ``replace``: in place of an
        adapter served under that name (vLLM's load_inplace); requests already in keep theirs."""
        registry = self._lora_registry("lora_name")
        await self._check_lora(lora)
        registry.add(lora, replace)

    async def load_lora(self, name: str, path: str, replace: bool = False) -> LoRARequest:
        """``add_lora`` for an adapter given by name and folder, with a fresh id."""
        lora = self._lora_registry("lora_name").new_request(name, path, replace)
        await self.add_lora(lora, replace)
        return lora

    async def remove_lora(self, name: str) -> LoRARequest:
        """Stop serving adapter ``name``: new requests naming it are refused; those already
        in finish with it. UnknownAdapterError if none is loaded under that name."""
        return self._lora_registry("lora_name").remove(name)

    def lora(self, name: str) -> LoRARequest | None:
        """The served adapter named ``name``, or None."""
        return self.loras.get(name) if self.loras is not None else None

    def list_loras(self) -> list[LoRARequest]:
        return list(self.loras.served.values()) if self.loras is not None else []

    def _add_siblings(self, reqs: list[Request]) -> None:
        if self.core is not None:
            self.core.send(AddRequests(reqs))

    def _abort_children(self, child_ids: list[str]) -> None:
        if self.core is not None:
            self.core.send(AbortRequests(child_ids))

    def _on_finish(self, state: RequestState) -> None:
        self.stats["requests_finished"] += 1
        seated = getattr(state.core_request, "scheduled_time", None)
        if seated is not None and state.finish_time is not None:
            self.drain.departed(state.finish_time - seated, len(state.seqs))
        if state.expiry is not None:
            state.expiry.cancel()
            state.expiry = None

    # -- introspection ----------------------------------------------------------------

    @property
    def metrics_registry(self) -> Any:
        """This engine's prometheus_client CollectorRegistry (not the process-wide default)."""
        return self.metrics.registry

    def kv_cache_usage(self) -> float:
        return self.scheduler.kv_cache_usage if self._started and self._dead is None else 0.0

    @property
    def spec_decode_stats(self) -> SpecDecodeStats | None:
        """Speculative decoding's running totals (drafts, accepted per position), or None
        when it is off; read by metrics and benchmarks."""
        sched = getattr(self, "scheduler", None)
        return sched.spec_decode_stats if sched is not None else None

    @property
    def images_encoded(self) -> int:
        """Images the vision tower has encoded since the engine started: an image that the
        encoder cache still holds (the same pixels in a later request, or a later chunk of
        the same prompt) is not encoded again. Also in /metrics as ``encoder_images``."""
        sched = getattr(self, "scheduler", None)
        return sched.encoder_cache.encoded if sched is not None else 0

    async def expert_load(self) -> list[list[int]]:
        """Tokens routed to each expert of each layer of experts since the engine started
        ([sparse layer][expert], every rank's experts; empty for a dense model): the input
        an expert-placement balancer needs. Also in /metrics as ``moe_expert_tokens``."""
        executor = self.executor
        if self._started and self._dead is None and executor is not None and self.expert_tokens:
            ranks = await executor.collective_rpc("take_expert_counts")
            # the first rank of each pipeline stage: that stage's layers, in layer order
            fresh = [row for rows in ranks[:: self.args.tensor_parallel_size] for row in rows]
            for row, add in zip(self.expert_tokens, fresh):
                for e, n in enumerate(add):
                    row[e] += n
        return [list(row) for row in self.expert_tokens]

    def num_requests(self) -> tuple[int, int]:
        """(running, waiting) in the scheduler; nothing runs in a dead engine."""
        if not self._started or self._dead is not None:
            return 0, 0
        return self.scheduler.num_running, self.scheduler.num_waiting

    # -- what servers and tools may use: the model's tokenizer and chat template -------

    @property
    def vocab_size(self) -> int:
        return self.inputs.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.inputs.eos_token_ids

    @functools.cached_property
    def sampling_defaults(self) -> dict[str, Any]:
        """What a request's sampling fields default to when it leaves them out: the model's
        generation_config.json recommendations (--generation-config auto), else nothing.
        Read once: every request asks."""
        if self.args.generation_config != "auto":
            return {}
        return sampling_defaults(self.generation_config)

    @property
    def generation_config(self) -> dict[str, Any]:
        """The model's generation_config.json (sampling defaults), empty when it has none."""
        return dict(self.source.generation_config)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.inputs.encode(text, add_special_tokens)

    def prompt_too_long(self, text: str) -> str | None:
        """Why ``text`` cannot fit in the context whatever its tokens (decided without tokenizing), or None."""
        return self.inputs.too_long(text)

    def clip_prompt(self, text: str, keep_end: bool) -> str:
        """``text`` without what could not reach the context, from its start (``keep_end``) or end."""
        return self.inputs.clip(text, keep_end)

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        """The prompt text of ``messages`` through the model's chat template (ParamError if unusable)."""
        return self.inputs.chat_prompt(messages, add_generation_prompt=add_generation_prompt, **template_kwargs)

    async def render_chat_async(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        """``render_chat``, in a thread when the conversation is large enough to stall the loop."""
        return await self.inputs.chat_prompt_async(
            messages, add_generation_prompt=add_generation_prompt, **template_kwargs
        )

    @property
    def takes_images(self) -> bool:
        return self.inputs.images is not None

    async def prompt_with_images(self, text: str, urls: list[tuple[str, str]], field: str) -> dict[str, Any]:
        """A rendered chat and its image URLs ((url, where in the request)) as a prompt
        ``add_request`` takes: the ids with each image marker expanded, and the images."""
        p = await self.inputs.with_image_urls(text, urls, field)
        return {"prompt_token_ids": p.token_ids, "prompt": p.prompt, "mm_inputs": p.images}

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """The tokenizer's own string for each id (byte-level pieces, not decoded text)."""
        return self.tokenizer.convert_ids_to_tokens(token_ids)

    def tokenizer_info(self) -> dict[str, Any]:
        """The tokenizer's configuration as JSON (aiolm/engine/tokenizer_info.py)."""
        return tokenizer_config(self.tokenizer)
