"""Turns a SchedulerOutput into one forward pass and sampled tokens.

Owns the model, the paged KV cache and the persistent batch. Everything logical
(which tokens, which blocks) arrives in the SchedulerOutput; this module only
makes tensors of it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from aiolm.attention.metadata import AttentionMetadata
from aiolm.attention.torch_backend import kv_cache_shape
from aiolm.core.outputs import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from aiolm.model.loader import resolve_model
from aiolm.model.registry import build_model, kv_cache_dtype, resolve_dtype
from aiolm.sample import logits_processors
from aiolm.sample.sampler import Sampler, SamplingMetadata
from aiolm.worker.input_batch import InputBatch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunnerConfig:
    """What a worker needs to build its runner; small and picklable for the handshake."""

    model: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    max_num_seqs: int = 256
    max_model_len: int = 2048
    block_size: int = 16
    kv_cache_memory: int = 1 << 30  # bytes of KV cache per rank on CPU
    gpu_memory_utilization: float = 0.9  # on CUDA: fraction of the device for weights + activations + KV
    max_num_batched_tokens: int = 2048  # sizes the profiling run on CUDA
    num_threads: int = 0  # torch intra-op threads; 0 = leave torch's default
    seed: int = 0


class ModelRunner:
    def __init__(self, cfg: RunnerConfig) -> None:
        self.cfg = cfg
        if cfg.num_threads > 0:
            torch.set_num_threads(cfg.num_threads)
        self.device = torch.device(cfg.device)
        self.source = resolve_model(cfg.model)
        requested = resolve_dtype(cfg.dtype, self.device)
        self.model = build_model(self.source, requested, self.device, max_positions=cfg.max_model_len)
        self.dtype = self.model.embed_tokens.weight.dtype  # activations (float32 for CPU bfloat16)
        self.kv_dtype = kv_cache_dtype(requested, self.device)
        mc = self.source.config
        self.vocab_size = mc.vocab_size
        local_kv_heads = self.model.layers[0].self_attn.num_kv_heads
        per_block = 2 * cfg.block_size * local_kv_heads * mc.head_dim * mc.num_layers * self.kv_dtype.itemsize
        kv_bytes = self._profile_kv_bytes() if self.device.type == "cuda" else cfg.kv_cache_memory
        self.num_blocks = int(kv_bytes // per_block)
        min_blocks = (cfg.max_model_len + cfg.block_size - 1) // cfg.block_size + 1
        if self.num_blocks < min_blocks:
            raise ValueError(f"kv_cache_memory {cfg.kv_cache_memory} bytes holds {self.num_blocks} blocks, "
                             f"fewer than one max_model_len sequence needs ({min_blocks}); "
                             f"raise kv_cache_memory or lower max_model_len")
        shape = kv_cache_shape(self.num_blocks, cfg.block_size, local_kv_heads, mc.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
                          for _ in range(mc.num_layers)]
        self.batch = InputBatch(cfg.max_num_seqs, cfg.max_model_len, cfg.block_size, self.device)
        self.sampler = Sampler()
        self.default_generator = torch.Generator(device=self.device)
        self.default_generator.manual_seed(cfg.seed)
        self._meta_key: tuple[str, ...] | None = None
        self._meta: SamplingMetadata | None = None
        self._last_sampled: list[list[int]] = []

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        self.batch.update(out)
        if out.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        step = self.batch.prepare(out, self.device)
        meta = AttentionMetadata(
            num_tokens=int(step.input_ids.shape[0]), query_start_loc=step.query_start_loc,
            seq_lens=step.seq_lens, block_table=step.block_table, slot_mapping=step.slot_mapping,
            query_lens_cpu=step.query_lens, seq_lens_cpu=step.seq_lens_list,
            block_size=self.cfg.block_size)
        t1 = time.perf_counter()
        hidden = self.model(step.input_ids, step.positions, self.kv_caches, meta)
        t2 = time.perf_counter()
        sample_idx = [i for i, s in enumerate(step.sample_mask) if s]
        sampled_ids: list[list[int]] = [[] for _ in step.req_ids]
        logprobs: dict[str, LogprobsLists] = {}
        if sample_idx:
            last = step.query_start_loc[1:] - 1
            if len(sample_idx) != len(step.req_ids):
                last = last[torch.tensor(sample_idx, device=self.device)]
            logits = self.model.compute_logits(hidden.index_select(0, last))
            rows = [int(step.rows[i]) for i in sample_idx]
            metadata = self._sampling_metadata(rows)
            result = self.sampler(logits, metadata)
            tokens = result.sampled.tolist()
            self._last_sampled = [[t] for t in tokens]
            for j, i in enumerate(sample_idx):
                sampled_ids[i] = [tokens[j]]
                lp = result.row_logprobs(j)
                if lp is not None:
                    logprobs[step.req_ids[i]] = lp
        else:
            self._meta_key = None
        t3 = time.perf_counter()
        return ModelRunnerOutput(req_ids=step.req_ids, sampled_token_ids=sampled_ids, logprobs=logprobs,
                                 worker_times=[t1 - t0, t2 - t1, t3 - t2])

    def _sampling_metadata(self, rows: list[int]) -> SamplingMetadata:
        """Reuse last step's metadata when the same requests sample again (pure decode)."""
        b = self.batch
        key = tuple(b.req_ids[r] or "" for r in rows)
        if key == self._meta_key and self._meta is not None:
            self._meta.advance(self._last_sampled)
            return self._meta
        params = [b.params[r] for r in rows]
        self._meta = SamplingMetadata.build(
            params,  # type: ignore[arg-type]
            [b.output_tokens(r).tolist() for r in rows],
            [b.prompt_tokens(r).tolist() if logits_processors.needs_prompt(p) else []  # type: ignore[arg-type]
             for r, p in zip(rows, params)],
            self.vocab_size, self.device,
            generators=[b.generators[r] for r in rows],
            default_generator=self.default_generator)
        self._meta_key = key
        return self._meta

    @torch.inference_mode()
    def _profile_kv_bytes(self) -> int:
        """Run the largest step once without a cache to measure peak activations, then
        give the KV cache what is left of ``gpu_memory_utilization`` of the device."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = min(self.cfg.max_num_batched_tokens, self.cfg.max_model_len)
        mc = self.source.config
        local_kv = self.model.layers[0].self_attn.num_kv_heads
        bs = self.cfg.block_size
        nblk = (n + bs - 1) // bs + 1
        caches = [torch.zeros(kv_cache_shape(nblk, bs, local_kv, mc.head_dim), dtype=self.dtype,
                              device=self.device) for _ in range(mc.num_layers)]
        meta = AttentionMetadata.build([n], [n], [list(range(1, nblk))], bs, self.device)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        hidden = self.model(ids, torch.arange(n, device=self.device), caches, meta)
        self.model.compute_logits(hidden[-min(n, self.cfg.max_num_seqs):])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del caches, hidden
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        free_for_kv = int(total * self.cfg.gpu_memory_utilization) - peak
        if free_for_kv <= 0:
            raise ValueError(f"gpu_memory_utilization {self.cfg.gpu_memory_utilization} leaves no room for "
                             f"the KV cache (weights + activations peak at {peak / 2**30:.2f} GiB)")
        return free_for_kv

    def kv_cache_info(self) -> dict[str, int]:
        return {"num_blocks": self.num_blocks, "block_size": self.cfg.block_size}


def call_on_runner(runner: ModelRunner, method: str | Callable[..., Any], args: tuple = (),
                   kwargs: dict[str, Any] | None = None) -> Any:
    """One rank's part of collective_rpc: a runner method by name, or fn(runner, ...)."""
    if callable(method):
        return method(runner, *args, **(kwargs or {}))
    return getattr(runner, method)(*args, **(kwargs or {}))
