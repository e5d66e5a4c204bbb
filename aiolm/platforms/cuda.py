"""The CUDA platform: bfloat16 by default, Triton attention and fused Triton ops where
triton is installed, and the memory questions the worker sizes the KV cache by."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from aiolm.errors import ModelLoadError
from aiolm.kernels.ops import TorchOps
from aiolm.platforms.base import Platform
from aiolm.quant import QuantConfig, quant_config


class CudaPlatform(Platform):
    name = "cuda"
    attention_backends = ("triton", "torch")
    profiles_memory = True

    def __init__(self) -> None:
        super().__init__("cuda")
        if not torch.cuda.is_available():
            raise ValueError(
                "device 'cuda' was asked for, but torch sees no CUDA device "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'})"
            )
        self._in_use_before: int | None = None  # until worker_device measures it, all memory in use counts

    def worker_device(self, device: str, index: int) -> torch.device:
        """Each rank on its own GPU: 'cuda' means cuda:<index> (the rank, plus the engine's
        device_offset under data parallelism; one node); an explicit index stays."""
        d = torch.device(device)
        if d.index is None:
            if index >= torch.cuda.device_count():
                raise ValueError(
                    f"this rank needs GPU {index} (data-parallel replicas x tensor-parallel ranks, "
                    f"one GPU each), but only {torch.cuda.device_count()} are visible"
                )
            d = torch.device("cuda", index)
        torch.cuda.set_device(d)
        if self._in_use_before is None:  # the first call, before this rank's group or model allocates
            free, total = torch.cuda.mem_get_info(d)
            self._in_use_before = total - free  # other processes' (and this one's CUDA context)
        return d

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16

    def ops(self) -> TorchOps:
        """The fused Triton kernels where triton is installed (each op falls back to the
        reference for what its kernel does not take), else the reference."""
        from aiolm.kernels import triton as triton_kernels

        if not triton_kernels.available():
            return TorchOps()
        from aiolm.kernels.triton.ops import TritonOps

        return TritonOps()

    def lora_kernel(self) -> Callable[..., None]:
        """The Triton shrink and expand kernels (aiolm/kernels/triton/lora.py): no host
        synchronisation, so they are captured in the decode CUDA graphs."""
        from aiolm.kernels.triton.lora import lora_apply

        return lora_apply

    def quant_config(
        self, dtype: torch.dtype, model_config: Any = None, checkpoint: Any = None, tp_size: int = 1
    ) -> QuantConfig:
        """Dense weights; layers of experts run by the fused Triton kernel where triton is
        installed; a quantized checkpoint's layers kept packed for the Triton GEMMs on one
        rank (aiolm/quant/triton_quant.py)."""
        from aiolm.kernels import triton as triton_kernels

        experts = "triton" if triton_kernels.available() else "torch"
        quant = getattr(model_config, "quantization", None)
        if quant is not None and checkpoint is not None and tp_size == 1 and triton_kernels.available():
            return quant_config("triton_quant", path=Path(checkpoint), quant=quant, experts=experts)
        return quant_config("dense", experts=experts)

    def resolve_dtype(self, dtype: str) -> torch.dtype:
        t = super().resolve_dtype(dtype)
        if t is torch.bfloat16 and not torch.cuda.is_bf16_supported():
            raise ModelLoadError("dtype: bfloat16 is not supported on this GPU; use float16 or auto")
        return t

    # The memory questions the worker's KV-cache sizing asks (aiolm/worker/kv_cache_size.py).
    def total_memory(self, device: torch.device) -> int:
        return torch.cuda.get_device_properties(device).total_memory

    def free_memory(self, device: torch.device) -> int:
        return torch.cuda.mem_get_info(device)[0]

    def allocated_memory(self, device: torch.device) -> int:
        return torch.cuda.memory_allocated(device)

    def peak_allocated_memory(self, device: torch.device) -> int:
        return torch.cuda.max_memory_allocated(device)

    def reset_peak_memory(self, device: torch.device) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    def reserved_memory(self, device: torch.device) -> int:
        return torch.cuda.memory_reserved(device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def memory_in_use_before(self) -> int:
        """What was in use on the device when this rank took it (worker_device): other
        processes' memory and this one's CUDA context; 0 before that."""
        return self._in_use_before or 0

    @contextlib.contextmanager
    def memory_guard(self, step: str, cfg: Any) -> Iterator[None]:
        try:
            yield
        except torch.cuda.OutOfMemoryError as e:
            device = torch.cuda.current_device()
            free, total = torch.cuda.mem_get_info(device)
            hint = "; or turn CUDA graphs off (--enforce-eager)" if "graph" in step else ""
            raise ValueError(
                f"the model does not fit on cuda:{device}: {step} ran out of GPU memory (this process holds "
                f"{_gib(torch.cuda.memory_reserved(device))}, {_gib(free)} of {_gib(total)} is free; "
                f"--gpu-memory-utilization {cfg.gpu_memory_utilization} allows "
                f"{_gib(int(total * cfg.gpu_memory_utilization))} for weights, activations and KV cache). "
                f"Use a smaller dtype or model, split it (--tensor-parallel-size), or lower "
                f"--max-num-batched-tokens / --max-num-seqs{hint}. torch: {str(e).splitlines()[0]}"
            ) from e


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"
