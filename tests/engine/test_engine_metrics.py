"""Metrics of an embedded AsyncEngine, no server: the same series as /metrics, in the engine's
own registry; a KV cache too small for the batch shows its preemptions."""

from __future__ import annotations

import asyncio

import prometheus_client
import pytest

from aiolm import AsyncEngine, EngineArgs, SamplingParams
from aiolm.metrics import EngineMetrics
from metrics_contract import Scrape, check_contract

# 4 MiB of KV holds about 5 blocks of 16 tokens of the embedded model: each request fits
# alone (2 blocks), four at once do not, so decodes must preempt.
ARGS = dict(max_model_len=64, kv_cache_memory=4 << 20, max_num_seqs=4, num_threads=1)
PROMPTS = [f"Count from {i}:" for i in range(4)]
MAX_TOKENS = 24


def test_embedded_engine_metrics_and_preemptions():
    async def main():
        async with AsyncEngine(EngineArgs(**ARGS)) as engine:
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

            async def run(prompt: str):
                return [o async for o in engine.generate(prompt, params)][-1]

            finals = await asyncio.gather(*(run(p) for p in PROMPTS))
            text = engine.metrics.render().decode()
            # A second registry with the same names in the same process does not collide.
            other = EngineMetrics(engine, "aiolm")
            other.configure("other", 64)
            return finals, text, other.render().decode(), engine.scheduler.num_preemptions, engine.model_name

    finals, text, other_text, preemptions, model_name = asyncio.run(main())
    m = Scrape(text, "aiolm")
    check_contract(m, model_name)
    assert preemptions > 0 and m.value("num_preemptions_total") == preemptions
    reqs = len(finals)
    gen = sum(len(f.outputs[0].token_ids) for f in finals)
    assert gen == reqs * MAX_TOKENS
    assert m.value("prompt_tokens_total") == sum(len(f.prompt_token_ids) for f in finals)
    assert m.value("generation_tokens_total") == gen
    assert m.value("request_success_total", finished_reason="length") == reqs
    assert m.hist("inter_token_latency_seconds")[0] == gen - reqs
    assert m.hist("request_queue_time_seconds")[0] == reqs and m.hist("request_queue_time_seconds")[1] > 0
    # Preempted requests recompute their tokens: steps schedule more than one pass over everything.
    assert m.hist("iteration_tokens_total")[1] > m.value("prompt_tokens_total") + gen - reqs
    assert m.value("num_requests_running") == 0 and m.value("kv_cache_usage_perc") == 0
    assert "aiolm:num_requests_running" not in prometheus_client.generate_latest().decode()
    assert Scrape(other_text, "aiolm").value("request_success_total", finished_reason="length") == 0


def test_histogram_buckets_are_inclusive_and_prefix_is_checked():
    from aiolm.metrics import Histogram

    h = Histogram([0.01, 0.1])
    for v in (0.01, 0.0100001, 0.1, 5.0):
        h.observe(v)
    h.observe_many([0.001, 0.2])
    assert h.counts == [2, 2, 2] and h.count == 6 and h.sum == pytest.approx(5.3210001)
    with pytest.raises(ValueError, match="metrics_prefix"):
        EngineArgs(metrics_prefix="9x")
    with pytest.raises(ValueError, match="metrics_prefix"):
        EngineArgs(metrics_prefix="vllm:")
