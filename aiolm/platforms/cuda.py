"""The CUDA platform: bfloat16 by default, Triton attention and fused Triton ops where
triton is installed, and a KV cache sized by profiling the largest step."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch

from aiolm.kernels.ops import TorchOps
from aiolm.platforms.base import Platform

log = logging.getLogger(__name__)


class CudaPlatform(Platform):
    name = "cuda"
    attention_backends = ("triton", "torch")

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for, but torch sees no CUDA device "
                             f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'})")
        self._in_use_before: int | None = None  # until worker_device measures it, all memory in use counts
        self.memory_report = ""

    def worker_device(self, device: str, index: int) -> torch.device:
        """Each rank on its own GPU: 'cuda' means cuda:<index> (the rank, plus the engine's
        device_offset under data parallelism; one node); an explicit index stays."""
        d = torch.device(device)
        if d.index is None:
            if index >= torch.cuda.device_count():
                raise ValueError(f"this rank needs GPU {index} (data-parallel replicas x tensor-parallel ranks, "
                                 f"one GPU each), but only {torch.cuda.device_count()} are visible")
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

    def resolve_dtype(self, dtype: str) -> torch.dtype:
        t = super().resolve_dtype(dtype)
        if t is torch.bfloat16 and not torch.cuda.is_bf16_supported():
            from aiolm.errors import ModelLoadError

            raise ModelLoadError("dtype: bfloat16 is not supported on this GPU; use float16 or auto")
        return t

    @torch.inference_mode()
    def kv_cache_bytes(self, runner: Any) -> int:
        """What is left for the KV cache of ``gpu_memory_utilization`` x the device's memory
        once everything else this process needs is counted:

        - the weights and the activation peak, measured by running the largest prefill step
          and the largest decode step once over a scratch cache
          (``torch.cuda.max_memory_allocated``; the scratch cache itself is not counted, the
          real cache takes its place);
        - memory this process holds outside torch's allocator (CUDA context, NCCL and
          library buffers): ``total - free - torch.cuda.memory_reserved()`` from
          ``torch.cuda.mem_get_info``, less what was in use when this rank took its GPU
          (:meth:`worker_device`), which is other processes': as in vLLM, the fraction is
          this process's share, so two engines at 0.45 can share a GPU;
        - when decode steps will replay CUDA graphs, which are captured after the KV cache
          is allocated: room for their memory pool, twice the activation peak of the decode
          step's forward (the pool holds one forward's activations at the largest captured
          size, in segments of its own that the allocator rounds up).

        Raises a ValueError naming --gpu-memory-utilization and the sizes when nothing is
        left, or when the GPU's free memory (other processes) cannot hold what is.
        """
        from aiolm.attention.metadata import AttentionMetadata
        from aiolm.attention.torch_backend import kv_cache_shape

        cfg, device = runner.cfg, runner.device
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        total = torch.cuda.get_device_properties(device).total_memory
        budget = int(total * cfg.gpu_memory_utilization)
        weights = torch.cuda.memory_allocated(device)
        if weights >= budget:
            raise ValueError(f"the model does not fit: its weights take {_gib(weights)} on {device}, more than "
                             f"--gpu-memory-utilization {cfg.gpu_memory_utilization} of {_gib(total)} allows "
                             f"({_gib(budget)}); raise --gpu-memory-utilization, use a smaller dtype or model, "
                             f"or split it (--tensor-parallel-size)")
        with self.memory_guard("profiling the largest step", cfg):
            n = min(cfg.max_num_batched_tokens, cfg.max_model_len)
            bs = cfg.block_size
            nblk = (n + bs - 1) // bs + 1
            caches = [torch.zeros(kv_cache_shape(nblk, bs, runner.num_kv_heads, runner.head_dim),
                                  dtype=runner.kv_dtype, device=device) for _ in range(runner.num_layers)]
            scratch = sum(c.numel() * c.element_size() for c in caches)
            meta = AttentionMetadata.build([n], [n], [list(range(1, nblk))], bs, device)
            ids = torch.zeros(n, dtype=torch.long, device=device)
            hidden = runner.model(ids, torch.arange(n, device=device), caches, meta)
            runner.model.compute_logits(hidden[-min(n, cfg.max_num_seqs):])
            del hidden
            torch.cuda.synchronize(device)
            prefill_peak = torch.cuda.max_memory_allocated(device)
            before_decode = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            rows = cfg.max_num_seqs  # a decode step: one token per request, every row sampled
            meta = AttentionMetadata.build([1] * rows, [1] * rows, [[1]] * rows, bs, device)
            hidden = runner.model(torch.zeros(rows, dtype=torch.long, device=device),
                                  torch.zeros(rows, dtype=torch.long, device=device), caches, meta)
            torch.cuda.synchronize(device)
            forward_peak = torch.cuda.max_memory_allocated(device)  # what a graph captures
            runner.model.compute_logits(hidden).float().softmax(-1)
            torch.cuda.synchronize(device)
            decode_peak = torch.cuda.max_memory_allocated(device)
            del caches, hidden
        peak = max(prefill_peak, decode_peak) - scratch
        free, _ = torch.cuda.mem_get_info(device)  # read with memory_reserved: cached blocks cancel out
        in_use_before = self._in_use_before or 0
        outside_torch = max(0, total - free - torch.cuda.memory_reserved(device) - in_use_before)
        graphs = 2 * (forward_peak - before_decode) if runner.uses_cuda_graphs() else 0
        torch.cuda.empty_cache()
        kv = budget - peak - outside_torch - graphs
        sizes = (f"--gpu-memory-utilization {cfg.gpu_memory_utilization} of {_gib(total)} on {device} is "
                 f"{_gib(budget)}; weights {_gib(weights)}, activation peak {_gib(peak - weights)} "
                 f"(max_num_batched_tokens {cfg.max_num_batched_tokens}, max_num_seqs {cfg.max_num_seqs}), "
                 f"outside torch {_gib(outside_torch)}, CUDA graphs {_gib(graphs)}")
        self.memory_report = sizes
        if kv <= 0:
            raise ValueError(f"the model does not fit: no room is left for the KV cache ({sizes}); raise "
                             f"--gpu-memory-utilization, lower --max-num-batched-tokens / --max-num-seqs, or "
                             f"use a smaller dtype or model")
        free = torch.cuda.mem_get_info(device)[0]
        if kv + graphs > free:
            raise ValueError(f"the KV cache would get {_gib(kv)} (and CUDA graphs {_gib(graphs)}) under "
                             f"--gpu-memory-utilization {cfg.gpu_memory_utilization}, but only {_gib(free)} "
                             f"of {device} is free "
                             f"(other processes hold {_gib(in_use_before)}); lower "
                             f"--gpu-memory-utilization or free the GPU")
        log.info("GPU memory: KV cache %s (%s)", _gib(kv), sizes)
        return kv

    def too_few_blocks(self, cfg: Any, num_blocks: int, min_blocks: int) -> str:
        return (f"the KV cache holds {num_blocks} blocks, fewer than one max_model_len {cfg.max_model_len} "
                f"sequence needs ({min_blocks}): {self.memory_report}; raise "
                f"--gpu-memory-utilization or lower --max-model-len")

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
                f"--max-num-batched-tokens / --max-num-seqs{hint}. torch: {str(e).splitlines()[0]}") from e


def _gib(n: int | float) -> str:
    return f"{n / 2**30:.2f} GiB"
