"""How many bytes a worker's KV cache gets, and the error when that is too few.

On a platform that profiles_memory (CUDA), the cache gets what is left of
``gpu_memory_utilization`` x the device's memory once everything else this process
needs is counted:

- the weights and the activation peak, measured by running the largest prefill step
  and the largest decode step once over a scratch cache (the allocator's peak; the
  scratch cache itself is not counted, the real cache takes its place);
- memory this process holds outside torch's allocator (CUDA context, NCCL and library
  buffers): ``total - free - reserved``, less what was in use when this rank took its
  device, which is other processes': as in vLLM, the fraction is this process's share,
  so two engines at 0.45 can share a GPU;
- when decode steps will replay CUDA graphs, which are captured after the KV cache is
  allocated: room for their memory pool, twice the activation peak of the decode
  step's forward (the pool holds one forward's activations at the largest captured
  size, in segments of its own that the allocator rounds up).

Elsewhere it gets ``kv_cache_memory``. The platform answers the memory questions; the
profiling run is the worker's, since it runs the model.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from aiolm.attention.metadata import AttentionMetadata
from aiolm.attention.torch_backend import kv_cache_shape

log = logging.getLogger(__name__)


class KVCacheSizer:
    """Sizes one runner's KV cache on ``platform`` and words the errors about it."""

    def __init__(self, platform: Any) -> None:
        self.platform = platform
        self.report = ""  # the sizes behind a profiled budget, for too_few_blocks

    def kv_cache_bytes(self, runner: Any) -> int:
        """Bytes the KV cache of ``runner`` (a ModelRunner with its model loaded) may take.

        Raises a ValueError naming --gpu-memory-utilization and the sizes when nothing is
        left, or when the device's free memory (other processes) cannot hold what is."""
        if not self.platform.profiles_memory:
            return runner.cfg.kv_cache_memory
        with torch.inference_mode():
            return self._profile(runner)

    def _profile(self, runner: Any) -> int:
        p = self.platform
        cfg, device = runner.cfg, runner.device
        takes_logits = cfg.runner != "pooling"  # a pooling model has no LM head
        p.empty_cache()
        p.reset_peak_memory(device)
        total = p.total_memory(device)
        budget = int(total * cfg.gpu_memory_utilization)
        weights = p.allocated_memory(device)
        if weights >= budget:
            raise ValueError(
                f"the model does not fit: its weights take {_gib(weights)} on {device}, more than "
                f"--gpu-memory-utilization {cfg.gpu_memory_utilization} of {_gib(total)} allows "
                f"({_gib(budget)}); raise --gpu-memory-utilization, use a smaller dtype or model, "
                f"or split it (--tensor-parallel-size)"
            )
        with p.memory_guard("profiling the largest step", cfg):
            n = min(cfg.max_num_batched_tokens, cfg.max_model_len)
            bs = cfg.block_size
            nblk = (n + bs - 1) // bs + 1
            caches = [
                torch.zeros(
                    kv_cache_shape(nblk, bs, runner.num_kv_heads, runner.head_dim), dtype=runner.kv_dtype, device=device
                )
                for _ in range(runner.num_layers)
            ]
            scratch = sum(c.numel() * c.element_size() for c in caches)
            meta = AttentionMetadata.build([n], [n], [list(range(1, nblk))], bs, device)
            ids = torch.zeros(n, dtype=torch.long, device=device)
            hidden = runner.model(ids, torch.arange(n, device=device), caches, meta)
            if takes_logits:
                runner.model.compute_logits(hidden[-min(n, cfg.max_num_seqs) :])
            del hidden
            p.synchronize(device)
            prefill_peak = p.peak_allocated_memory(device)
            before_decode = p.allocated_memory(device)
            p.reset_peak_memory(device)
            rows = cfg.max_num_seqs  # a decode step: one token per request, every row sampled
            meta = AttentionMetadata.build([1] * rows, [1] * rows, [[1]] * rows, bs, device)
            hidden = runner.model(
                torch.zeros(rows, dtype=torch.long, device=device),
                torch.zeros(rows, dtype=torch.long, device=device),
                caches,
                meta,
            )
            p.synchronize(device)
            forward_peak = p.peak_allocated_memory(device)  # what a graph captures
            if takes_logits:
                runner.model.compute_logits(hidden).float().softmax(-1)
            p.synchronize(device)
            decode_peak = p.peak_allocated_memory(device)
            del caches, hidden
        peak = max(prefill_peak, decode_peak) - scratch
        free = p.free_memory(device)  # read with the reserved memory: cached blocks cancel out
        in_use_before = p.memory_in_use_before()
        outside_torch = max(0, total - free - p.reserved_memory(device) - in_use_before)
        graphs = 2 * (forward_peak - before_decode) if runner.uses_cuda_graphs() else 0
        p.empty_cache()
        kv = budget - peak - outside_torch - graphs
        sizes = (
            f"--gpu-memory-utilization {cfg.gpu_memory_utilization} of {_gib(total)} on {device} is "
            f"{_gib(budget)}; weights {_gib(weights)}, activation peak {_gib(peak - weights)} "
            f"(max_num_batched_tokens {cfg.max_num_batched_tokens}, max_num_seqs {cfg.max_num_seqs}), "
            f"outside torch {_gib(outside_torch)}, CUDA graphs {_gib(graphs)}"
        )
        self.report = sizes
        if kv <= 0:
            raise ValueError(
                f"the model does not fit: no room is left for the KV cache ({sizes}); raise "
                f"--gpu-memory-utilization, lower --max-num-batched-tokens / --max-num-seqs, or "
                f"use a smaller dtype or model"
            )
        free = p.free_memory(device)
        if kv + graphs > free:
            raise ValueError(
                f"the KV cache would get {_gib(kv)} (and CUDA graphs {_gib(graphs)}) under "
                f"--gpu-memory-utilization {cfg.gpu_memory_utilization}, but only {_gib(free)} "
                f"of {device} is free "
                f"(other processes hold {_gib(in_use_before)}); lower "
                f"--gpu-memory-utilization or free the GPU"
            )
        log.info("GPU memory: KV cache %s (%s)", _gib(kv), sizes)
        return kv

    def too_few_blocks(self, cfg: Any, num_blocks: int, min_blocks: int) -> str:
        """The error when the KV cache holds less than one max_model_len sequence; it names
        the knob that sized the cache on this platform."""
        if self.platform.profiles_memory:
            return (
                f"the KV cache holds {num_blocks} blocks, fewer than one max_model_len {cfg.max_model_len} "
                f"sequence needs ({min_blocks}): {self.report}; raise "
                f"--gpu-memory-utilization or lower --max-model-len"
            )
        return (
            f"kv_cache_memory {cfg.kv_cache_memory} bytes holds {num_blocks} blocks, fewer than one "
            f"max_model_len sequence needs ({min_blocks}); raise kv_cache_memory or lower max_model_len"
        )


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"
