"""EngineArgs: the one definition of every engine knob, for Python and the CLI alike.

Each field carries its help text; ``add_cli_args`` turns the dataclass into argparse
flags, so ``aiolm serve --max-num-seqs`` and ``LLM(max_num_seqs=...)`` never drift.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from aiolm.executor.step_watch import StepWatch
    from aiolm.kv_transfer.config import KVTransferConfig
    from aiolm.spec_decode import SpecConfig


SERVE_MAX_WAITING = 1024  # `aiolm serve`'s --max-waiting-requests: a server bounds its queue
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # fp8 is e4m3, as in vLLM


def _f(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


class CliParser(argparse.ArgumentParser):
    """argparse with one-line errors (``aiolm serve: error: ...``), exit code 2, no usage dump,
    and each flag's default in ``--help``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _DefaultsShown)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


class _DefaultsShown(argparse.HelpFormatter):
    """Help lines that end with the flag's default, where it has one to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        shown = (
            action.option_strings
            and action.dest != "api_key"  # a secret from the environment: --help must not print it
            and default is not None
            and default is not False
            and default not in ("", argparse.SUPPRESS)
        )
        if shown and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high], the error naming the range."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            bound = f"[{low}, {high}]" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"{value} is out of range (must be {bound})")
        return value

    parse.__name__ = "integer"
    return parse


def positive(text: str) -> float:
    """An argparse type: a number > 0 (inf allowed), the error naming the value."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return value


