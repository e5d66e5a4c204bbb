"""EngineArgs: the one definition of every engine knob, for Python and the CLI alike.

Each field carries its help text; ``add_cli_args`` turns the dataclass into argparse
flags, so ``aiolm serve --max-num-seqs`` and ``LLM(max_num_seqs=...)`` never drift.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any


def _f(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class EngineArgs:
    model: str | None = _f(None, "Hugging Face model folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    device: str = _f("auto", "auto|cpu|cuda (auto: cuda when available)")
    gpu_memory_utilization: float = _f(0.9, "on CUDA: fraction of device memory for weights, activations and KV cache")
    dtype: str = _f("auto", "auto|float32|bfloat16|float16 (auto: float32 on CPU, bfloat16 on CUDA; "
                            "bfloat16 on CPU: bfloat16 matmuls in the decoder layers, a float16 KV cache, "
                            "all else float32)")
    max_model_len: int | None = _f(None, "longest sequence (prompt + output) in tokens (default: min(model, 8192))")
    max_num_seqs: int = _f(128, "most requests in one batch")
    max_num_batched_tokens: int = _f(2048, "token budget of one step (chunked prefill splits longer prompts)")
    long_prefill_token_threshold: int = _f(0, "cap on one request's tokens per step (0 = off)")
    kv_cache_memory: int = _f(1 << 30, "bytes of KV cache per worker on CPU")
    block_size: int = _f(16, "tokens per KV cache block")
    enable_prefix_caching: bool = _f(True, "reuse KV blocks of identical prompt prefixes")
    tensor_parallel_size: int = _f(1, "number of worker processes splitting each layer (one machine)")
    all_reduce: str = _f("auto", "all-reduce between tensor-parallel ranks: auto (CPU: shm, CUDA: symm_mem "
                                 "where valid), shm, gloo, symm_mem, nccl; env AIOLM_ALL_REDUCE overrides auto")
    cpu_bind: str = _f("auto", "CPU cores of tensor-parallel ranks: auto (disjoint blocks of the allowed "
                               "cores), none, or one cpu list per rank like 0-3;4-7")
    executor: str = _f("mp", "mp (worker processes through shared memory) or local (in process, for debugging)")
    num_threads: int = _f(0, "torch threads per worker (0 = torch default)")
    seed: int = _f(0, "seed of the default random generator for unseeded sampling")
    scheduling_policy: str = _f("fcfs", "fcfs or priority")
    served_model_name: str | None = _f(None, "model name reported by the API (default: the model's name)")
    max_logprobs: int = _f(20, "largest top-logprobs count a request may ask for")
    log_step_costs: bool = _f(False, "log per step the time spent scheduling, executing (IPC + forward + sampling) and updating")

    def __post_init__(self) -> None:
        if self.executor not in ("mp", "local"):
            raise ValueError(f"executor: {self.executor!r} is not supported; supported: mp, local")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        from aiolm.distributed.communicator import CHOICES

        if self.all_reduce not in CHOICES:
            raise ValueError(f"all_reduce: {self.all_reduce!r} is not supported; supported: {', '.join(CHOICES)}")
        if self.cpu_bind not in ("auto", "none"):
            from aiolm.distributed.cpu_bind import parse_cpu_bind

            parse_cpu_bind(self.cpu_bind, self.tensor_parallel_size)
        if self.executor == "local" and self.tensor_parallel_size != 1:
            raise ValueError("executor 'local' runs one rank; use executor 'mp' for tensor_parallel_size > 1")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device: {self.device!r} is not supported; supported: auto, cpu, cuda")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy: {self.scheduling_policy!r}; supported: fcfs, priority")

    def resolved_device(self) -> str:
        if self.device == "auto":
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            help_text = f.metadata.get("help", "")
            if f.type in ("bool", bool):
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
            else:
                typ = {"int": int, "int | None": int, "float": float}.get(str(f.type), str)
                parser.add_argument(flag, type=typ, default=f.default, help=help_text)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> "EngineArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})
