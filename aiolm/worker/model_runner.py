"""Turns a SchedulerOutput into one forward pass and sampled tokens.

Owns the model, the paged KV cache and the persistent batch. Everything logical
(which tokens, which blocks) arrives in the SchedulerOutput; this module only
makes tensors of it.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
import torch

from aiolm.attention.metadata import AttentionMetadata
from aiolm.attention.torch_backend import kv_cache_shape
from aiolm.checkpoint.source import resolve_model
from aiolm.config import RunnerConfig
from aiolm.core.step import (
    LogprobsLists,
    ModelRunnerOutput,
    PromptLogprobs,
    SchedulerOutput,
)
from aiolm.distributed.parallel_state import get_pp_stage, get_tp_group
from aiolm.distributed.stage_link import StageLink
from aiolm.kv_transfer.base import ConnectorWorker
from aiolm.kv_transfer.offload_worker import OffloadWorker
from aiolm.kv_transfer.pd_worker import PDWorker
from aiolm.lora.manager import LoRAManager
from aiolm.lora.request import LoRARequest
from aiolm.model.registry import build_model
from aiolm.multimodal.inputs import ImageInput
from aiolm.platforms import get_platform
from aiolm.pooling.config import read_pooling_config
from aiolm.pooling.poolers import Pooler, PoolingState
from aiolm.sample import logits_processors
from aiolm.sample.prompt_logprobs import score_prompt
from aiolm.sample.rejection import accepted_prefix, row_histories, verify_positions
from aiolm.sample.sampler import Sampler, SamplingMetadata
from aiolm.structured.backend import BackgroundCompiles, Compiler
from aiolm.worker.cuda_graph import CudaGraphRunner, capture_sizes, plan_step
from aiolm.worker.input_batch import InputBatch
from aiolm.worker.kv_cache_size import KVCacheSizer

log = logging.getLogger(__name__)
# A step with no tokens is the scheduler waiting for grammars only: the reply waits this long
# for a compile to finish, so the engine polls at this pace rather than spinning, and a request
# arriving meanwhile waits at most this long to be scheduled.
GRAMMAR_IDLE_WAIT_S = 0.02


class ModelRunner:
    def __init__(self, cfg: RunnerConfig, link: StageLink | None = None) -> None:
        """``link``: the rings to the neighbouring pipeline stages, when this rank runs one
        stage of several (distributed/parallel_state.py says which)."""
        self.cfg = cfg
        self.stage = get_pp_stage()
        self.link = link
        self.busy: collections.deque[tuple[int, float, float]] = collections.deque(maxlen=1024)
        if cfg.num_threads > 0:
            torch.set_num_threads(cfg.num_threads)
        self.platform = get_platform(cfg.device)
        self.device = self.platform.worker_device(cfg.device, get_tp_group().rank + cfg.device_offset)
        self.source = resolve_model(cfg.model)
        Compiler.configure(self.source.load_tokenizer, self.source.path)  # loaded on first use
        requested = self.platform.resolve_dtype(cfg.dtype)
        with self.platform.memory_guard("loading the weights", cfg):
            self.model = build_model(
                self.source,
                requested,
                self.device,
                max_positions=cfg.max_model_len,
                attention=cfg.attention_backend,
                expert_parallel=cfg.enable_expert_parallel,
                pooling=cfg.runner == "pooling",
                lora=(cfg.max_loras, cfg.max_lora_rank) if cfg.max_loras else None,
            )
        self.lora: LoRAManager | None = None
        self.lora_of: dict[str, LoRARequest] = {}  # live requests' adapters
        if cfg.max_loras:
            self.lora = LoRAManager(self.model, self.source.config, max(cfg.max_cpu_loras, cfg.max_loras))
            # room for a step's tokens before any CUDA graph takes the slot buffer's address
            self.lora.ctx.set_rows([-1] * max(cfg.max_num_batched_tokens, cfg.max_num_seqs))
        embed = getattr(self.model, "embed_tokens", None)  # None on a later pipeline stage
        # activations (float32 for CPU bfloat16)
        self.dtype = embed.weight.dtype if embed is not None else self.model.activation_dtype
        fp8 = cfg.kv_cache_dtype in ("fp8", "fp8_e4m3")
        self.kv_dtype = torch.float8_e4m3fn if fp8 else self.platform.kv_cache_dtype(requested)
        mc = self.source.config
        self.vocab_size = mc.vocab_size
        self.grammars = BackgroundCompiles(mc.vocab_size)
        # this stage's layers (all of them without a pipeline), which the KV cache is for
        self.layer_ids = list(getattr(self.model, "local_layers", range(mc.num_layers)))
        self.num_layers, self.head_dim = len(self.layer_ids), mc.head_dim
        self.pooler: Pooler | None = None
        self.pooling: dict[str, PoolingState] = {}  # live pooling requests' running states
        if cfg.runner == "pooling":
            pc = read_pooling_config(str(self.source.path), self.source.hf_config, mc.encoder_only)
            self.pooler = Pooler(pc, getattr(self.model, "classify", None))
        if mc.encoder_only:
            self._no_kv_cache(cfg)
        else:
            self._allocate_kv_cache(cfg)
        self.kv_connector = self._kv_connector(cfg) if cfg.kv_transfer is not None else None
        self.batch = InputBatch(cfg.max_num_seqs, cfg.max_model_len, cfg.block_size, self.device)
        with self.platform.memory_guard("capturing CUDA graphs", cfg):
            self.graphs = self._capture_graphs()
        self.sampler = Sampler()
        self.default_generator = torch.Generator(device=self.device)
        self.default_generator.manual_seed(cfg.seed)
        self._meta_key: tuple[str, ...] | None = None
        self._meta: SamplingMetadata | None = None
        self._last_sampled: list[list[int]] = []
        # Vision-language models: live requests' images, and the encoder cache (image hash ->
        # its embeddings [placeholders, hidden]) whose entries the scheduler's ledger
        # (core/encoder_cache.py) adds and drops.
        self.images_of: dict[str, list[ImageInput]] = {}
        self.encoder_cache: dict[str, torch.Tensor] = {}

    def prepare_grammars(self) -> None:
        """Build the grammar compiler (xgrammar and the tokenizer's tables) in a thread. The
        engine asks for it when its first grammar check begins, so that the first structured
        request's steps find it built; not at load, where on a small machine it lengthened
        every start, structured outputs or not."""
        if self.cfg.structured_outputs:
            Compiler.preload(self.vocab_size)

    def _kv_connector(self, cfg: RunnerConfig) -> ConnectorWorker:
        """This rank's half of the KV connector (aiolm/kv_transfer/)."""
        kt = cfg.kv_transfer
        assert kt is not None
        tp = get_tp_group()
        if kt.kv_connector == "OffloadingConnector":
            return OffloadWorker(kt, cfg.kv_fingerprint, tp.rank, self.kv_caches)
        mc = self.source.config
        layout = {  # what must agree for another instance's KV bytes to mean the same here
            "model": hashlib.sha256(repr(mc).encode()).hexdigest()[:16],
            "dtype": str(self.dtype).removeprefix("torch."),
            "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch."),
            "block_size": cfg.block_size,
            "num_layers": mc.num_layers,
            "kv_heads_per_rank": self.num_kv_heads,
            "head_dim": mc.head_dim,
            "tensor_parallel_size": tp.world_size,
        }
        return PDWorker(kt, tp.rank, self.kv_caches, layout)

    def _no_kv_cache(self, cfg: RunnerConfig) -> None:
        """An encoder keeps no KV: each prompt runs whole in one step and is done. The
        scheduler still counts blocks, so it gets enough logical ones for a full step of
        prompts (each rounded up to a block) and for one prompt of max_model_len."""
        self.num_kv_heads = 0
        per_step = -(-cfg.max_num_batched_tokens // cfg.block_size) + cfg.max_num_seqs
        self.num_blocks = max(per_step, -(-cfg.max_model_len // cfg.block_size)) + 1
        self.kv_caches: list[torch.Tensor] = []

    def _allocate_kv_cache(self, cfg: RunnerConfig) -> None:
        mc = self.source.config
        self.num_kv_heads = self.model.layers[self.layer_ids[0]].self_attn.num_kv_heads
        per_block = 2 * cfg.block_size * self.num_kv_heads * mc.head_dim * self.num_layers * self.kv_dtype.itemsize
        sizer = KVCacheSizer(self.platform)
        kv_bytes = sizer.kv_cache_bytes(self)
        self.num_blocks = int(kv_bytes // per_block)
        log.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.1f requests of max_model_len %d)",
            self.num_blocks,
            cfg.block_size,
            self.num_blocks * cfg.block_size,
            self.num_blocks * cfg.block_size / cfg.max_model_len,
            cfg.max_model_len,
        )
        min_blocks = (cfg.max_model_len + cfg.block_size - 1) // cfg.block_size + 1
        if self.num_blocks < min_blocks:
            raise ValueError(sizer.too_few_blocks(cfg, self.num_blocks, min_blocks))
        shape = kv_cache_shape(self.num_blocks, cfg.block_size, self.num_kv_heads, mc.head_dim)
        with self.platform.memory_guard("allocating the KV cache", cfg):
            self.kv_caches = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in self.layer_ids]

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """The step's output; None on a pipeline stage before the last, which only hands its
        activations on (the last stage answers for the step)."""
        t0 = time.perf_counter()
        if self.kv_connector is not None:
            self.kv_connector.begin_step(scheduler_output, idle=scheduler_output.total_num_scheduled_tokens == 0)
        self.batch.update(scheduler_output)
        for rid in scheduler_output.finished_req_ids:  # also in a step with nothing to run
            self.pooling.pop(rid, None)
        if self.lora is not None:
            self._track_lora(scheduler_output)
        if self.images_of or any(new.mm_inputs for new in scheduler_output.scheduled_new_reqs):
            self._track_images(scheduler_output)
        if scheduler_output.free_encoder_hashes or scheduler_output.encoder_inputs:
            self._run_encoder(scheduler_output)
        if scheduler_output.grammars and self.stage.is_last:  # the last stage samples
            self.grammars.submit(scheduler_output.grammars)
        if scheduler_output.total_num_scheduled_tokens == 0:
            ready, errors = self.grammars.collect(wait=GRAMMAR_IDLE_WAIT_S)
            loaded, sent = self._kv_done()
            return ModelRunnerOutput(
                [], [], grammars_ready=ready, grammar_errors=errors, kv_loaded=loaded, kv_sent=sent
            )
        step = self.batch.prepare(scheduler_output, self.device)
        request_errors = self._map_lora_rows(step) if self.lora is not None else {}
        meta = AttentionMetadata(
            num_tokens=int(step.input_ids.shape[0]),
            query_start_loc=step.query_start_loc,
            seq_lens=step.seq_lens,
            block_table=step.block_table,
            slot_mapping=step.slot_mapping,
            query_lens_cpu=step.query_lens,
            seq_lens_cpu=step.seq_lens_list,
            block_size=self.cfg.block_size,
        )
        t1 = time.perf_counter()
        if self.pooler is not None:
            return self._execute_pooling(scheduler_output, step, meta, t0, t1)
        mm = self._image_embeds(step) if self.images_of else None
        plan = plan_step(meta.num_reqs, meta.num_tokens, self.graphs.sizes) if self.graphs else None
        sample_idx = [i for i, s in enumerate(step.sample_mask) if s]
        metadata, drawn = None, None
        if self._may_end_in_the_call(step, meta, sample_idx, plan, mm):
            metadata = self._sampling_metadata([int(r) for r in step.rows])
            if not metadata.processors and not metadata.logprob_row_list:
                sampling = None if metadata.all_greedy else metadata
                drawn = self.model.sampled_tokens(step.input_ids, step.positions, self.kv_caches, meta, sampling)
        if drawn is not None:
            hidden = None
        elif self.stage.size > 1:
            out = self._run_stage(scheduler_output.step, step, meta)
            if out is None:
                return None  # handed on to the next stage, which answers
            hidden = out
        elif plan is not None and not plan.eager and mm is None:
            hidden = self.graphs.run(plan.size, step.input_ids, step.positions, meta)  # type: ignore[union-attr]
        elif mm is not None:
            hidden = self.model(step.input_ids, step.positions, self.kv_caches, meta, mm_embeds=mm)
        else:
            hidden = self.model(step.input_ids, step.positions, self.kv_caches, meta)
        t2 = time.perf_counter()
        sampled_ids: list[list[int]] = [[] for _ in step.req_ids]
        logprobs: dict[str, LogprobsLists] = {}
        if drawn is not None:  # every row's token came from the call: nothing else to take
            tokens = drawn.tolist()
            self._last_sampled = [[t] for t in tokens]
            if self.cfg.async_scheduling:
                self.batch.append_sampled([int(r) for r in step.rows], tokens)
            sampled_ids = [[t] for t in tokens]
        elif sample_idx and step.num_drafts is not None:
            assert hidden is not None
            self._verify(scheduler_output, step, hidden, sample_idx, sampled_ids, logprobs)
        elif sample_idx:
            assert hidden is not None
            last = step.query_start_loc[1:] - 1
            if len(sample_idx) != len(step.req_ids):
                last = last[torch.tensor(sample_idx, device=self.device)]
            logits = self.model.compute_logits(hidden.index_select(0, last))
            rows = [int(step.rows[i]) for i in sample_idx]
            if metadata is None:
                metadata = self._sampling_metadata(rows)
            result = self.sampler(logits, metadata)
            tokens = result.sampled.tolist()
            self._last_sampled = [[t] for t in tokens]
            if self.cfg.async_scheduling:
                self.batch.append_sampled(rows, tokens)
            for j, i in enumerate(sample_idx):
                sampled_ids[i] = [tokens[j]]
                lp = result.row_logprobs(j)
                if lp is not None:
                    logprobs[step.req_ids[i]] = lp
        else:
            self._meta_key = None
        prompt_lps = self._prompt_logprobs(step, hidden) if hidden is not None else {}
        ready, errors = self.grammars.collect()
        loaded, sent = self._kv_done()
        t3 = time.perf_counter()
        return ModelRunnerOutput(
            req_ids=step.req_ids,
            sampled_token_ids=sampled_ids,
            logprobs=logprobs,
            prompt_logprobs=prompt_lps,
            worker_times=[t1 - t0, t2 - t1, t3 - t2],
            grammars_ready=ready,
            grammar_errors=errors,
            request_errors=request_errors,
            kv_loaded=loaded,
            kv_sent=sent,
        )

    def _may_end_in_the_call(
        self, step: Any, meta: AttentionMetadata, sample_idx: list[int], plan: Any, mm: Any
    ) -> bool:
        """Whether the model may run this step's sampling inside its forward call
        (``sampled_tokens``): a decode step on one stage, one token a request and every request
        sampling, with no drafts, images, graphs or prompt logprobs; the caller still checks
        that no logits processor or logprobs apply."""
        if (
            getattr(self.model, "sample_step", None) is None
            or self.stage.size > 1
            or mm is not None
            or (plan is not None and not plan.eager)
            or step.num_drafts is not None
            or len(sample_idx) != len(step.req_ids)
            or meta.num_tokens != len(step.req_ids)
        ):
            return False
        params = self.batch.params
        return all((p := params[int(r)]) is not None and p.prompt_logprobs is None for r in step.rows)

    def _run_stage(self, step_no: int, step: Any, meta: AttentionMetadata) -> torch.Tensor | None:
        """This pipeline stage's layers over the step: from the tokens on the first stage, else
        from what the stage before handed on; the hidden states on the last stage, else None
        once they are on their way to the next."""
        assert self.link is not None, "a pipeline stage needs its link to its neighbours"
        inter = None if self.stage.is_first else self.link.recv(step_no, self.device)
        start = time.perf_counter()
        if self.stage.is_last:
            hidden = self.model(step.input_ids, step.positions, self.kv_caches, meta, intermediate=inter)
            self.busy.append((step_no, start, time.perf_counter()))
            return hidden
        x, residual = self.model.run_layers(step.input_ids, step.positions, self.kv_caches, meta, None, inter)
        assert residual is not None, "every stage holds at least one layer"
        self.busy.append((step_no, start, time.perf_counter()))
        self.link.send(step_no, x, residual)
        return None

    def stage_trace(self) -> list[tuple[int, float, float]]:
        """(step, start, end) of this pipeline stage's latest forward passes, in
        time.perf_counter() seconds (CLOCK_MONOTONIC, one clock for every process here):
        where two stages' intervals overlap, both computed at once."""
        return list(self.busy)

    def _kv_done(self) -> tuple[dict[int, int], list[str]]:
        """The KV connector's loads put into their blocks and transfers sent, for the reply."""
        c = self.kv_connector
        return (c.finished_loads(), c.finished_sends()) if c is not None else ({}, [])

    def _track_lora(self, out: SchedulerOutput) -> None:
        """Which adapter each live request runs with, from the step's diff."""
        lora_of = self.lora_of
        for rid in out.finished_req_ids:
            lora_of.pop(rid, None)
        for new in out.scheduled_new_reqs:
            if new.lora_request is not None:
                lora_of[new.req_id] = new.lora_request
            else:
                lora_of.pop(new.req_id, None)

    def _track_images(self, out: SchedulerOutput) -> None:
        """Which images each live request's prompt holds, from the step's diff."""
        for rid in out.finished_req_ids:
            self.images_of.pop(rid, None)
        for new in out.scheduled_new_reqs:
            if new.mm_inputs:
                self.images_of[new.req_id] = list(new.mm_inputs)

    def _run_encoder(self, out: SchedulerOutput) -> None:
        """Drop the entries the scheduler let go, then encode the step's new images, all in
        one batch through the vision tower."""
        for h in out.free_encoder_hashes:
            self.encoder_cache.pop(h, None)
        todo = [self.images_of[rid][i] for rid, idx in out.encoder_inputs.items() for i in idx]
        if not todo:
            return
        pixels = torch.stack(
            [torch.frombuffer(bytearray(im.pixels), dtype=torch.float32).view(im.shape) for im in todo]
        ).to(self.device)
        embeds = self.model.embed_images(pixels)  # type: ignore[attr-defined]
        for im, e in zip(todo, embeds):
            self.encoder_cache[im.hash] = e
        for rid, idx in out.encoder_inputs.items():  # encoded: the pixels are not needed again
            images = self.images_of[rid]
            for i in idx:
                images[i] = msgspec.structs.replace(images[i], pixels=b"")

    def _image_embeds(self, step: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows of the flat batch, their embeddings) for the step's image placeholders."""
        rows: list[torch.Tensor] = []
        parts: list[torch.Tensor] = []
        flat = 0
        for rid, q, seq_len in zip(step.req_ids, step.query_lens, step.seq_lens_list):
            start = seq_len - q
            for im in self.images_of.get(rid, ()):
                if im.overlaps(start, seq_len):
                    lo, hi = max(im.offset, start), min(im.offset + im.length, seq_len)
                    parts.append(self.encoder_cache[im.hash][lo - im.offset : hi - im.offset])
                    rows.append(torch.arange(flat + lo - start, flat + hi - start))
            flat += q
        if not rows:
            return None
        return torch.cat(rows).to(self.device), torch.cat(parts)

    def _map_lora_rows(self, step: Any) -> dict[str, str]:
        """Each token's adapter slot for this step, the adapters it needs written into slots
        first; requests whose adapter cannot be read run without it and are named with why
        (the scheduler fails them and drops their tokens)."""
        assert self.lora is not None
        lora_of = self.lora_of
        used = {lora_of[rid] for rid in step.req_ids if rid in lora_of}
        slots, failed = self.lora.slots_for(used) if used else ({}, {})
        errors: dict[str, str] = {}
        rows: list[int] = []
        for rid, q in zip(step.req_ids, step.query_lens):
            req = lora_of.get(rid)
            lid = req.lora_int_id if req is not None else 0
            if lid in failed:
                errors[rid] = failed[lid]
            rows += [slots.get(lid, -1)] * q
        self.lora.ctx.set_rows(rows)
        return errors

    def _execute_pooling(
        self, out: SchedulerOutput, step: Any, meta: AttentionMetadata, t0: float, t1: float
    ) -> ModelRunnerOutput:
        """A pooling step: the forward pass, then each request's pooling state advanced by its
        positions, and the vectors of the requests whose prompt this step completed."""
        assert self.pooler is not None
        states = self.pooling
        for new in out.scheduled_new_reqs:  # new, or rebuilt after preemption: start over
            assert new.pooling_params is not None, (
                f"request {new.req_id} reached a pooling model without pooling params"
            )
            states[new.req_id] = PoolingState(new.pooling_params)
        starts = [s - q for s, q in zip(step.seq_lens_list, step.query_lens)]
        kwargs = {}
        types = [states[rid].params.token_type_ids for rid in step.req_ids]
        if any(t is not None for t in types):
            flat: list[int] = []
            for t, first, q in zip(types, starts, step.query_lens):
                flat += t[first : first + q] if t is not None else [0] * q
            kwargs["token_type_ids"] = torch.tensor(flat, dtype=torch.long, device=self.device)
        hidden = self.model(step.input_ids, step.positions, self.kv_caches, meta, **kwargs)
        t2 = time.perf_counter()
        kind = self.pooler.config.pooling_type
        done: list[str] = []
        offset = 0
        for i, rid in enumerate(step.req_ids):
            q = step.query_lens[i]
            states[rid].add(hidden[offset : offset + q], starts[i], kind)
            offset += q
            if step.sample_mask[i]:
                done.append(rid)
        pooled = dict(zip(done, self.pooler.finish([states.pop(rid) for rid in done]))) if done else {}
        ready, errors = self.grammars.collect()
        t3 = time.perf_counter()
        return ModelRunnerOutput(
            req_ids=step.req_ids,
            sampled_token_ids=[[] for _ in step.req_ids],
            worker_times=[t1 - t0, t2 - t1, t3 - t2],
            grammars_ready=ready,
            grammar_errors=errors,
            pooled=pooled,
        )

    def _verify(
        self,
        out: SchedulerOutput,
        step: Any,
        hidden: torch.Tensor,
        sample_idx: list[int],
        sampled_ids: list[list[int]],
        logprobs: dict[str, LogprobsLists],
    ) -> None:
        """A step with drafts: one sampling row per verified position (aiolm/sample/rejection.py);
        each request gets its accepted drafts plus one token."""
        b = self.batch
        nd = step.num_drafts
        ends = [int(e) for e in step.query_start_loc[1:].tolist()]
        idx = torch.tensor(verify_positions(sample_idx, ends, nd), device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, idx))
        spec = out.scheduled_spec_decode_tokens
        params, outputs, prompts, gens = [], [], [], []
        for i in sample_idx:
            r = int(step.rows[i])
            p = b.params[r]
            drafts = spec.get(step.req_ids[i], [])
            prompt = b.prompt_tokens(r).tolist() if logits_processors.needs_prompt(p) else []  # type: ignore[arg-type]
            for hist in row_histories(b.output_tokens(r).tolist(), drafts):
                params.append(p)
                outputs.append(hist)
                prompts.append(prompt)
                gens.append(b.generators[r])
        meta = SamplingMetadata.build(
            params,
            outputs,
            prompts,
            self.vocab_size,
            self.device,  # type: ignore[arg-type]
            generators=gens,
            default_generator=self.default_generator,
        )
        self._meta_key = None  # the rows were per position: the next step builds afresh
        result = self.sampler(logits, meta)
        tokens = result.sampled.tolist()
        lp = result.logprobs
        j = 0
        for i in sample_idx:
            drafts = spec.get(step.req_ids[i], [])
            a = accepted_prefix(tokens[j : j + len(drafts)], drafts)
            sampled_ids[i] = tokens[j : j + a + 1]
            if lp is not None and lp.token_ids[j]:
                logprobs[step.req_ids[i]] = lp.slice(j, j + a + 1)
            j += nd[i] + 1

    def _prompt_logprobs(self, step: Any, hidden: torch.Tensor) -> dict[str, PromptLogprobs]:
        """For requests that asked, the prompt tokens this step's positions predict."""
        out: dict[str, PromptLogprobs] = {}
        b = self.batch
        for i, rid in enumerate(step.req_ids):
            params = b.params[int(step.rows[i])]
            if params is None or params.prompt_logprobs is None:
                continue
            q = step.query_lens[i]
            first = step.seq_lens_list[i] - q
            start = int(sum(step.query_lens[:i]))
            plp = score_prompt(
                self.model.compute_logits,
                hidden,
                start,
                first,
                q,
                b.prompt_tokens(int(step.rows[i])).tolist(),
                params.prompt_logprobs,
            )
            if plp is not None:
                out[rid] = plp
        return out

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
            [
                b.prompt_tokens(r).tolist() if logits_processors.needs_prompt(p) else []  # type: ignore[arg-type]
                for r, p in zip(rows, params)
            ],
            self.vocab_size,
            self.device,
            generators=[b.generators[r] for r in rows],
            default_generator=self.default_generator,
        )
        self._meta_key = key
        return self._meta

    def uses_cuda_graphs(self) -> bool:
        """Whether decode steps will replay CUDA graphs (the memory profile leaves them room)."""
        attn = self.model.layers[self.layer_ids[0]].self_attn.attn
        return (
            self.device.type == "cuda"
            and not self.cfg.enforce_eager
            and self.stage.size == 1  # a stage's graphs would need its input buffers captured too
            and getattr(attn, "cuda_graph_safe", False)
        )

    def _capture_graphs(self) -> CudaGraphRunner | None:
        """On CUDA, decode steps of up to ``max_cudagraph_size`` rows replay captured graphs
        (worker/cuda_graph.py), when the attention backend can be captured."""
        cfg = self.cfg
        if self.pooler is not None or not self.uses_cuda_graphs():  # graphs replay decode steps only
            return None
        sizes = capture_sizes(cfg.max_num_seqs, cfg.max_cudagraph_size)
        graphs = CudaGraphRunner(
            lambda ids, pos, meta: self.model(ids, pos, self.kv_caches, meta),
            sizes,
            self.batch.max_blocks,
            cfg.block_size,
            cfg.max_model_len,
            self.device,
        )
        t0, before = time.perf_counter(), torch.cuda.memory_allocated(self.device)
        if self.lora is not None:  # the LoRA kernels go into the graphs, reading the slot buffer
            self.lora.ctx.active = True
        graphs.capture()
        if self.lora is not None:
            self.lora.ctx.set_rows([])
        log.info(
            "captured CUDA graphs for %d decode sizes (1..%d) in %.1fs, %.0f MiB",
            len(sizes),
            sizes[-1],
            time.perf_counter() - t0,
            (torch.cuda.memory_allocated(self.device) - before) / 2**20,
        )
        return graphs

    def kv_cache_info(self) -> dict[str, int]:
        """The pool's size, and one block's bytes on this rank (every layer's K and V)."""
        block_bytes = sum(kv[:, 0].numel() * kv.element_size() for kv in self.kv_caches)
        return {"num_blocks": self.num_blocks, "block_size": self.cfg.block_size, "block_bytes": block_bytes}

    def close(self) -> None:
        """Let the KV connector finish its writes (a worker exiting normally)."""
        if self.kv_connector is not None:
            self.kv_connector.close()

    def take_expert_counts(self) -> list[list[int]]:
        """Tokens routed to each expert of each layer of experts since the last call
        ([layer][expert]; empty for a dense model): what expert placement is balanced by."""
        take = getattr(self.model, "take_expert_counts", None)
        return take().tolist() if take is not None else []


def call_on_runner(
    runner: ModelRunner, method: str | Callable[..., Any], args: tuple = (), kwargs: dict[str, Any] | None = None
) -> Any:
    """One rank's part of collective_rpc: a runner method by name, or fn(runner, ...)."""
    if callable(method):
        return method(runner, *args, **(kwargs or {}))
    return getattr(runner, method)(*args, **(kwargs or {}))