@dataclass
class EngineArgs:
    model: str | None = _f(None, "Hugging Face model folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    runner: str = _f(
        "auto",
        "auto|generate|pooling: generate text, or pool prompts into embeddings, rerank scores and "
        "class logits (/v1/embeddings, /score, /rerank, /classify); auto: pooling for encoder-only "
        "models (BERT), sequence classifiers and sentence-transformers folders, generate otherwise",
    )
    device: str = _f("auto", "auto|cpu|cuda (auto: cuda when available)")
    gpu_memory_utilization: float = _f(0.9, "on CUDA: fraction of device memory for weights, activations and KV cache")
    dtype: str = _f(
        "auto",
        "auto|float32|bfloat16|float16 (auto: float32 on CPU, bfloat16 on CUDA; "
        "bfloat16 on CPU: bfloat16 matmuls in the decoder layers, a float16 KV cache, "
        "all else float32)",
    )
    max_model_len: int | None = _f(None, "longest sequence (prompt + output) in tokens (default: min(model, 8192))")
    max_num_seqs: int = _f(128, "most requests in one batch")
    max_num_batched_tokens: int = _f(2048, "token budget of one step (chunked prefill splits longer prompts)")
    long_prefill_token_threshold: int = _f(0, "cap on one request's tokens per step (0 = off)")
    max_step_ms: float = _f(
        500.0,
        "keep each step within about this many ms by capping its prompt tokens at what the measured "
        "step cost allows, so a long prompt does not pause every stream (0 = off; offline LLM: off "
        "unless given)",
    )
    kv_cache_memory: int = _f(1 << 30, "bytes of KV cache per worker on CPU")
    block_size: int = _f(16, "tokens per KV cache block")
    enable_prefix_caching: bool = _f(True, "reuse KV blocks of identical prompt prefixes")
    tensor_parallel_size: int = _f(
        1, "number of worker processes splitting each layer (one machine; more with --executor ray)"
    )
    pipeline_parallel_size: int = _f(
        1,
        "pipeline stages splitting the layers, each stage tensor_parallel_size worker processes; "
        "as many steps in flight as stages, so the stages run at once (CPU workers; --executor mp "
        "on one machine, or ray with stages on several)",
    )
    enable_expert_parallel: bool = _f(
        False,
        "mixture-of-experts models: place whole experts on the tensor-parallel ranks "
        "(E / N each) instead of slicing every expert; attention stays tensor-parallel",
    )
    attention_backend: str = _f(
        "auto",
        "auto|cpu|torch|triton (auto: the platform's best: cpu kernels on CPU, triton on CUDA; torch is the reference)",
    )
    kv_cache_dtype: str = _f(
        "auto",
        "auto|fp8|fp8_e4m3: what the KV cache holds (auto: the platform's choice for --dtype; fp8: float8 e4m3, "
        "with the checkpoint's per-layer k_scale/v_scale or 1.0; half the bytes of float16)",
    )
    enforce_eager: bool = _f(False, "on CUDA: never replay CUDA graphs (every step runs eagerly)")
    max_cudagraph_size: int = _f(256, "on CUDA: largest decode batch captured as a CUDA graph")
    all_reduce: str = _f(
        "auto",
        "all-reduce between tensor-parallel ranks: auto (CPU: shm, CUDA: symm_mem "
        "where valid), shm, gloo, symm_mem, nccl; env AIOLM_ALL_REDUCE overrides auto",
    )
    cpu_bind: str = _f(
        "auto",
        "CPU cores of tensor-parallel ranks: auto (disjoint blocks of the allowed "
        "cores), none, or one cpu list per rank like 0-3;4-7",
    )
    executor: str = _f(
        "mp",
        "mp (worker processes through shared memory), ray (Ray actors, across "
        "machines: docs/distributed.md) or local (in process, for debugging)",
    )
    distributed_executor_backend: str | None = _f(
        None, "vLLM's name for --executor: mp or ray; when given, it sets --executor"
    )
    ray_address: str | None = _f(
        None, "with --executor ray: the Ray cluster to join (default: RAY_ADDRESS, else a private local cluster)"
    )
    ray_placement: str = _f(
        "auto",
        "with --executor ray: how ranks are placed on the cluster's nodes: pack (as few nodes as "
        "fit), spread (over as many as can), strict-pack, strict-spread; a pipeline's stages are "
        "placed, each with its tensor-parallel ranks together on one node (auto: spread stages, "
        "pack ranks)",
    )
    data_parallel_size: int = _f(
        1,
        "engine replicas, each an engine process with its own workers (and tensor-parallel "
        "group), behind one API; requests are routed by load and prefix-cache affinity",
    )
    data_parallel_backend: str = _f(
        "mp",
        "where data-parallel replicas run: mp (processes on this machine) or ray (Ray actors, "
        "placed on the cluster's nodes by --ray-placement; each runs its workers on its node)",
    )
    num_threads: int = _f(0, "torch threads per worker (0 = torch default)")
    seed: int = _f(0, "seed of the default random generator for unseeded sampling")
    scheduling_policy: str = _f("fcfs", "fcfs or priority")
    generation_config: str = _f(
        "auto",
        "auto: a request's temperature, top_p, top_k, min_p and repetition_penalty default to the "
        "model's generation_config.json, as vLLM's do; vllm: to the API's own defaults",
    )
    served_model_name: str | None = _f(None, "model name reported by the API (default: the model's name)")
    chat_template: str | None = _f(
        None, "a chat template in place of the model's own: the path of a file holding it, or its Jinja text"
    )
    max_logprobs: int = _f(
        20, "largest top-logprobs count a request may ask for; -1: no bound, and -1 asks for the whole vocabulary"
    )
    structured_outputs_backend: str = _f(
        "xgrammar",
        "xgrammar (JSON schema, regex, choice and EBNF outputs) or none (requests asking for them are refused)",
    )
    structured_outputs_compile_timeout: float = _f(
        30.0,
        "seconds a request's grammar (JSON schema, regex, choice, "
        "EBNF) may take to compile; past it the compile is "
        "stopped and the request refused (HTTP 400), and so is "
        "every later request with that grammar",
    )
    speculative: str | None = _f(
        None,
        "speculative decoding: ngram (prompt lookup: drafts copied from what followed "
        "an earlier occurrence of the sequence's last tokens, verified in one "
        "forward pass; greedy output unchanged) or None (off)",
    )
    num_speculative_tokens: int = _f(4, "with --speculative: most draft tokens verified per request and step")
    prompt_lookup_min: int = _f(2, "with --speculative ngram: shortest suffix match that yields drafts")
    prompt_lookup_max: int = _f(5, "with --speculative ngram: longest suffix match tried")
    metrics_prefix: str = _f(
        "aiolm",
        "prefix of the Prometheus metric names (<prefix>:num_requests_running, ...); "
        "vllm gives vLLM's names, so its Grafana dashboards work unchanged",
    )
    async_scheduling: bool | None = _f(
        None,
        "overlap scheduling: schedule the next step while the workers run this "
        "one (at most two steps in flight); greedy and seeded outputs are the same "
        "token for token. Default: on, except with speculative decoding, pipeline "
        "parallelism, pooling models and a prefill instance's KV producer; "
        "--no-async-scheduling turns it off",
    )
    log_step_costs: bool = _f(
        False, "log per step the time spent scheduling, executing (IPC + forward + sampling) and updating"
    )
    worker_recovery: bool = _f(
        True,
        "restart dead, hung or failing workers and recompute in-flight requests "
        "(--no-worker-recovery: the engine fails fast instead)",
    )
    max_worker_restarts: int = _f(3, "most worker restarts within --worker-restart-window before the engine gives up")
    worker_restart_window: float = _f(600.0, "seconds over which --max-worker-restarts is counted")
    step_timeout: float = _f(
        0.0,
        "the floor of a step's time limit in seconds: a step may take this plus 10x "
        "what the measured rate predicts for its tokens before its workers count as "
        "hung and are replaced; steps before the first measured one get 600 "
        "(0 = 30 on CPU, 60 on CUDA)",
    )
    enable_lora: bool = _f(False, "serve LoRA adapters over the model (aiolm/lora/): each request picks one by name")
    lora_modules: list[str] | None = _f(
        None,
        "with --enable-lora: adapters served from the start, each name=path or a JSON object "
        '{"name": ..., "path": ...}; clients pick one by passing its name as the model',
    )
    max_loras: int = _f(1, "with --enable-lora: most distinct adapters in one batch (the model's adapter slots)")
    max_lora_rank: int = _f(16, "with --enable-lora: largest adapter rank served (the slots' size)")
    max_cpu_loras: int | None = _f(
        None, "with --enable-lora: adapters each worker keeps loaded in host memory (default: --max-loras)"
    )
    kv_transfer_config: str | None = _f(
        None,
        "a KV connector, as a JSON object spelled as vLLM spells it: "
        '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": '
        '{"cpu_bytes": N, "disk_path": DIR, "disk_bytes": N}} keeps prefix blocks the cache evicts in '
        "host memory and a size-capped directory, and loads them back on a later prefix hit (README)",
    )
    limit_mm_per_prompt: str = _f(
        "image=4", "vision-language models: most images in one prompt, as image=N (more is a 400)"
    )
    max_num_encoder_input_tokens: int = _f(
        0,
        "vision-language models: image embeddings encoded in one step (0: --max-num-batched-tokens); "
        "an image's placeholders wait for a step with room",
    )
    allowed_media_domains: list[str] | None = _f(
        None, "hosts whose http(s) image URLs the server fetches (and their subdomains); None: any host"
    )
    allowed_local_media_path: str | None = _f(
        None, "a folder whose files file:// image URLs may name; None: file URLs are refused"
    )
    max_image_pixels: int = _f(
        20_000_000, "largest image (width x height) a request may send; larger is a 400, before decoding"
    )
    media_fetch_timeout: float = _f(10.0, "seconds an http(s) image URL may take to fetch")
    max_waiting_requests: int | None = _f(
        None,
        "sequences that may wait beyond the --max-num-seqs running ones; "
        "more are refused (EngineBusyError, HTTP 429). None: no bound "
        "(the Python default, so LLM.generate takes any batch); "
        f"`aiolm serve` defaults to {SERVE_MAX_WAITING}",
    )

    def __post_init__(self) -> None:
        if self.distributed_executor_backend is not None:
            if self.distributed_executor_backend not in ("mp", "ray"):
                raise ValueError(
                    f"distributed_executor_backend: {self.distributed_executor_backend!r} is not "
                    f"supported; supported: mp, ray"
                )
            self.executor = self.distributed_executor_backend
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"runner: {self.runner!r} is not supported; supported: auto, generate, pooling")
        if self.executor not in ("mp", "ray", "local"):
            raise ValueError(f"executor: {self.executor!r} is not supported; supported: mp, ray, local")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        self._check_pipeline()
        from aiolm.distributed.communicator import CHOICES

        if self.all_reduce not in CHOICES:
            raise ValueError(f"all_reduce: {self.all_reduce!r} is not supported; supported: {', '.join(CHOICES)}")
        if self.cpu_bind not in ("auto", "none"):
            from aiolm.distributed.cpu_bind import parse_cpu_bind

            parse_cpu_bind(self.cpu_bind, self.tensor_parallel_size * self.pipeline_parallel_size)
        if self.executor == "local" and self.tensor_parallel_size != 1:
            raise ValueError("executor 'local' runs one rank; use executor 'mp' for tensor_parallel_size > 1")
        from aiolm.executor.placement import placement_strategy

        placement_strategy(self.ray_placement, self.pipeline_parallel_size)  # raises on an unknown one
        self._check_data_parallel()
        on_ray = self.executor == "ray" or self.data_parallel_backend == "ray"
        if self.ray_placement != "auto" and not on_ray:
            raise ValueError(
                "ray_placement is only used with executor 'ray' (--distributed-executor-backend ray) "
                "or data_parallel_backend 'ray'"
            )
        if self.ray_address is not None and not on_ray:
            raise ValueError(
                "ray_address is only used with executor 'ray' (--distributed-executor-backend ray) "
                "or data_parallel_backend 'ray'"
            )
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device: {self.device!r} is not supported; supported: auto, cpu, cuda")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        # "not >=" rather than "<": NaN is refused too (it compared false, and a NaN step
        # timeout turned the hung-worker watchdog off)
        if not (self.max_worker_restarts >= 0 and self.worker_restart_window > 0):
            raise ValueError("max_worker_restarts must be >= 0 and worker_restart_window > 0")
        if not self.step_timeout >= 0:
            raise ValueError(f"step_timeout must be >= 0, got {self.step_timeout}")
        if not self.media_fetch_timeout > 0:  # nan included
            raise ValueError(
                f"media_fetch_timeout must be a positive number of seconds, got {self.media_fetch_timeout}"
            )
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        if self.structured_outputs_backend not in ("xgrammar", "none"):
            raise ValueError(
                f"structured_outputs_backend: {self.structured_outputs_backend!r}; supported: xgrammar, none"
            )
        if not 0 < self.structured_outputs_compile_timeout < float("inf"):
            raise ValueError(
                f"structured_outputs_compile_timeout must be a positive number of seconds, "
                f"got {self.structured_outputs_compile_timeout}"
            )
        self.spec_config()  # raises on a bad combination
        kv_transfer = self.kv_transfer()
        if kv_transfer is not None:
            if kv_transfer.kv_connector == "OffloadingConnector" and not self.enable_prefix_caching:
                raise ValueError("kv_transfer_config: the OffloadingConnector needs prefix caching on")
            if self.runner == "pooling":
                raise ValueError("kv_transfer_config: pooling models keep no KV cache to move")
        self.lora_specs()  # raises on a bad --lora-modules entry
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {self.max_loras}, {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if self.enable_lora and self.runner == "pooling":
            raise ValueError(
                "--enable-lora serves adapters of generating models; it cannot be used with --runner pooling"
            )
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs --enable-lora")
        if self.speculative is None:
            changed = [
                name
                for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")
                if getattr(self, name) != type(self).__dataclass_fields__[name].default
            ]
            if changed:
                raise ValueError(f"{', '.join(changed)} {'needs' if len(changed) == 1 else 'need'} --speculative")
        if not self.seed < 2**63:
            raise ValueError(f"seed must be < 2**63, got {self.seed}")
        from aiolm.metrics import check_prefix

        check_prefix(self.metrics_prefix)
        if self.generation_config not in ("auto", "vllm"):
            raise ValueError(f"generation_config: {self.generation_config!r}; supported: auto, vllm")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy: {self.scheduling_policy!r}; supported: fcfs, priority")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype: {self.kv_cache_dtype!r} is not supported; supported: {', '.join(KV_CACHE_DTYPES)}"
            )
        if self.attention_backend not in ("auto", "cpu", "torch", "triton"):
            raise ValueError(
                f"attention_backend: {self.attention_backend!r} is not supported; supported: auto, cpu, torch, triton"
            )
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype: {self.dtype!r} is not supported; supported: auto, float32, bfloat16, float16")
        if self.async_scheduling and self.speculative is not None:
            # Drafts come from the request's latest tokens, which overlap has not seen yet.
            raise ValueError(
                "async_scheduling cannot be combined with speculative decoding (--speculative); turn one of them off"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(
                f"max_model_len must be >= 2 (a prompt token and an output token), got {self.max_model_len}"
            )
        self.max_images()  # raises on a bad --limit-mm-per-prompt
        for name, low in (
            ("max_num_encoder_input_tokens", 0),
            ("max_image_pixels", 1),
            ("max_cudagraph_size", 1),
            ("max_num_seqs", 1),
            ("max_num_batched_tokens", 1),
            ("kv_cache_memory", 1),
            ("block_size", 1),
            ("long_prefill_token_threshold", 0),
            ("max_step_ms", 0),
            ("num_threads", 0),
            ("max_logprobs", -1),
            ("seed", 0),
        ):
            if not getattr(self, name) >= low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")

    def _check_pipeline(self) -> None:
        """What pipeline parallelism runs with today; the rest is refused by name."""
        pp = self.pipeline_parallel_size
        if pp < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {pp}")
        if pp == 1:
            return
        why = None
        if self.executor == "local":
            why = "runs stages in worker processes: --executor mp (one machine) or ray"
        elif self.device.startswith("cuda"):
            why = "runs on CPU workers for now (--device cpu)"
        elif self.async_scheduling:
            why = "keeps one step in flight per stage by itself; leave --async-scheduling off"
        elif self.speculative is not None:
            why = "cannot be combined with speculative decoding (--speculative) yet"
        elif self.enable_lora:
            why = "cannot serve LoRA adapters (--enable-lora) yet"
        elif self.kv_transfer_config is not None:
            why = "cannot move KV between instances or tiers (--kv-transfer-config) yet"
        elif self.runner == "pooling":
            why = "runs generating models; pooling models are small enough for one stage"
        if why is not None:
            raise ValueError(f"pipeline_parallel_size {pp} {why}")

    def _check_data_parallel(self) -> None:
        if self.data_parallel_backend not in ("mp", "ray"):
            raise ValueError(
                f"data_parallel_backend: {self.data_parallel_backend!r} is not supported; supported: mp, ray"
            )
        if self.data_parallel_backend == "ray" and self.executor == "ray":
            raise ValueError(
                "data_parallel_backend 'ray' places each replica on one node and runs its workers there "
                "as processes: leave --distributed-executor-backend at mp"
            )

    def replica(self) -> EngineArgs:
        """The arguments of one of ``data_parallel_size`` replicas (each an engine of its own)."""
        return dataclasses.replace(self, data_parallel_size=1)

    def max_images(self) -> int:
        """--limit-mm-per-prompt's image count (image=N, or vLLM's JSON {"image": N})."""
        text = self.limit_mm_per_prompt.strip()
        try:
            limits = json.loads(text) if text.startswith("{") else dict([text.split("=", 1)])
            n = int(limits.pop("image"))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"limit_mm_per_prompt: {text!r} is not image=N") from e
        if limits:
            raise ValueError(f"limit_mm_per_prompt: only images are supported, got {sorted(limits)}")
        if n < 0:
            raise ValueError(f"limit_mm_per_prompt: image={n} must be >= 0")
        return n

    def overlap_scheduling(self, pooling: bool) -> bool:
        """Whether steps overlap (``async_scheduling``): as asked, else wherever it can run.
        A pooling step samples nothing, so it has no token to overlap on. A prefill instance
        (a TcpConnector producer) runs prompt-sized steps that overlap gains nothing on, and
        would start serving a finished prompt's blocks only after the step in flight, while
        its consumer already asks for them."""
        if pooling:
            return False
        if self.async_scheduling is not None:
            return self.async_scheduling
        kv = self.kv_transfer()
        if kv is not None and kv.kv_connector == "TcpConnector" and kv.produces:
            return False
        return self.speculative is None and self.pipeline_parallel_size == 1

    def spec_config(self) -> SpecConfig | None:
        """The speculative-decoding settings, or None when ``speculative`` is off."""
        if self.speculative is None:
            return None
        from aiolm.spec_decode import SpecConfig

        return SpecConfig(
            method=self.speculative,
            num_speculative_tokens=self.num_speculative_tokens,
            prompt_lookup_min=self.prompt_lookup_min,
            prompt_lookup_max=self.prompt_lookup_max,
        )

    def kv_transfer(self) -> KVTransferConfig | None:
        """The parsed ``kv_transfer_config`` (raises ValueError naming a bad key)."""
        from aiolm.kv_transfer.config import parse_kv_transfer_config

        return parse_kv_transfer_config(self.kv_transfer_config)

    def lora_specs(self) -> list[tuple[str, str]]:
        """(name, path) of each ``lora_modules`` entry: ``name=path`` or a JSON object with
        ``name`` and ``path`` (vLLM's two spellings)."""
        out = []
        for spec in self.lora_modules or []:
            if spec.lstrip().startswith("{"):
                try:
                    d = json.loads(spec)
                    name, path = d["name"], d["path"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise ValueError(f"lora_modules: {spec!r} is not a JSON object with 'name' and 'path'") from None
            else:
                name, sep, path = spec.partition("=")
                if not sep:
                    raise ValueError(f"lora_modules: {spec!r} is not name=path")
            if not isinstance(name, str) or not isinstance(path, str) or not name.strip() or not path.strip():
                raise ValueError(f"lora_modules: {spec!r} needs a non-empty name and path")
            out.append((name.strip(), path.strip()))
        names = [n for n, _ in out]
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules: a name is given twice in {names}")
        return out

    def resolved_device(self) -> str:
        """The device to run on; a clear error when CUDA is asked for and there is none.
        Asked without importing torch (aiolm/cuda_probe.py): the engine process runs no model."""
        from aiolm import cuda_probe

        if self.device == "cpu":
            return "cpu"
        cuda = cuda_probe.torch_cuda_build() and cuda_probe.gpu_visible()
        if self.device == "auto":
            return "cuda" if cuda else "cpu"
        if self.device.startswith("cuda") and not cuda:
            raise ValueError(
                f"device {self.device!r}: torch {cuda_probe.torch_version()} sees no CUDA device "
                f"({'a CPU-only build' if not cuda_probe.torch_cuda_build() else 'no GPU or driver found'}); "
                f"use --device cpu"
            )
        return self.device

    def step_watch(self) -> StepWatch:
        """The step time limits (executor/step_watch.py) these flags ask for."""
        from aiolm.executor.step_watch import StepWatch

        floor = self.step_timeout or (60.0 if self.resolved_device().startswith("cuda") else 30.0)
        return StepWatch(floor, unmeasured_s=600.0)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            help_text = f.metadata.get("help", "")
            if f.type in ("bool", bool, "bool | None"):
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
            elif str(f.type) == "list[str] | None":
                parser.add_argument(flag, nargs="+", default=f.default, help=help_text)
            else:
                typ = {"int": int, "int | None": int, "float": float}.get(str(f.type), str)
                parser.add_argument(flag, type=typ, default=f.default, help=help_text)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})


