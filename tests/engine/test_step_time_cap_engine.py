"""--max-step-ms through the real engine and workers on the embedded model: once the step
cost is measured and streams are decoding, a prompt arriving beside them is cut to the
floor (every real step takes over 1 ms), the streams keep their token every step, and every
request gets the tokens it gets without a cap."""

from __future__ import annotations

import asyncio

from engine_harness import ENGINE_ARGS

from aiolm import LLM, SamplingParams
from aiolm.core.scheduler import PREFILL_FLOOR_BLOCKS

ARGS = {k: v for k, v in ENGINE_ARGS.items() if k != "executor"}
STREAMS = ["The capital of France is", "List three colours:", "Once upon a time"]
LONG = " ".join(f"item {i} is number {i * 7 % 13};" for i in range(60)) + " Summarise the list:"
GREEDY = SamplingParams(max_tokens=40, temperature=0.0)


async def _streams_then_long(engine) -> list[list[int]]:
    """The streams start; once all of them have a token, the long prompt arrives."""
    started = asyncio.Event()
    first: set[int] = set()

    async def run(i: int, prompt: str) -> list[int]:
        out: list[int] = []
        async for o in engine.generate(prompt, GREEDY):
            out = list(o.outputs[0].token_ids)
            if i < len(STREAMS) and out:
                first.add(i)
                if len(first) == len(STREAMS):
                    started.set()
        return out

    tasks = [asyncio.ensure_future(run(i, p)) for i, p in enumerate(STREAMS)]
    await asyncio.wait_for(started.wait(), 60)
    tasks.append(asyncio.ensure_future(run(len(STREAMS), LONG)))
    return list(await asyncio.gather(*tasks))


def test_a_prompt_beside_decoding_streams_is_capped_and_answers_do_not_change():
    with LLM(**ARGS) as llm:  # offline: no cap unless asked
        want = [o.outputs[0].token_ids for o in llm.generate([*STREAMS, LONG], GREEDY, use_tqdm=False)]
    with LLM(max_step_ms=1, **ARGS) as llm:
        sched = llm.engine.scheduler
        llm.generate(["warm up"], SamplingParams(max_tokens=4), use_tqdm=False)  # measures the step cost
        assert sched.step_cost is not None and sched.step_cost.fit() is not None
        steps: list[tuple[dict[str, int], set[str]]] = []
        schedule = sched.schedule

        def recording():
            # who decodes going into this step (prompt done, and a token still to schedule: under
            # overlap a stream whose last token is in flight has none), and what the step scheduled
            decoding = {
                r.req_id
                for r in sched.running
                if r.num_computed_tokens >= r.num_prompt_tokens
                and len(r.output_token_ids) + r.num_output_placeholders < r.max_tokens
            }
            so = schedule()
            steps.append((dict(so.num_scheduled_tokens), decoding))
            return so

        sched.schedule = recording
        got = llm._run(_streams_then_long(llm.engine))
        long_tokens = len(llm.tokenizer.encode(LONG))
    assert got == want
    floor = PREFILL_FLOOR_BLOCKS * ARGS.get("block_size", 16)
    capped = 0
    for scheduled, decoding in steps:
        prefill = sum(n for rid, n in scheduled.items() if rid not in decoding)
        if decoding:  # streams to keep fluid: prompts get the floor (the cap is below it)
            assert prefill <= floor, scheduled
            assert decoding <= set(scheduled) or not scheduled, "a decoding stream lost its step"
            capped += prefill == floor
    assert long_tokens > 4 * floor and capped >= long_tokens // floor - 1
