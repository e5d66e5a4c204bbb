"""Test helpers: build requests and schedulers, and a worker simulator.

The simulator keeps only what real workers keep (per request: tokens, block ids,
computed count), rebuilt purely from SchedulerOutput diffs, and checks after
every step that it equals the scheduler's truth. That proves the diff protocol.
It also compiles grammars the way a worker does: announced in one step, done
some steps later (a regex "(" fails), and a request with a grammar must not
arrive before its grammar is compiled on this worker.

It models what the KV cache *holds*: each block's slots get the tokens a step
computes into them, and a request that arrives with computed tokens (a prefix-cache
hit, a KV connector load) must find its own tokens there. A KV connector's tiers
(``kv_ops``) are copies of block contents under their hashes: saved before the step
writes anything, loaded at the start of the next step (as aiolm/kv_transfer/
offload_worker.py does: a load lands at the start of a later step, one to three
steps on), and reported then; ``corrupt`` is the chance that a load finds a block
bad, which must cost only recomputation.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from aiolm.core.request import Request, RequestStatus
from aiolm.core.scheduler import Scheduler, SchedulerConfig
from aiolm.core.step import ModelRunnerOutput, SchedulerOutput
from aiolm.kv_transfer.base import ConnectorScheduler
from aiolm.params import SamplingParams
from aiolm.structured.spec import StructuredOutputs

EOS = 0
BAD_GRAMMAR = StructuredOutputs("regex", "(")  # the simulated worker fails to compile it


def make_request(
    req_id: str,
    prompt: list[int] | int,
    max_tokens: int | None = 16,
    priority: int = 0,
    arrival_time: float | None = None,
    cache_salt: str | None = None,
    **sp_kwargs,
) -> Request:
    """A request whose prompt is ``prompt`` or, for an int, that many tokens 1..n."""
    tokens = list(range(1, prompt + 1)) if isinstance(prompt, int) else list(prompt)
    sp_kwargs.setdefault("eos_token_ids", (EOS,))
    sp = SamplingParams(max_tokens=max_tokens, **sp_kwargs)
    return Request(req_id, tokens, sp, arrival_time=arrival_time, priority=priority, cache_salt=cache_salt)


def make_scheduler(connector: ConnectorScheduler | None = None, **kwargs) -> Scheduler:
    kwargs.setdefault("num_blocks", 64)
    kwargs.setdefault("block_size", 4)
    kwargs.setdefault("hash_seed", 0)
    return Scheduler(SchedulerConfig(**kwargs), connector)


@dataclass
class WorkerRequest:
    tokens: list[int]
    block_ids: list[int]
    num_computed: int


@dataclass
class WorkerSim:
    """A model runner's persistent batch, fed only by diffs."""

    reqs: dict[str, WorkerRequest] = field(default_factory=dict)
    seen_new: list[str] = field(default_factory=list)
    block_size: int = 4
    compiling: dict[str, StructuredOutputs] = field(default_factory=dict)  # req_id -> grammar
    compiled: set[str] = field(default_factory=set)  # requests whose grammar this worker holds
    content: dict[int, list[int | None]] = field(default_factory=dict)  # block id -> its slots' tokens
    host: dict[bytes, list[int | None]] = field(default_factory=dict)  # the connector's tiers
    disk: dict[bytes, list[int | None]] = field(default_factory=dict)
    loads: list[tuple[int, list[int], list[list[int | None]], int]] = field(default_factory=list)
    loaded: dict[int, int] = field(default_factory=dict)
    corrupt: float = 0.0
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def _slots(self, block_id: int) -> list[int | None]:
        return self.content.setdefault(block_id, [None] * self.block_size)

    def _transfer(self, so: SchedulerOutput) -> None:
        """The connector's part of a step: last step's loads land, then this step's ops."""
        landing = [load for load in self.loads if load[3] <= 0]
        self.loads = [(i, b, d, steps - 1) for i, b, d, steps in self.loads if steps > 0]
        for load_id, block_ids, blocks, _ in landing:
            intact = len(blocks)
            if intact and self.rng.random() < self.corrupt:
                intact = self.rng.randrange(intact)
            for b, data in zip(block_ids, blocks[:intact]):
                self.content[b] = list(data)
            self.loaded[load_id] = intact
        ops = so.kv_ops
        if ops is None:
            return
        for b, h in zip(ops.save_block_ids, ops.save_hashes):
            self.host[h] = self.disk[h] = list(self._slots(b))
        for h in ops.drop_host:
            self.host.pop(h, None)
        for h in ops.drop_disk:
            self.disk.pop(h, None)
        for load_id, hashes, block_ids in zip(ops.load_ids, ops.load_hashes, ops.load_block_ids):
            blocks = []
            for h in hashes:
                data = self.host.get(h, self.disk.get(h))
                if data is None:
                    break
                blocks.append(data)
            self.loads.append((load_id, block_ids, blocks, self.rng.randrange(3)))

    def finished_loads(self) -> dict[int, int]:
        loaded, self.loaded = self.loaded, {}
        return loaded

    def apply(self, so: SchedulerOutput) -> list[str]:
        """Apply one step's diff; return the ids whose prefill is complete (they sample)."""
        self._transfer(so)
        for rid in so.finished_req_ids:
            self.reqs.pop(rid, None)
        new_ids = [nr.req_id for nr in so.scheduled_new_reqs]
        cached_ids = list(so.scheduled_cached_reqs.req_ids)
        assert not set(new_ids) & set(cached_ids), "a request is both new and cached"
        assert len(set(new_ids + cached_ids)) == len(new_ids) + len(cached_ids)
        assert set(new_ids + cached_ids) == set(so.num_scheduled_tokens)
        for rid, grammar in so.grammars.items():
            assert rid not in self.compiling and rid not in self.compiled, f"{rid}: grammar sent twice"
            self.compiling[rid] = grammar
        for nr in so.scheduled_new_reqs:
            assert nr.req_id not in self.reqs, f"{nr.req_id} re-sent as new while held"
            if nr.sampling_params.structured_outputs is not None:
                assert nr.req_id in self.compiled, f"{nr.req_id} scheduled before its grammar compiled"
            self.reqs[nr.req_id] = WorkerRequest(
                list(nr.prompt_token_ids) + list(nr.output_token_ids), list(nr.block_ids), nr.num_computed_tokens
            )
            self.seen_new.append(nr.req_id)
            held = self.reqs[nr.req_id]
            for pos in range(nr.num_computed_tokens):  # a cached or loaded prefix holds its tokens
                slots = self._slots(held.block_ids[pos // self.block_size])
                assert slots[pos % self.block_size] == held.tokens[pos], f"{nr.req_id}: cached token {pos} is wrong"
        c = so.scheduled_cached_reqs
        for rid, toks, blks, ncomp in zip(c.req_ids, c.new_token_ids, c.new_block_ids, c.num_computed_tokens):
            st = self.reqs[rid]
            assert st.num_computed == ncomp, f"{rid}: worker computed {st.num_computed}, told {ncomp}"
            st.tokens.extend(toks)
            st.block_ids.extend(blks)
        sampling = []
        draft_tokens = so.scheduled_spec_decode_tokens
        for rid, n in so.num_scheduled_tokens.items():
            st = self.reqs[rid]
            drafts = draft_tokens.get(rid, [])
            assert n >= 1
            assert not drafts or st.num_computed == len(st.tokens) - 1, f"{rid} drafts outside decode"
            assert st.num_computed + n <= len(st.tokens) + len(drafts), f"{rid} scheduled past its tokens"
            assert len(st.block_ids) * self.block_size >= st.num_computed + n, f"{rid} lookahead not reserved"
            known = st.tokens + drafts
            for pos in range(st.num_computed, st.num_computed + n):
                self._slots(st.block_ids[pos // self.block_size])[pos % self.block_size] = known[pos]
            st.num_computed += n
            if st.num_computed >= len(st.tokens):
                sampling.append(rid)
        return sampling

    def reject(self, rid: str, num_rejected: int) -> None:
        """The next step's diff sets the real worker's computed count; mirror the rollback."""
        self.reqs[rid].num_computed -= num_rejected

    def finish_compiles(self, rng: random.Random) -> tuple[list[str], dict[str, str]]:
        """Some of the grammars in flight finish now: (ready, errors) for ModelRunnerOutput."""
        ready, errors = [], {}
        for rid in sorted(self.compiling):
            if rng.random() < 0.5:
                if self.compiling.pop(rid) == BAD_GRAMMAR:
                    errors[rid] = "invalid regex: unbalanced parenthesis"
                else:
                    ready.append(rid)
                    self.compiled.add(rid)
        return ready, errors

    def check(self, sched: Scheduler, so: SchedulerOutput) -> None:
        """The worker view must equal the scheduler's truth for every running request."""
        assert set(self.reqs) == {r.req_id for r in sched.running}
        kv = sched.kv_cache_manager
        for rid in so.num_scheduled_tokens:
            st = self.reqs[rid]
            req = sched.requests[rid]
            assert st.tokens == req.all_token_ids, rid
            assert st.block_ids == kv.get_block_ids(rid), rid
            assert st.num_computed == req.num_computed_tokens, rid
            assert len(st.block_ids) * kv.block_size >= st.num_computed


def fake_output(
    sampling: list[str],
    rng: random.Random | None = None,
    eos_prob: float = 0.0,
    vocab: int = 50,
    token: int | None = None,
    draft_tokens: dict[str, list[int]] | None = None,
) -> ModelRunnerOutput:
    """One sampled token per request that finished its prefill; the rest get [].
    A request with drafts (``draft_tokens``) gets a random number of them accepted, then one token."""
    rng = rng or random.Random(0)
    toks = []
    for rid in sampling:
        if token is not None:
            tok = token
        elif rng.random() < eos_prob:
            tok = EOS
        else:
            tok = rng.randrange(1, vocab)
        drafts = draft_tokens.get(rid, []) if draft_tokens else []
        toks.append(drafts[: rng.randint(0, len(drafts))] + [tok])
    return ModelRunnerOutput(req_ids=list(sampling), sampled_token_ids=toks)


def check_scheduler(sched: Scheduler, so: SchedulerOutput | None = None) -> None:
    """Global invariants of scheduler + KV cache after a step."""
    kv = sched.kv_cache_manager
    cfg = sched.config
    assert kv.check_invariants() == []
    running_ids = [r.req_id for r in sched.running]
    waiting_ids = [r.req_id for r in sched.waiting]
    awaiting_ids = set(sched.awaiting_grammar)
    loading_ids = set(sched._load_of)
    assert len(set(running_ids)) == len(running_ids)
    assert not set(running_ids) & set(waiting_ids)
    assert not (set(running_ids) | set(waiting_ids)) & awaiting_ids
    assert not (set(running_ids) | set(waiting_ids) | awaiting_ids) & loading_ids
    assert set(running_ids) | set(waiting_ids) | awaiting_ids | loading_ids == set(sched.requests)
    assert sched.num_waiting == len(waiting_ids) + len(awaiting_ids) + len(loading_ids)
    for load_id in sched._load_of.values():
        load = sched.loading[load_id]
        assert load.request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert len(kv.get_blocks(load.request.req_id)) == load.start + load.asked
    load_leases = {k for k in kv.leases if k.startswith("load-")}
    assert load_leases == {f"load-{i}" for i, load in sched.loading.items() if load.request.is_finished}
    sends = getattr(sched.connector, "sends", {})
    assert set(kv.leases) - load_leases == {f"send-{t}" for t in sends}
    for r in sched.awaiting_grammar.values():
        assert r.status == RequestStatus.WAITING_FOR_GRAMMAR and r.sampling_params.structured_outputs is not None
        assert r.req_id not in kv.req_to_blocks and r.num_computed_tokens == 0
    assert len(running_ids) <= cfg.max_num_seqs
    holding = {r.req_id for r in sched.loaded_waiting}
    assert holding <= set(waiting_ids)
    assert set(kv.req_to_blocks) <= set(running_ids) | loading_ids | holding
    draft_tokens = so.scheduled_spec_decode_tokens if so is not None else {}
    for r in sched.running:
        assert r.status == RequestStatus.RUNNING
        assert len(kv.get_blocks(r.req_id)) * kv.block_size >= r.num_computed_tokens
        # Between steps only accepted tokens count; right after schedule() drafts do too.
        # Overlap: tokens sampled by steps in flight are computed before they are known.
        assert r.num_computed_tokens <= r.num_tokens + len(draft_tokens.get(r.req_id, ())) + r.num_output_placeholders
        assert r.num_output_placeholders <= 2
    for r in sched.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        # Back from a KV load: it holds blocks for what arrived, and computes the rest.
        assert r.num_computed_tokens == 0 or (r in sched.loaded_waiting and r.num_computed_tokens < r.num_tokens)
        assert len(kv.get_blocks(r.req_id)) * kv.block_size >= r.num_computed_tokens
    assert kv.num_free_blocks + sum(1 for b in kv.pool.blocks[1:] if b.ref_cnt) == kv.num_usable_blocks
    if so is not None:
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        assert so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(so.num_scheduled_tokens) <= cfg.max_num_seqs
        if so.total_num_scheduled_tokens < cfg.max_num_batched_tokens:
            # Work conservation: with budget left, no running request is skipped.
            for r in sched.running:
                ph = r.num_output_placeholders
                assert (
                    r.req_id in so.num_scheduled_tokens
                    or r.num_computed_tokens == r.num_tokens + ph
                    or len(r.output_token_ids) + ph >= r.max_tokens
                    or r.num_tokens + ph >= cfg.max_model_len
                    or (ph and len(sched.running) == 1)
                    # a pipeline: its token is in flight, or this step took its share of the running
                    or (
                        cfg.pipeline_depth > 1
                        and (
                            ph > 0
                            or len(so.scheduled_cached_reqs) * cfg.pipeline_depth
                            >= len(sched.running) - len(so.scheduled_new_reqs)
                        )
                    )
                    # --max-step-ms: this step's prompt tokens reached their cap
                    or (sched.step_cost is not None and r.num_tokens + ph - r.num_computed_tokens > 1)
                ), (  # alone, out of blocks: awaits its token
                    f"{r.req_id} skipped although budget was left"
                )
        if cfg.long_prefill_token_threshold and cfg.chunked_prefill:
            assert max(so.num_scheduled_tokens.values(), default=0) <= cfg.long_prefill_token_threshold


class Driver:
    """Runs schedule -> worker sim -> fake output -> update, checking everything each step."""

    def __init__(self, sched: Scheduler, seed: int = 0, eos_prob: float = 0.0) -> None:
        self.sched = sched
        self.worker = WorkerSim(block_size=sched.config.block_size)
        self.rng = random.Random(seed)
        self.eos_prob = eos_prob
        self.outputs: dict[str, list] = {}
        self.finished: dict[str, object] = {}
        self.history: list[SchedulerOutput] = []
        # The seconds a simulated worker takes for a step (its forward time), when set.
        self.step_seconds: Callable[[SchedulerOutput], float] | None = None

    def step(self, token: int | None = None):
        so = self.sched.schedule()
        self.history.append(so)
        check_scheduler(self.sched, so)
        sampling = self.worker.apply(so)
        self.worker.check(self.sched, so)
        draft_tokens = so.scheduled_spec_decode_tokens
        runner_output = fake_output(sampling, self.rng, self.eos_prob, token=token, draft_tokens=draft_tokens)
        for rid, toks in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            if rid in draft_tokens:
                self.worker.reject(rid, len(draft_tokens[rid]) + 1 - len(toks))
        runner_output.grammars_ready, runner_output.grammar_errors = self.worker.finish_compiles(self.rng)
        runner_output.kv_loaded = self.worker.finished_loads()
        if self.step_seconds is not None:
            runner_output.worker_times = [0.0, self.step_seconds(so), 0.0]
        outs = self.sched.update_from_output(so, runner_output)
        self.record(outs)
        check_scheduler(self.sched)
        return so, outs

    def record(self, outs) -> None:
        for o in outs:
            assert o.req_id not in self.finished, f"output after finish for {o.req_id}"
            self.outputs.setdefault(o.req_id, []).extend(o.new_token_ids)
            if o.finished:
                self.finished[o.req_id] = o

    def drain(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                break
            self.step()
        assert not self.sched.has_unfinished_requests(), "requests did not finish"
        kv = self.sched.kv_cache_manager
        assert kv.usage == 0.0
        assert kv.num_free_blocks == kv.num_usable_blocks
        assert kv.check_invariants() == []
