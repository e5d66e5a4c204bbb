"""A mixture-of-experts model through the whole engine: worker processes, the scheduler's
chunked prefill, prefix hits and preemption, tensor parallelism with and without expert
parallelism, and the per-expert token counts a balancer reads.

A tiny random Qwen3-MoE (6 experts, top-2, a dense layer among the sparse ones, 6 query
heads over one KV head) gives transformers' greedy tokens with one rank while a small
token budget splits every prompt and a small KV cache forces preemption; 2 and 3 ranks,
slicing every expert or placing whole experts, give the tokens of one rank and route the
same tokens to the same experts.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from engine_harness import ENGINE_ARGS, LoopThread

from aiolm import AsyncEngine, SamplingParams
from aiolm.config import EngineArgs
from aiolm.engine.async_engine import check_model_args
from moe_models import moe_model
from paged import hf_greedy

MAX_NEW = 16
SHAPE = dict(
    num_attention_heads=6, num_key_value_heads=1, num_experts=6, moe_intermediate_size=48, intermediate_size=96
)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory, real_source):
    path = tmp_path_factory.mktemp("tiny_moe")
    hf = moe_model(
        "qwen3_moe", path, vocab_size=real_source.config.vocab_size, tokenizer_from=real_source.path, **SHAPE
    )
    return hf, str(path)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(100, 40000, (40,), generator=g).tolist()  # a common prefix: prefix-cache hits
    tails = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (3, 9, 21, 30)]
    return [shared + t for t in tails]


async def _run(engine: AsyncEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)

    async def one(ids: list[int]) -> list[int]:
        final = None
        async for out in engine.generate({"prompt_token_ids": ids}, params):
            final = out
        assert final is not None
        return list(final.outputs[0].token_ids)

    return list(await asyncio.gather(*(one(p) for p in prompts)))


def _serve(model: str, prompts: list[list[int]], **args) -> tuple[list[list[int]], list[list[int]], AsyncEngine]:
    """Greedy tokens of ``prompts`` (the first one alone, then the others together, so they
    find its prefix cached), the engine's per-expert counts, and the stopped engine."""
    lt = LoopThread()
    engine = AsyncEngine(model=model, dtype="float32", **{**ENGINE_ARGS, **args})
    try:
        lt.run(engine.start(), timeout=600)
        tokens = lt.run(_run(engine, prompts[:1]), timeout=600)
        tokens += lt.run(_run(engine, prompts[1:]), timeout=600)
        load = lt.run(engine.expert_load(), timeout=60)
        if args.get("tensor_parallel_size", 1) == 1:
            text = engine.metrics.render().decode()
            assert 'layer="1",' in text and "moe_expert_tokens_total{" in text
        return tokens, load, engine
    finally:
        lt.run(engine.shutdown(), timeout=60)
        lt.close()


@pytest.mark.slow
def test_chunked_prefill_prefix_hits_and_preemption_keep_transformers_tokens(tiny_moe):
    hf, path = tiny_moe
    prompts = _prompts()
    expected = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    # 16-token steps split every prompt; the four sequences at their longest need 14 blocks
    # of 16 tokens (their 40-token prefix shared), and 10 are there: some are preempted
    per_block = 2 * 16 * 1 * 16 * 3 * 4  # K and V, block, KV heads, head_dim, layers, float32
    tokens, load, engine = _serve(
        path, prompts, max_num_batched_tokens=16, kv_cache_memory=10 * per_block, max_model_len=128
    )
    assert tokens == expected
    sched = engine.scheduler
    assert sched.prefix_cache_stats.hits > 0
    assert sched.num_preemptions > 0
    assert len(load) == 2 and len(load[0]) == 6  # two sparse layers (layer 1 is dense), 6 experts
    assert sum(load[0]) == sum(load[1]) > 0 and sum(load[0]) % 2 == 0  # top-2: two pairs a token


@pytest.mark.slow
def test_tensor_and_expert_parallel_give_one_ranks_tokens_and_routing(tiny_moe):
    _, path = tiny_moe
    prompts = _prompts()
    one, load, _ = _serve(path, prompts)
    assert len({tuple(t) for t in one}) == len(prompts)
    for tp in (2, 3):
        for ep in (False, True):
            got, got_load, _ = _serve(path, prompts, tensor_parallel_size=tp, enable_expert_parallel=ep)
            assert got == one, f"tp {tp} expert parallel {ep}"
            assert got_load == load, f"tp {tp} expert parallel {ep}: routed differently"


def test_expert_parallel_over_a_rank_count_that_does_not_divide_the_experts_is_refused(tmp_path, real_source):
    moe_model("qwen3_moe", tmp_path, num_experts=6)  # 4 heads over 2 KV heads: 4 ranks split them
    args = EngineArgs(model=str(tmp_path), tensor_parallel_size=4, enable_expert_parallel=True)
    with pytest.raises(ValueError, match=r"6 experts cannot be split evenly over 4 ranks.*1, 2, 3, 6"):
        check_model_args(args)
    args = EngineArgs(model=str(tmp_path), tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"4 attention heads are not divisible by 3"):
        check_model_args(args)
    assert check_model_args(EngineArgs(model=str(tmp_path), tensor_parallel_size=2, enable_expert_parallel=True))
