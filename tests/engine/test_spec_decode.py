"""Speculative decoding (n-gram) end to end on the real model: the same greedy output with
and without drafts, stop strings / max_tokens / logprobs inside accepted runs, and no KV
blocks left behind when streams are dropped mid-speculation.

One engine serves both modes: the reference runs have the scheduler's proposer switched
off, so everything else (batching, prefix cache, worker) is the same.
"""

from __future__ import annotations

import asyncio

import pytest
from engine_harness import ENGINE_ARGS

from aiolm import LLM, SamplingParams
from aiolm.params import OutputKind

pytestmark = pytest.mark.slow

CODE = '''def fibonacci(n):
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def factorial(n):
    result = 1
    for i in range(2, n + 1):
        result *= i
    return result
'''
COPY = [{"role": "user", "content": "Repeat this code exactly:\n\n" + CODE}]
CHATS = [
    COPY,
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
]


@pytest.fixture(scope="module")
def llm():
    with LLM(**ENGINE_ARGS, speculative="ngram", num_speculative_tokens=4) as model:
        yield model


def generate(llm, drafts: bool, prompts, params, chat: bool = True):
    sched = llm.engine.scheduler
    proposer, sched.proposer = sched.proposer, (sched.proposer if drafts else None)
    try:
        run = llm.chat if chat else llm.generate
        return run(prompts, params, use_tqdm=False)
    finally:
        sched.proposer = proposer


def counts(llm) -> tuple[int, int]:
    st = llm.engine.spec_decode_stats
    return st.num_draft_tokens, st.num_accepted_tokens


@pytest.fixture(scope="module")
def plain(llm):
    """The reference: the chats decoded greedily without drafts."""
    return generate(llm, False, CHATS, SamplingParams(temperature=0.0, max_tokens=128))


def test_greedy_output_is_identical_and_copying_accepts_drafts(llm, plain):
    before = counts(llm)
    # A batch mixing copying, a short answer and free text.
    on = generate(llm, True, CHATS, SamplingParams(temperature=0.0, max_tokens=128))
    drafted, accepted = (a - b for a, b in zip(counts(llm), before))
    assert accepted > 20, (drafted, accepted)
    assert "def factorial(n):" in on[0].outputs[0].text
    for a, b in zip(on, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
    ids = [{"prompt_token_ids": [(i * 7919) % 40000 + 100 for i in range(64)]}]
    ignore = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    assert (
        generate(llm, True, ids, ignore, chat=False)[0].outputs[0].token_ids
        == generate(llm, False, ids, ignore, chat=False)[0].outputs[0].token_ids
    )


def test_acceptance_counters_reach_the_metrics(llm, plain):
    generate(llm, True, [COPY], SamplingParams(temperature=0.0, max_tokens=48))
    text = llm.engine.metrics.render().decode()
    st = llm.engine.spec_decode_stats
    value = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("aiolm:spec_decode_num_") and "per_pos" not in line
    }
    assert value["aiolm:spec_decode_num_accepted_tokens_total"] == st.num_accepted_tokens > 0
    assert value["aiolm:spec_decode_num_draft_tokens_total"] == st.num_draft_tokens
    per_pos = [line for line in text.splitlines() if line.startswith("aiolm:spec_decode_num_accepted_tokens_per_pos")]
    assert any('position="0"' in line for line in per_pos), per_pos


def test_stop_strings_max_tokens_and_logprobs_inside_accepted_runs(llm, plain):
    full = plain[0].outputs[0]
    mid = len(full.text) // 2
    stop = full.text[mid : mid + 10]  # a string from the middle of the answer
    cases = [
        SamplingParams(temperature=0.0, max_tokens=128, stop=[stop]),
        SamplingParams(temperature=0.0, max_tokens=128, stop=[stop], include_stop_str_in_output=True),
        SamplingParams(temperature=0.0, max_tokens=37),
        SamplingParams(temperature=0.0, max_tokens=40, logprobs=3),
    ]
    before = counts(llm)
    on = generate(llm, True, [COPY] * len(cases), cases)
    assert counts(llm)[1] > before[1]
    off = generate(llm, False, [COPY] * len(cases), cases)
    for params, a, b in zip(cases, on, off):
        x, y = a.outputs[0], b.outputs[0]
        assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == (
            y.token_ids,
            y.text,
            y.finish_reason,
            y.stop_reason,
        ), params
    assert on[0].outputs[0].stop_reason == stop and not on[0].outputs[0].text.endswith(stop)
    assert on[1].outputs[0].text.endswith(stop)
    assert len(on[2].outputs[0].token_ids) == 37 and on[2].outputs[0].finish_reason == "length"
    lp_on, lp_off = on[3].outputs[0].logprobs, off[3].outputs[0].logprobs
    assert len(lp_on) == len(lp_off) == 40
    for p, q in zip(lp_on, lp_off):
        assert p.keys() == q.keys()
        for tok in p:
            assert p[tok].logprob == pytest.approx(q[tok].logprob, abs=1e-3)
            assert p[tok].rank == q[tok].rank


def test_streams_dropped_mid_speculation_leave_no_blocks(llm):
    engine = llm.engine
    sched = engine.scheduler

    async def drop_after(n: int) -> int:
        got = 0
        params = SamplingParams(temperature=0.0, max_tokens=200, output_kind=OutputKind.DELTA)
        prompt = engine.tokenizer.apply_chat_template(COPY, tokenize=False, add_generation_prompt=True)
        async for out in engine.generate(prompt, params):
            got += len(out.outputs[0].token_ids)
            if got >= n:
                break  # leaving the loop aborts the request
        return got

    async def scenario() -> list[int]:
        got = await asyncio.gather(*(drop_after(n) for n in (3, 17, 30, 31)))
        for _ in range(200):  # the aborts are applied by the core within a step or two
            if not sched.has_unfinished_requests():
                break
            await asyncio.sleep(0.05)
        return list(got)

    before = counts(llm)
    got = llm._runner.run(scenario(), timeout=120)
    assert all(g >= n for g, n in zip(got, (3, 17, 30, 31)))
    assert counts(llm)[1] > before[1]  # drafts were being accepted when the streams went
    assert not sched.has_unfinished_requests()
    kv = sched.kv_cache_manager
    assert kv.usage == 0.0 and kv.check_invariants() == []
