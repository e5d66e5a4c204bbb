"""The CUDA platform: bfloat16 by default, Triton attention and fused Triton ops where
triton is installed, and a KV cache sized by profiling the largest step."""

from __future__ import annotations

from typing import Any

import torch

from aiolm.kernels.ops import TorchOps
from aiolm.platforms.base import Platform


class CudaPlatform(Platform):
    name = "cuda"
    attention_backends = ("triton", "torch")

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for, but torch sees no CUDA device "
                             f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'})")

    def worker_device(self, device: str, rank: int) -> torch.device:
        """Each rank on its own GPU: 'cuda' means cuda:<rank> (one node); an explicit index stays."""
        d = torch.device(device)
        if d.index is None:
            if rank >= torch.cuda.device_count():
                raise ValueError(f"rank {rank} needs GPU {rank}, but only {torch.cuda.device_count()} are visible")
            d = torch.device("cuda", rank)
        torch.cuda.set_device(d)
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

    def resolve_dtype(self, dtype: str) -> torch.dtype:
        t = super().resolve_dtype(dtype)
        if t is torch.bfloat16 and not torch.cuda.is_bf16_supported():
            from aiolm.model.config import ModelLoadError

            raise ModelLoadError("dtype: bfloat16 is not supported on this GPU; use float16 or auto")
        return t

    @torch.inference_mode()
    def kv_cache_bytes(self, runner: Any) -> int:
        """Run the largest prefill step and the largest decode step once over a scratch cache
        to measure peak activations, then give the KV cache what is left of
        ``gpu_memory_utilization`` of the device."""
        from aiolm.attention.metadata import AttentionMetadata
        from aiolm.attention.torch_backend import kv_cache_shape

        cfg, device = runner.cfg, runner.device
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        n = min(cfg.max_num_batched_tokens, cfg.max_model_len)
        bs = cfg.block_size
        nblk = (n + bs - 1) // bs + 1
        caches = [torch.zeros(kv_cache_shape(nblk, bs, runner.num_kv_heads, runner.head_dim), dtype=runner.kv_dtype,
                              device=device) for _ in range(runner.num_layers)]
        meta = AttentionMetadata.build([n], [n], [list(range(1, nblk))], bs, device)
        ids = torch.zeros(n, dtype=torch.long, device=device)
        hidden = runner.model(ids, torch.arange(n, device=device), caches, meta)
        runner.model.compute_logits(hidden[-min(n, cfg.max_num_seqs):])
        rows = cfg.max_num_seqs  # a decode step: one token per request, every row sampled
        meta = AttentionMetadata.build([1] * rows, [1] * rows, [[1]] * rows, bs, device)
        hidden = runner.model(torch.zeros(rows, dtype=torch.long, device=device),
                              torch.zeros(rows, dtype=torch.long, device=device), caches, meta)
        runner.model.compute_logits(hidden).float().softmax(-1)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        del caches, hidden
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(device).total_memory
        free_for_kv = int(total * cfg.gpu_memory_utilization) - peak
        if free_for_kv <= 0:
            raise ValueError(f"gpu_memory_utilization {cfg.gpu_memory_utilization} leaves no room for "
                             f"the KV cache (weights + activations peak at {peak / 2**30:.2f} GiB)")
        return free_for_kv