@dataclass(frozen=True)
class RunnerConfig:
    """What a worker needs to build its model runner: small and picklable, so the engine
    process can send it without importing anything of the model stack."""

    model: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    # The first GPU of this engine's ranks under a plain "cuda": rank r runs on cuda:<offset + r>, so
    # data-parallel replicas (each tensor_parallel_size ranks) land on disjoint GPUs of the node.
    device_offset: int = 0
    attention_backend: str = "auto"
    kv_cache_dtype: str = "auto"  # or fp8 / fp8_e4m3: float8 e4m3 with per-layer scales
    enforce_eager: bool = False  # on CUDA: no graph capture
    max_cudagraph_size: int = 256
    max_num_seqs: int = 256
    max_model_len: int = 2048
    block_size: int = 16
    kv_cache_memory: int = 1 << 30  # bytes of KV cache per rank on CPU
    gpu_memory_utilization: float = 0.9  # on CUDA: fraction of the device for weights + activations + KV
    max_num_batched_tokens: int = 2048  # sizes the profiling run on CUDA
    num_threads: int = 0  # torch intra-op threads; 0 = leave torch's default
    seed: int = 0
    structured_outputs: bool = True  # the workers may build the grammar compiler (prepare_grammars)
    async_scheduling: bool = False  # overlap: append sampled tokens here, the engine sends none back
    enable_expert_parallel: bool = False  # layers of experts: whole experts per rank
    runner: str = "generate"  # or "pooling": prompts are pooled into vectors, nothing is sampled
    # LoRA (--enable-lora): adapter slots in the model (0: built without LoRA), their largest
    # rank, and how many loaded adapters a worker keeps in host memory beyond the slots
    max_loras: int = 0
    max_lora_rank: int = 16
    max_cpu_loras: int = 0
    # The KV connector (--kv-transfer-config) and the fingerprint of this engine's KV layout
    # (aiolm/kv_transfer/block_files.py), which names its disk tier.
    kv_transfer: KVTransferConfig | None = None
    kv_fingerprint: str = ""

    def encode(self) -> str:
        """The config as one command-line-safe string (base64 of a pickle)."""
        return base64.b64encode(pickle.dumps(self)).decode()

    @staticmethod
    def decode(text: str) -> RunnerConfig:
        cfg = pickle.loads(base64.b64decode(text))
        if not isinstance(cfg, RunnerConfig):
            raise ValueError(f"not a RunnerConfig: {type(cfg).__name__}")
        return cfg
