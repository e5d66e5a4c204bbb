"""Speculative decoding through the real scheduler and model runner on a tiny random Llama.

A small vocabulary makes n-gram drafts frequent and both outcomes (accepted and
rejected) common, and a step costs milliseconds, so the sampling test can draw
thousands of sequences. Greedy output must equal plain decoding token for token
(with chunked prefill, prefix hits, preemption and per-position logits
processors in play); sampled output must have the same distribution.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools

import pytest
import torch

from aiolm.config import RunnerConfig
from aiolm.core.request import Request
from aiolm.core.scheduler import Scheduler, SchedulerConfig
from aiolm.params import SamplingParams
from aiolm.spec_decode import NgramProposer, SpecConfig

VOCAB = 16
BLOCK = 4
MAX_MODEL_LEN = 64
_RUNS = itertools.count()


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from aiolm.worker.model_runner import ModelRunner

    path = tmp_path_factory.mktemp("tiny_llama_spec")
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=MAX_MODEL_LEN,
            tie_word_embeddings=False,
        )
    )
    with torch.no_grad():  # spread-out logits: no near-ties for greedy, no near-uniform sampling
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.5)
    model.float().eval().save_pretrained(path)
    per_block = 2 * BLOCK * 1 * 16 * 2 * 4  # K and V, block, kv heads, head dim, layers, float32
    cfg = RunnerConfig(
        model=str(path),
        dtype="float32",
        max_num_seqs=256,
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK,
        kv_cache_memory=4096 * per_block,
        num_threads=1,
        structured_outputs=False,
    )
    return ModelRunner(cfg)


def drive(
    runner,
    prompts: list[list[int]],
    params: list[SamplingParams],
    spec: SpecConfig | None,
    num_blocks: int | None = None,
    budget: int = 512,
    threshold: int = 0,
) -> dict:
    """The engine core's loop on the real runner; everything arrives at once."""
    sched = Scheduler(
        SchedulerConfig(
            num_blocks=num_blocks or runner.num_blocks,
            block_size=BLOCK,
            max_num_seqs=256,
            max_model_len=MAX_MODEL_LEN,
            max_num_batched_tokens=budget,
            long_prefill_token_threshold=threshold,
            hash_seed=0,
            speculative=spec,
        )
    )
    ids = [f"{next(_RUNS)}-{i}" for i in range(len(prompts))]  # unique, as the engine's are
    for rid, p, sp in zip(ids, prompts, params):
        sched.add_request(Request(rid, p, sp))
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    logprobs: dict[str, list[float]] = collections.defaultdict(list)
    preempted = 0
    for _ in range(5000):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        preempted += sum(1 for rid in so.finished_req_ids if rid in sched.requests)
        runner_output = runner.execute(so)
        for out in sched.update_from_output(so, runner_output):
            assert out.error is None, out.error
            tokens[out.req_id].extend(out.new_token_ids)
            if out.new_logprobs is not None:
                logprobs[out.req_id].extend(lp[0] for lp in out.new_logprobs.logprobs)
    assert not sched.has_unfinished_requests()
    runner.execute(sched.schedule())  # an empty step that tells the runner who finished
    assert len(runner.batch) == 0
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks and kv.check_invariants() == []
    return {
        "tokens": [tokens[rid] for rid in ids],
        "stats": sched.spec_decode_stats,
        "preempted": preempted,
        "logprobs": [logprobs[rid] for rid in ids],
    }


SPEC = SpecConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3, search_window=64)
PROMPTS = [
    [1, 2, 3, 4, 1, 2, 3],
    [5, 6, 7, 5, 6, 7, 5, 6],
    list(range(16)) + [3, 4, 5],
    [9, 9, 9, 9],
    [2, 11, 13, 2, 11, 13, 2, 11, 13, 2, 11, 13, 2],
    [7, 1, 7, 1, 7, 1, 7],
]


def test_greedy_same_tokens_with_chunked_prefill_prefix_hits_and_preemption(runner):
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True) for _ in PROMPTS]
    # A small pool (preemption), a small budget and a per-request cap (chunked prefill),
    # prompts sharing blocks (prefix hits): the paths a draft must survive.
    kw = dict(num_blocks=40, budget=12, threshold=6)
    prompts = PROMPTS + [PROMPTS[4] + [3]]
    plain = drive(runner, prompts, params + params[:1], None, **kw)
    spec = drive(runner, prompts, params + params[:1], SPEC, **kw)
    assert spec["tokens"] == plain["tokens"]
    st = spec["stats"]
    assert st.num_accepted_tokens > 0 and st.num_accepted_tokens < st.num_draft_tokens, st
    assert plain["preempted"] > 0 and spec["preempted"] > 0


def test_logits_processors_apply_at_every_position(runner):
    """Penalties, bias, bad words and min_tokens see each draft position's own history."""
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=30,
            min_tokens=5,
            eos_token_ids=(3,),
            logprobs=2,
            repetition_penalty=1.3,
            frequency_penalty=0.2,
            presence_penalty=0.1,
            logit_bias={4: 1.5},
            bad_words_token_ids=[[7, 1]],
        )
        for _ in PROMPTS
    ]
    plain = drive(runner, PROMPTS, params, None)
    spec = drive(runner, PROMPTS, params, SPEC)
    assert spec["tokens"] == plain["tokens"]
    assert spec["stats"].num_accepted_tokens > 0
    for a, b in zip(spec["logprobs"], plain["logprobs"]):
        assert a == pytest.approx(b, abs=1e-4)


def test_sampling_keeps_the_distribution(runner):
    """Empirical frequencies of output tokens 1..3 (verified by drafts) with and without
    speculation: a two-sample chi-square per position stays below the 0.1% critical value."""
    n = 1500
    # The model's own greedy text as the prompt: drafts copied from it are likely tokens,
    # so acceptances and rejections are both common.
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    seed = list(range(VOCAB))  # every token occurs, so every step has a match and drafts
    prompt = seed + drive(runner, [seed], [greedy], None)["tokens"][0]
    sp = SamplingParams(temperature=1.0, top_k=12, max_tokens=4, ignore_eos=True, frequency_penalty=0.3)
    spec_cfg = dataclasses.replace(SPEC, min_acceptance=0.0)  # never pause: every step verifies
    runner.default_generator.manual_seed(1)
    plain = drive(runner, [prompt] * n, [sp] * n, None)["tokens"]
    runner.default_generator.manual_seed(2)
    res = drive(runner, [prompt] * n, [sp] * n, spec_cfg)
    spec = res["tokens"]
    st = res["stats"]
    assert st.num_drafts > n and 0.1 < st.acceptance_rate < 0.9, st.summary()
    critical = 37.7  # chi-square, 15 degrees of freedom, p = 0.001
    for pos in (1, 2, 3):
        a = collections.Counter(t[pos] for t in plain)
        b = collections.Counter(t[pos] for t in spec)
        chi2 = sum((a[v] - b[v]) ** 2 / (a[v] + b[v]) for v in range(VOCAB) if a[v] + b[v])
        assert chi2 < critical, (pos, chi2, a, b)
    # And the test can tell: taking the first draft unverified shifts position 1 far off.
    proposer = NgramProposer(1, SPEC.prompt_lookup_min, SPEC.prompt_lookup_max, SPEC.search_window)
    truth = collections.Counter(t[1] for t in plain)
    copied = collections.Counter(proposer.propose(prompt + t[:1])[0] for t in plain)
    chi2 = sum((truth[v] - copied[v]) ** 2 / (truth[v] + copied[v]) for v in range(VOCAB) if truth[v] + copied[v])
    assert chi2 > 3 * critical, chi2
