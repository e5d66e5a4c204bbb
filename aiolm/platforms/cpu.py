"""The CPU platform: aiolm's C++ kernels (ext/cpu) where they build, plain torch where not.

``--dtype bfloat16`` on a CPU means bfloat16 matmuls in the decoder layers of an
otherwise float32 model, with the KV cache in float16: the speed of the CPU's
matrix units where the answers least feel it (cpu_linear.py), with embeddings,
norms, attention arithmetic, the residual stream and the logits in float32.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from typing import Any

import torch
from torch import nn

from aiolm.kernels import cpu as cpu_kernels
from aiolm.kernels.ops import TorchOps
from aiolm.platforms import cpu_linear
from aiolm.platforms.base import Platform


log = logging.getLogger(__name__)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def _f32_cpu(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu"


def _matmul_dtype(dtype: torch.dtype) -> torch.dtype:
    """bfloat16, where this CPU multiplies in it; else float32, said once in the log."""
    if dtype != torch.bfloat16 or cpu_linear.bfloat16_matmuls():
        return dtype
    _say_no_bfloat16()
    return torch.float32


@functools.cache
def _say_no_bfloat16() -> None:
    log.warning("dtype bfloat16: this CPU has no bfloat16 matmuls (oneDNN needs AVX-512 BW/VL/DQ or "
                "AVX-NE-CONVERT), so the model runs in float32")


class CpuKernelOps(TorchOps):
    """The C++ kernels for the float32 CPU tensors they take; anything else goes to the reference.

    Call only once ``cpu_kernels.load()`` succeeded."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() == 2 and _f32_cpu(x) and weight.dtype == torch.float32:
            return torch.ops.aiolm.rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        # x may be a bfloat16 matmul's output: the normalised sum then comes back in
        # bfloat16, rounded as the next bfloat16 matmul would round its input
        if x.dim() == 2 and _f32_cpu(residual) and weight.dtype == torch.float32:
            torch.ops.aiolm.add_rms_norm_(x, residual, weight, eps)
            return x, residual
        return super().add_rms_norm(x, residual, weight, eps)

    def rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if _f32_cpu(q) and cos.dtype == torch.float32:
            torch.ops.aiolm.rotary_(q, k, positions, cos, sin)
            return q, k
        return super().rotary(positions, q, k, cos, sin)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
            return torch.ops.aiolm.silu_and_mul(x)
        return super().silu_and_mul(x)


class CpuPlatform(Platform):
    name = "cpu"

    @property
    def attention_backends(self) -> tuple[str, ...]:  # type: ignore[override]
        # Triton kernels run on a CPU only through triton's interpreter (tests, checks).
        return ("cpu", "torch", "triton") if os.environ.get("TRITON_INTERPRET") == "1" else ("cpu", "torch")

    def resolve_dtype(self, dtype: str) -> torch.dtype:
        """'auto' is float32: it keeps exact parity with transformers, and without AMX the
        float32 matmuls are also the faster ones (docs/benchmarks.md)."""
        t = _matmul_dtype(super().resolve_dtype(dtype))
        if t is torch.float16:
            from aiolm.errors import ModelLoadError

            try:
                torch.ones(2, 2, dtype=t) @ torch.ones(2, 2, dtype=t)
            except RuntimeError as e:
                raise ModelLoadError(f"dtype: float16 is not supported on this CPU ({e}); use float32") from e
        return t

    def kv_cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """bfloat16 matmuls keep the cache in float16: half the bytes a decode step reads,
        and 8x finer than bfloat16, whose cache changed greedy answers here."""
        return torch.float16 if dtype == torch.bfloat16 else dtype

    def ops(self) -> TorchOps:
        return CpuKernelOps() if cpu_kernels.load() else TorchOps()

    def make_tp_group(self, rank: int, world_size: int, port: int, all_reduce: str = "auto",
                      shm_name: str | None = None, cpu_bind: str = "auto",
                      host: str = "127.0.0.1") -> tuple[Any, str]:
        """Ranks pinned to disjoint cores first, so they do not fight over them."""
        from aiolm.distributed.cpu_bind import bind_rank

        bind_rank(rank, world_size, cpu_bind)
        return super().make_tp_group(rank, world_size, port, all_reduce, shm_name, cpu_bind, host)

    def tune_worker_process(self) -> None:
        """Step activations come from glibc's heap, not fresh mappings: glibc maps every
        allocation over 32 MiB (a 2048-token step's MLP outputs) anew and its pages fault
        in on every step, 10-15% of a 1.1B model's prompt step (docs/benchmarks.md). Only
        after loading, so that the weights' transient copies went back to the system; the
        heap then keeps up to 1 GiB of freed step memory for the next step."""
        try:
            mallopt = ctypes.CDLL(None).mallopt
        except (OSError, AttributeError):  # not a C library with mallopt: nothing to tune
            return
        mallopt(_M_MMAP_MAX, 0)
        mallopt(_M_TRIM_THRESHOLD, 1 << 30)

    def prepare_model(self, model: nn.Module, source: Any, dtype: torch.dtype) -> nn.Module:
        from aiolm.platforms import gguf_blocks

        matmul_dtype = dtype = _matmul_dtype(dtype)
        if dtype == torch.bfloat16:
            dtype = torch.float32  # bfloat16 on a CPU: only the matmuls (module docstring)
        model = model.to(dtype=dtype, device=self.device).eval()
        if dtype == torch.float32:
            kernels = cpu_kernels.load()
            # Handing bfloat16 matmul outputs straight on pays only where the next op (the
            # fused kernels) reads bfloat16; otherwise they come back as float32.
            cpu_linear.pack_model(model, matmul_dtype, hand_over_bf16=kernels)
            if kernels and source.origin.suffix == ".gguf":
                gguf_blocks.attach(model, source.origin, matmul_dtype)
        return model
