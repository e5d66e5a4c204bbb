"""What every platform answers for a worker and for the builder (the contract; cpu.py and
cuda.py fill it in).

A platform is a leaf: it knows its device, its dtypes, its memory, its tensor-parallel
group, and which ops, attention backends and quant method it runs best, each named in
its own registry (aiolm/kernels, aiolm/attention/registry.py, aiolm/quant). It never
sees a model: the builder (aiolm/model/registry.py) asks it for those choices and hands
them to the model it constructs. This base class is the torch reference platform: plain
torch ops, the torch attention backend and dense weights, on any device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from aiolm.attention.registry import BACKENDS, backend_class
from aiolm.errors import ModelLoadError
from aiolm.kernels.ops import TorchOps
from aiolm.quant import QuantConfig, quant_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Platform:
    """One kind of device. Subclasses override what differs; the defaults are plain torch."""

    name = "torch"
    # The backends this platform can run, best first: 'auto' takes the first that imports.
    attention_backends: tuple[str, ...] = ("torch",)
    # Whether the worker sizes the KV cache by profiling the largest step on this device
    # (aiolm/worker/kv_cache_size.py says which memory questions such a platform answers)
    # rather than from kv_cache_memory.
    profiles_memory = False

    def __init__(self, device: torch.device | str | None = None) -> None:
        self._device = torch.device(device if device is not None else self.name)

    @property
    def device(self) -> torch.device:
        return self._device

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

    def activation_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a model built in ``dtype`` keeps its weights and activations in (the
        quant method may multiply in another)."""
        return dtype

    def kv_cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The KV cache's dtype for a model built in ``dtype``."""
        return dtype

    def ops(self) -> TorchOps:
        """The ops the layers of a model built here call."""
        return TorchOps()

    def attention_backend(self, name: str = "auto") -> type:
        """The attention class for ``--attention-backend`` (auto or a name in attention/registry.py)."""
        names = self.attention_backends if name == "auto" else (name,)
        if name != "auto" and name not in BACKENDS:
            raise ValueError(f"attention backend {name!r} is not known; known: auto, {', '.join(BACKENDS)}")
        if name != "auto" and name not in self.attention_backends:
            raise ValueError(
                f"attention backend {name!r} does not run on {self.name}; "
                f"supported here: auto, {', '.join(self.attention_backends)}"
            )
        errors = []
        for n in names:
            try:
                return backend_class(n)
            except ImportError as e:  # e.g. triton not installed: try the next one
                errors.append(f"{n}: {e}")
        raise ValueError(f"no attention backend can run on {self.name}: {'; '.join(errors)}")

    def quant_config(
        self, dtype: torch.dtype, model_config: Any = None, checkpoint: Any = None, tp_size: int = 1
    ) -> QuantConfig:
        """The linear methods of a model built in ``dtype`` from ``checkpoint`` (its file or
        folder, a Path) on ``tp_size`` ranks: dense weights here."""
        return quant_config("dense")

    def lora_kernel(self) -> Callable[..., None]:
        """What adds each row's LoRA adapter to a layer's output (aiolm/lora/layers.py): the
        torch loop over slots here."""
        from aiolm.kernels.lora_reference import lora_reference

        return lora_reference

    def tune_worker_process(self) -> None:
        """Process-wide settings for a process that only runs steps (a worker process or a
        Ray actor, never the user's own), once its weights and KV cache are in place."""

    def memory_guard(self, step: str, cfg: Any) -> AbstractContextManager[None]:
        """Wraps a step that allocates device memory (loading the weights, the KV cache):
        where the device can run out, running out becomes a clear error naming the knob."""
        return contextlib.nullcontext()

    def pin_worker(self, rank: int, world_size: int, cpu_bind: str = "auto") -> None:
        """Keep rank ``rank`` of the engine's ``world_size`` worker processes on its own share
        of the machine (``cpu_bind``: EngineArgs.cpu_bind); nothing to do by default."""

    def make_tp_group(
        self,
        rank: int,
        world_size: int,
        port: int,
        all_reduce: str = "auto",
        shm_name: str | None = None,
        host: str = "127.0.0.1",
    ) -> tuple[Any, str]:
        """This rank's tensor-parallel group (whose all-reduce row-parallel layers end in)
        and the name of the all-reduce behind it (aiolm/distributed/communicator.py)."""
        from aiolm.distributed.communicator import make_tp_group

        return make_tp_group(rank, world_size, self.device.type, all_reduce, shm_name=shm_name, port=port, host=host)
