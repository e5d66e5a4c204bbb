"""--max-step-ms through the real engine and workers on the embedded model: once the step
cost is measured, prompt tokens per step are capped (here to the floor, since every real
step takes over 1 ms), the decoding requests keep their token every step, and every request
gets the tokens it gets without a cap."""

from __future__ import annotations

from engine_harness import ENGINE_ARGS

from aiolm import LLM, SamplingParams
from aiolm.core.scheduler import PREFILL_FLOOR_BLOCKS

ARGS = {k: v for k, v in ENGINE_ARGS.items() if k != "executor"}
PROMPTS = [
    "The capital of France is",
    "List three colours:",
    "Once upon a time",
    " ".join(f"item {i} is number {i * 7 % 13};" for i in range(60)) + " Summarise the list:",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


def test_prompt_tokens_per_step_are_capped_and_answers_do_not_change():
    with LLM(**ARGS) as llm:  # offline: no cap unless asked
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    with LLM(max_step_ms=1, **ARGS) as llm:
        sched = llm.engine.scheduler
        llm.generate(["warm up"], SamplingParams(max_tokens=4), use_tqdm=False)  # measures the step cost
        assert sched.step_cost is not None and sched.step_cost.fit() is not None
        steps: list[tuple[dict[str, int], set[str]]] = []
        schedule = sched.schedule

        def recording():
            # who decodes going into this step (prompt done), and what the step scheduled
            decoding = {r.req_id for r in sched.running if r.num_computed_tokens >= r.num_prompt_tokens}
            so = schedule()
            steps.append((dict(so.num_scheduled_tokens), decoding))
            return so

        sched.schedule = recording
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == want
    floor = PREFILL_FLOOR_BLOCKS * ARGS.get("block_size", 16)
    prompt_steps = 0
    for scheduled, decoding in steps:
        prefill = sum(n for rid, n in scheduled.items() if rid not in decoding)
        assert prefill <= floor, scheduled
        assert decoding <= set(scheduled) or not scheduled, "a decoding request lost its step"
        prompt_steps += prefill > 0
    long_tokens = len(llm.tokenizer.encode(PROMPTS[-1]))
    assert long_tokens > 4 * floor and prompt_steps >= long_tokens // floor
