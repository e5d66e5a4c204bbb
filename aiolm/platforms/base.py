"""What every platform supplies to a worker (the contract; cpu.py and cuda.py fill it in)."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch
from torch import nn

from aiolm.errors import ModelLoadError
from aiolm.kernels.ops import TorchOps

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# --attention-backend names -> "module:Class"; imported only when chosen.
ATTENTION_BACKENDS = {
    "cpu": "aiolm.attention.cpu_backend:CpuPagedAttention",
    "torch": "aiolm.attention.torch_backend:TorchAttention",
    "triton": "aiolm.attention.triton_backend:TritonAttention",
}


class Platform:
    """One kind of device. Subclasses override what differs; the defaults are plain torch."""

    name = "base"
    # The backends this platform can run, best first: 'auto' takes the first that imports.
    attention_backends: tuple[str, ...] = ("torch",)

    @property
    def device(self) -> torch.device:
        return torch.device(self.name)

    def worker_device(self, device: str, index: int) -> torch.device:
        """The device of the worker whose rank (plus its engine's device_offset) is ``index``."""
        return torch.device(device)

    def resolve_dtype(self, dtype: str) -> torch.dtype:
        """The model dtype for ``--dtype`` ('auto' is the platform's default)."""
        if dtype == "auto":
            return self.default_dtype()
        if dtype not in DTYPES:
            raise ModelLoadError(f"dtype: {dtype!r} is not supported; supported: auto, {', '.join(DTYPES)}")
        return DTYPES[dtype]

    def default_dtype(self) -> torch.dtype:
        return torch.float32

    def kv_cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The KV cache's dtype for a model built in ``dtype``."""
        return dtype

    def ops(self) -> TorchOps:
        """The implementation behind ``aiolm.kernels.ops`` on this platform."""
        return TorchOps()

    def attention_backend(self, name: str = "auto") -> type:
        """The attention class for ``--attention-backend`` (auto|cpu|torch|triton)."""
        names = self.attention_backends if name == "auto" else (name,)
        if name != "auto" and name not in ATTENTION_BACKENDS:
            raise ValueError(f"attention backend {name!r} is not known; known: auto, {', '.join(ATTENTION_BACKENDS)}")
        if name != "auto" and name not in self.attention_backends:
            raise ValueError(f"attention backend {name!r} does not run on {self.name}; "
                             f"supported here: auto, {', '.join(self.attention_backends)}")
        errors = []
        for n in names:
            module, _, cls = ATTENTION_BACKENDS[n].partition(":")
            try:
                return getattr(__import__(module, fromlist=[cls]), cls)
            except ImportError as e:  # e.g. triton not installed: try the next one
                errors.append(f"{n}: {e}")
        raise ValueError(f"no attention backend can run on {self.name}: {'; '.join(errors)}")

    def install(self) -> None:
        """Make this platform's ops the ones model layers call in this process."""
        from aiolm.kernels import ops

        ops.install(self.ops())

    def tune_worker_process(self) -> None:
        """Process-wide settings for a process that only runs steps (a worker process or a
        Ray actor, never the user's own), once its weights and KV cache are in place."""

    def prepare_model(self, model: nn.Module, source: Any, dtype: torch.dtype) -> nn.Module:
        """After loading: move to the device in ``dtype`` and lay weights out for this platform."""
        return model.to(dtype=dtype, device=self.device).eval()

    def kv_cache_bytes(self, runner: Any) -> int:
        """Bytes the KV cache of ``runner`` (a ModelRunner with its model loaded) may take."""
        return runner.cfg.kv_cache_memory

    def too_few_blocks(self, cfg: Any, num_blocks: int, min_blocks: int) -> str:
        """The error when the KV cache holds less than one max_model_len sequence; it names
        the knob that sized the cache on this platform."""
        return (f"kv_cache_memory {cfg.kv_cache_memory} bytes holds {num_blocks} blocks, fewer than one "
                f"max_model_len sequence needs ({min_blocks}); raise kv_cache_memory or lower max_model_len")

    def memory_guard(self, step: str, cfg: Any) -> ContextManager[None]:
        """Wraps a step that allocates device memory (loading the weights, the KV cache):
        where the device can run out, running out becomes a clear error naming the knob."""
        return contextlib.nullcontext()

    def make_tp_group(self, rank: int, world_size: int, port: int, all_reduce: str = "auto",
                      shm_name: str | None = None, cpu_bind: str = "auto",
                      host: str = "127.0.0.1") -> tuple[Any, str]:
        """This rank's tensor-parallel group (whose all-reduce row-parallel layers end in)
        and the name of the all-reduce behind it (aiolm/distributed/communicator.py)."""
        from aiolm.distributed.communicator import make_tp_group

        return make_tp_group(rank, world_size, self.name, all_reduce, shm_name=shm_name, port=port,
                             host=host)
