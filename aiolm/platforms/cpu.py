"""The CPU platform: aiolm's C++ kernels (ext/cpu) where they build, plain torch where not.

``--dtype bfloat16`` on a CPU means bfloat16 matmuls in the decoder layers of an
otherwise float32 model, with the KV cache in float16: the speed of the CPU's
matrix units where the answers least feel it (aiolm/quant/cpu_packed.py), with embeddings,
norms, attention arithmetic, the residual stream and the logits in float32.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from aiolm.errors import ModelLoadError
from aiolm.kernels import cpu as cpu_kernels
from aiolm.kernels.ops import TorchOps
from aiolm.platforms.base import Platform
from aiolm.quant import QuantConfig, quant_config

log = logging.getLogger(__name__)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
_ONEDNN_BATCH_HINT = 64  # as aiolm/quant/cpu_packed.py packs


@functools.cache
def bfloat16_matmuls() -> bool:
    """Whether oneDNN packs bfloat16 weights on this CPU. It needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT; an AVX2-only CPU has neither, and bfloat16 there would be emulated."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), _ONEDNN_BATCH_HINT)
    except (AttributeError, RuntimeError):
        return False
    return True


def _matmul_dtype(dtype: torch.dtype) -> torch.dtype:
    """bfloat16, where this CPU multiplies in it; else float32, said once in the log."""
    if dtype != torch.bfloat16 or bfloat16_matmuls():
        return dtype
    _say_no_bfloat16()
    return torch.float32


@functools.cache
def _say_no_bfloat16() -> None:
    log.warning(
        "dtype bfloat16: this CPU has no bfloat16 matmuls (oneDNN needs AVX-512 BW/VL/DQ or "
        "AVX-NE-CONVERT), so the model runs in float32"
    )


class CpuPlatform(Platform):
    name = "cpu"

    def __init__(self) -> None:
        super().__init__("cpu")

    @property
    def attention_backends(self) -> tuple[str, ...]:  # type: ignore[override]
        # Triton kernels run on a CPU only through triton's interpreter (tests, checks).
        return ("cpu", "torch", "triton") if os.environ.get("TRITON_INTERPRET") == "1" else ("cpu", "torch")

    def resolve_dtype(self, dtype: str) -> torch.dtype:
        """'auto' is float32: it keeps exact parity with transformers. ``--dtype bfloat16``
        trades that for speed on CPUs with bfloat16 units (docs/benchmarks.md)."""
        t = _matmul_dtype(super().resolve_dtype(dtype))
        if t is torch.float16:
            try:
                torch.ones(2, 2, dtype=t) @ torch.ones(2, 2, dtype=t)
            except RuntimeError as e:
                raise ModelLoadError(f"dtype: float16 is not supported on this CPU ({e}); use float32") from e
        return t

    def kv_cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """bfloat16 matmuls keep the cache in float16: half the bytes a decode step reads,
        and 8x finer than bfloat16, whose cache changed more greedy answers on the parity
        prompts (docs/benchmarks/log.md, "The CPU fast path")."""
        return torch.float16 if dtype == torch.bfloat16 else dtype

    def activation_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """bfloat16 on a CPU is only the matmuls (module docstring): float32 around them."""
        return torch.float32 if dtype == torch.bfloat16 else dtype

    def ops(self) -> TorchOps:
        if not cpu_kernels.load():
            return TorchOps()
        from aiolm.kernels.cpu_ops import CpuKernelOps

        return CpuKernelOps()

    def quant_config(
        self, dtype: torch.dtype, model_config: Any = None, checkpoint: Any = None, tp_size: int = 1
    ) -> QuantConfig:
        """Packed float32 or bfloat16 weights (aiolm/quant/cpu_packed.py) for a model in float32
        or bfloat16, with a GGUF file's own blocks (aiolm/quant/gguf_blocks.py) or a 4-bit
        checkpoint's codes (aiolm/quant/int4_blocks.py) beside them where the C++ kernels run
        on one rank; dense weights in any other dtype."""
        matmul_dtype = _matmul_dtype(dtype)
        if self.activation_dtype(matmul_dtype) != torch.float32:
            return quant_config("dense")
        kernels = cpu_kernels.load()
        # Handing bfloat16 matmul outputs straight on pays only where the next op (the
        # fused kernels) reads bfloat16; otherwise they come back as float32.
        packed = quant_config("cpu_packed", matmul_dtype=matmul_dtype, hand_over_bf16=kernels)
        if kernels and tp_size == 1 and checkpoint is not None and Path(checkpoint).suffix == ".gguf":
            return quant_config(
                "gguf_blocks", path=Path(checkpoint), model_config=model_config, inner=packed, matmul_dtype=matmul_dtype
            )
        quant = getattr(model_config, "quantization", None)
        if kernels and tp_size == 1 and checkpoint is not None and quant is not None and quant.int4:
            return quant_config(
                "int4_blocks",
                path=Path(checkpoint),
                model_config=model_config,
                inner=packed,
                quant=quant,
                matmul_dtype=matmul_dtype,
            )
        return packed

    def lora_kernel(self) -> Callable[..., None]:
        """aiolm::lora_apply_ (ext/cpu/lora.cpp) where the kernels are built; the torch loop
        for what it does not take."""
        from aiolm.kernels.cpu_lora import lora_apply

        return lora_apply

    def pin_worker(self, rank: int, world_size: int, cpu_bind: str = "auto") -> None:
        """Ranks pinned to disjoint cores before their groups form, so they do not fight over them."""
        from aiolm.distributed.cpu_bind import bind_rank

        bind_rank(rank, world_size, cpu_bind)

    def tune_worker_process(self) -> None:
        """Step activations come from glibc's heap, not fresh mappings: glibc maps every
        allocation over 32 MiB (a long prompt step's MLP outputs) anew, and its pages would
        fault in again on every step. Only after loading, so that the weights' transient
        copies went back to the system; the heap then keeps up to 1 GiB of freed step
        memory for the next step."""
        try:
            mallopt = ctypes.CDLL(None).mallopt
        except (OSError, AttributeError):  # not a C library with mallopt: nothing to tune
            return
        mallopt(_M_MMAP_MAX, 0)
        mallopt(_M_TRIM_THRESHOLD, 1 << 30)
