"""Property tests: random add / step / abort programs against a small block pool.

After every step the scheduler, the KV cache and the simulated workers must
agree; at the end every request finishes and every block is free again.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from aiolm.core.kv_cache import BlockHasher
from aiolm.core.request import Request
from aiolm.kv_transfer.offload_scheduler import OffloadScheduler
from aiolm.spec_decode import SpecConfig
from aiolm.structured.spec import StructuredOutputs

from .sim import BAD_GRAMMAR, Driver, WorkerSim, check_scheduler, make_request, make_scheduler

# A few shared prefixes so prefix-cache hits, sharing and eviction all happen.
PREFIXES = [list(range(1, 13)), list(range(20, 29)), [5] * 8]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(8, 20),
        budget=st.integers(1, 24),
        max_num_seqs=st.integers(1, 6),
        threshold=st.sampled_from([0, 0, 3, 8]),
        policy=st.sampled_from(["fcfs", "priority"]),
        caching=st.booleans(),
        seed=st.integers(0, 2**16),
        num_spec=st.sampled_from([0, 0, 1, 3]),
        offload=st.sampled_from([None, (0, 6), (4, 0), (3, 10)]),
    )
    def setup(self, num_blocks, budget, max_num_seqs, threshold, policy, caching, seed, num_spec, offload):
        # Speculation with short n-grams over a small vocabulary: drafts, partial acceptance,
        # adaptive pauses and lookahead pressure on the small pool all happen.
        speculative = (
            SpecConfig(
                num_speculative_tokens=num_spec,
                prompt_lookup_min=1,
                prompt_lookup_max=3,
                search_window=16,
                window=2,
                min_acceptance=0.5,
                backoff=2,
            )
            if num_spec
            else None
        )
        self.sched = make_scheduler(
            num_blocks=num_blocks,
            block_size=4,
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            long_prefill_token_threshold=threshold,
            policy=policy,
            enable_prefix_caching=caching,
            max_model_len=48,
            speculative=speculative,
            # A KV connector's host and disk tiers (in blocks) keep evicted prefixes; a fifth
            # of its loads find a block corrupt.
            connector=OffloadScheduler(*offload) if offload and caching else None,
        )
        self.driver = Driver(self.sched, seed=seed, eos_prob=0.15)
        self.driver.worker.corrupt = 0.2
        self.next_id = 0
        self.added: set[str] = set()
        self.bad_grammar: set[str] = set()

    @rule(
        prefix=st.integers(0, len(PREFIXES)),
        suffix=st.lists(st.integers(1, 40), max_size=14),
        max_tokens=st.one_of(st.none(), st.integers(1, 12)),
        min_tokens=st.integers(0, 3),
        priority=st.integers(0, 3),
        ignore_eos=st.booleans(),
        grammar=st.sampled_from([None, None, StructuredOutputs("regex", "[a-z]+"), BAD_GRAMMAR]),
    )
    def add(self, prefix, suffix, max_tokens, min_tokens, priority, ignore_eos, grammar):
        prompt = (PREFIXES[prefix] if prefix < len(PREFIXES) else []) + suffix
        if not prompt or len(prompt) > 47:
            return
        if max_tokens is not None:
            min_tokens = min(min_tokens, max_tokens)
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.sched.add_request(
            make_request(
                rid,
                prompt,
                max_tokens=max_tokens,
                min_tokens=min_tokens,
                priority=priority,
                arrival_time=float(self.next_id),
                ignore_eos=ignore_eos,
                structured_outputs=grammar,
            )
        )
        self.added.add(rid)
        if grammar == BAD_GRAMMAR:
            self.bad_grammar.add(rid)

    @rule()
    def step(self):
        self.driver.step()

    @precondition(lambda self: bool(self.sched.requests))
    @rule(extra_blocks=st.integers(-2, 4), mid_step=st.booleans())
    def replace_workers(self, extra_blocks, mid_step):
        """The worker set failed (during a step, or between steps) and a new one took over:
        no KV survived, every live request is recomputed, and no token is lost or repeated."""
        lost = self.sched.schedule() if mid_step else None  # its results never come back
        num_blocks = max(4, self.sched.config.num_blocks + extra_blocks)
        self.sched.reset_workers(num_blocks)
        old = self.driver.worker  # a connector's disk tier outlives the workers
        self.driver.worker = WorkerSim(block_size=self.sched.config.block_size, disk=old.disk, corrupt=old.corrupt)
        assert self.sched.num_running == 0 and self.sched.kv_cache_manager.usage == 0.0
        for rid, req in self.sched.requests.items():
            assert req.num_computed_tokens == 0
            assert req.output_token_ids == self.driver.outputs.get(rid, [])
        if lost is not None:  # as the engine core does: report what schedule() finished by itself
            self.driver.record(self.sched.update_from_output(lost, None))
        check_scheduler(self.sched)

    @precondition(lambda self: bool(self.sched.requests))
    @rule(pick=st.integers(0, 10**6))
    def abort(self, pick):
        ids = sorted(self.sched.requests)
        rid = ids[pick % len(ids)]
        outs = self.sched.abort_requests([rid])
        assert [o.finish_reason for o in outs] == ["abort"]
        self.driver.record(outs)
        assert rid not in self.sched.kv_cache_manager.req_to_blocks
        check_scheduler(self.sched)

    @invariant()
    def consistent(self):
        if hasattr(self, "sched"):
            check_scheduler(self.sched)

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        self.driver.drain(max_steps=3000)
        stats = self.sched.spec_decode_stats
        if stats is not None:
            assert stats.num_accepted_tokens <= stats.num_draft_tokens
            assert sum(stats.drafted_per_position) == stats.num_draft_tokens
        assert set(self.driver.finished) == self.added
        if self.sched.connector is not None:
            assert not self.sched.loading and not self.sched.kv_cache_manager.leases
        for rid, out in self.driver.finished.items():
            assert out.finish_reason in ("stop", "length", "abort", "error")
            failed = out.finish_reason == "error" and "grammar" in (out.error or "")
            assert failed == (rid in self.bad_grammar and out.finish_reason != "abort"), (rid, out)
            if failed:
                assert not out.new_token_ids and "unbalanced parenthesis" in out.error


SchedulerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestScheduler = SchedulerMachine.TestCase


@settings(max_examples=50, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 9), max_size=40),
    chunks=st.lists(st.integers(1, 7), min_size=1, max_size=10),
    salt=st.one_of(st.none(), st.text(max_size=3)),
)
def test_incremental_hashing_matches_one_shot(tokens, chunks, salt):
    hasher = BlockHasher(4, seed=1)
    prompt, rest = tokens[:5] or [1], tokens[5:]
    inc = Request("i", prompt, make_request("x", 1).sampling_params, cache_salt=salt)
    inc.set_block_hasher(hasher, 4)
    rng = random.Random(len(tokens))
    while rest:
        k = chunks[rng.randrange(len(chunks))]
        inc.append_output_token_ids(rest[:k])
        rest = rest[k:]
    whole = Request("w", inc.all_token_ids, inc.sampling_params, cache_salt=salt)
    whole.set_block_hasher(hasher, 4)
    assert inc.block_hashes == whole.block_hashes
    assert len(inc.block_hashes) == inc.num_tokens // 4
