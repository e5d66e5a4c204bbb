"""Speculative decoding (n-gram) against plain decoding, single stream, round-robin.

    python benchmarks/bench_spec_decode.py --rounds 3 [--num-speculative-tokens 4] [--json]

Two workloads, each one request at a time, greedy (so both modes emit the same
tokens, which the script checks):

* copy: the chat model is asked to repeat a ~300-token Python block with one
  function renamed (copy-heavy: most of the answer is in the prompt);
* random: 128 random prompt tokens, 128 output tokens (ignore_eos): nothing to copy
  from the prompt (though a small model's greedy output may start repeating itself);
* random-sampled: the same prompt at temperature 0.8, where drafts mostly fail and
  the adaptive pause has to keep the cost down (the two modes emit different tokens).

Each round starts an engine per mode in turn (alternating which goes first, so
the machine's slow spells fall on both) and runs every workload on it. Prints
per-run decode tok/s (tokens after the first over the time after the first),
end-to-end tok/s, and the acceptance counters; then the medians.

``--clock thread`` instead drives the scheduler and the model runner in this
process on one torch thread and times each generation by this thread's CPU time
(prefill excluded): on a shared machine whose load swings wall times, CPU time
per token is the steadier measure of what speculation saves.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from aiolm.config import EngineArgs
from aiolm.engine.async_engine import AsyncEngine
from aiolm.params import OutputKind, SamplingParams

CODE = '''class InventoryReport:
    """Summarise stock levels per warehouse and flag items that need reordering."""

    def __init__(self, warehouses, threshold=10):
        self.warehouses = warehouses
        self.threshold = threshold
        self.lines = []

    def process_items(self, items):
        totals = {}
        for item in items:
            key = (item["warehouse"], item["sku"])
            totals[key] = totals.get(key, 0) + item["quantity"]
        for (warehouse, sku), quantity in sorted(totals.items()):
            status = "reorder" if quantity < self.threshold else "ok"
            self.lines.append(f"{warehouse:>10} {sku:<12} {quantity:6d} {status}")
        return totals

    def low_stock(self, totals):
        return [key for key, quantity in totals.items() if quantity < self.threshold]

    def render(self):
        header = f"{'warehouse':>10} {'sku':<12} {'qty':>6} status"
        return "\\n".join([header, "-" * len(header), *self.lines])


def main():
    report = InventoryReport(["north", "south"], threshold=5)
    totals = report.process_items([
        {"warehouse": "north", "sku": "A-100", "quantity": 3},
        {"warehouse": "south", "sku": "B-200", "quantity": 12},
    ])
    print(report.render())
    print(report.low_stock(totals))
'''

COPY_PROMPT = (
    "Repeat the following Python code exactly, but rename the method `process_items` to "
    "`handle_items` everywhere. Output only the code.\n\n```python\n" + CODE + "```"
)


async def _one(engine: AsyncEngine, prompt: Any, params: SamplingParams) -> dict[str, Any]:
    t0 = time.perf_counter()
    first = None
    ids: list[int] = []
    async for out in engine.generate(prompt, params):
        if first is None and out.outputs[0].token_ids:
            first = time.perf_counter()
        ids.extend(out.outputs[0].token_ids)  # DELTA outputs: each holds the new tokens
    t1 = time.perf_counter()
    assert first is not None
    n = len(ids)
    return {
        "tokens": n,
        "ids": ids,
        "e2e_tok_s": n / (t1 - t0),
        "decode_tok_s": (n - 1) / (t1 - first) if n > 1 and t1 > first else 0.0,
    }


async def run_mode(
    args: argparse.Namespace,
    spec: bool,
    workloads: dict[str, tuple[Any, SamplingParams]],
) -> dict[str, dict[str, Any]]:
    ea = EngineArgs(
        max_model_len=2048,
        kv_cache_memory=256 << 20,
        num_threads=args.num_threads,
        speculative="ngram" if spec else None,
        num_speculative_tokens=args.num_speculative_tokens,
        prompt_lookup_min=args.prompt_lookup_min,
        prompt_lookup_max=args.prompt_lookup_max,
    )
    out = {}
    async with AsyncEngine(ea) as engine:
        warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        await _one(engine, "Hello", warm)
        for name, (prompt, params) in workloads.items():
            before = engine.spec_decode_stats
            d0 = (before.num_draft_tokens, before.num_accepted_tokens) if before else (0, 0)
            engine.scheduler.reset_prefix_cache()
            res = await _one(engine, prompt, params)
            st = engine.spec_decode_stats
            if st is not None:
                drafted, accepted = st.num_draft_tokens - d0[0], st.num_accepted_tokens - d0[1]
                res.update(drafted=drafted, accepted=accepted, acceptance=accepted / drafted if drafted else 0.0)
            out[name] = res
    return out


def proposer_cost() -> dict[int, float]:
    """CPU microseconds of one n-gram proposal over code-like contexts of a few lengths
    (a 400-token block repeated; frequent tokens like spaces and newlines make many
    candidate matches): what the scheduler spends per drafting request and step."""
    import random

    from aiolm.spec_decode import NgramProposer

    p = NgramProposer(4, 2, 5, 2048)
    rng = random.Random(0)
    block = [rng.choice([198, 220, 284, 28, 30, 314, 1552, 2362, *range(1000, 1200)]) for _ in range(400)]
    out = {}
    for n in (500, 2000, 8000):
        seq = (block * (n // 400 + 1))[:n]
        t = time.thread_time()
        for _ in range(1000):
            p.propose(seq)
        out[n] = (time.thread_time() - t) / 1000 * 1e6
    return out


def run_in_process(
    args: argparse.Namespace, workloads: dict[str, tuple[Any, SamplingParams]], runner: Any, spec: bool
) -> dict[str, dict[str, Any]]:
    """Scheduler + model runner in this thread; decode timed by thread CPU time and wall time."""
    from aiolm.core.request import Request
    from aiolm.core.scheduler import Scheduler, SchedulerConfig

    ea = EngineArgs(
        speculative="ngram" if spec else None,
        num_speculative_tokens=args.num_speculative_tokens,
        prompt_lookup_min=args.prompt_lookup_min,
        prompt_lookup_max=args.prompt_lookup_max,
    )
    out = {}
    for name, (prompt, params) in workloads.items():
        sched = Scheduler(
            SchedulerConfig(
                num_blocks=runner.num_blocks,
                max_model_len=2048,
                enable_prefix_caching=False,
                speculative=ea.spec_config(),
            )
        )
        rid = f"{name}-{spec}-{time.monotonic_ns()}"
        # The engine's input processor fills in the model's EOS ids; do the same here.
        eos = tuple(runner.source.eos_token_ids)
        sched.add_request(Request(rid, prompt["prompt_token_ids"], params.clone(eos_token_ids=eos)))
        ids: list[int] = []
        cpu = wall = 0.0
        step_cpu: dict[int, list[float]] = {}  # tokens in the step -> CPU seconds of each such step
        while sched.has_unfinished_requests():
            so = sched.schedule()
            c0, w0 = time.thread_time(), time.perf_counter()
            runner_output = runner.execute(so)
            res = sched.update_from_output(so, runner_output)
            if ids:  # the prefill step (which yields the first token) is not decode
                cpu += time.thread_time() - c0
                wall += time.perf_counter() - w0
                step_cpu.setdefault(so.total_num_scheduled_tokens, []).append(time.thread_time() - c0)
            for o in res:
                ids.extend(o.new_token_ids)
        runner.execute(sched.schedule())  # tell the runner the request finished
        n = len(ids)
        res_d: dict[str, Any] = {
            "tokens": n,
            "ids": ids,
            "decode_tok_s": (n - 1) / wall,
            "e2e_tok_s": (n - 1) / cpu,  # e2e column: tokens per CPU-second
            "step_cpu_ms": {k: 1e3 * statistics.median(v) for k, v in sorted(step_cpu.items())},
        }
        st = sched.spec_decode_stats
        if st is not None:
            res_d.update(drafted=st.num_draft_tokens, accepted=st.num_accepted_tokens, acceptance=st.acceptance_rate)
        out[name] = res_d
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    from aiolm.checkpoint.source import resolve_model

    tok = resolve_model(None).load_tokenizer()
    text = tok.apply_chat_template(
        [{"role": "user", "content": COPY_PROMPT}], tokenize=False, add_generation_prompt=True
    )
    copy_ids = tok.encode(text, add_special_tokens=False)
    rng = np.random.default_rng(0)
    workloads = {
        "copy": (
            {"prompt_token_ids": list(copy_ids)},
            SamplingParams(temperature=0, max_tokens=args.copy_max_tokens, output_kind=OutputKind.DELTA),
        ),
        "random": (
            {"prompt_token_ids": rng.integers(100, 40001, size=128).tolist()},
            SamplingParams(temperature=0, max_tokens=128, ignore_eos=True, output_kind=OutputKind.DELTA),
        ),
    }
    workloads["random-sampled"] = (
        workloads["random"][0],
        SamplingParams(temperature=0.8, max_tokens=128, ignore_eos=True, output_kind=OutputKind.DELTA),
    )
    runner = None
    if args.clock == "thread":
        import torch

        from aiolm.config import RunnerConfig
        from aiolm.worker.model_runner import ModelRunner

        torch.set_num_threads(1)
        runner = ModelRunner(
            RunnerConfig(max_model_len=2048, kv_cache_memory=256 << 20, num_threads=1, structured_outputs=False)
        )
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {"off": {}, "ngram": {}}
    for r in range(args.rounds):
        order = [False, True] if r % 2 == 0 else [True, False]
        for spec in order:
            mode = "ngram" if spec else "off"
            res = (
                run_in_process(args, workloads, runner, spec)
                if runner is not None
                else await run_mode(args, spec, workloads)
            )
            for name, v in res.items():
                runs[mode].setdefault(name, []).append(v)
                extra = (
                    f" drafted {v['drafted']} accepted {v['accepted']} ({100 * v['acceptance']:.0f}%)"
                    if "drafted" in v
                    else ""
                )
                second = "per CPU-second" if runner is not None else "e2e"
                if "step_cpu_ms" in v:
                    extra += " | step CPU ms by tokens: " + ", ".join(
                        f"{k}: {ms:.1f}" for k, ms in v["step_cpu_ms"].items()
                    )
                print(
                    f"round {r} {mode:5} {name:6} {v['tokens']} tokens decode {v['decode_tok_s']:.1f} tok/s "
                    f"{second} {v['e2e_tok_s']:.1f} tok/s{extra}",
                    flush=True,
                )
    summary: dict[str, Any] = {"prompt_tokens_copy": len(copy_ids), "proposer_us": proposer_cost()}
    print("n-gram proposal, CPU us by context length:", summary["proposer_us"])
    for name in workloads:
        off, on = runs["off"][name], runs["ngram"][name]
        same = all(o["ids"] == off[0]["ids"] for o in off + on) if workloads[name][1].greedy else None
        med = {m: statistics.median(v["decode_tok_s"] for v in runs[m][name]) for m in runs}
        med_e2e = {m: statistics.median(v["e2e_tok_s"] for v in runs[m][name]) for m in runs}
        best = {m: max(v["e2e_tok_s"] for v in runs[m][name]) for m in runs}  # the least disturbed run
        acc = statistics.median(v["acceptance"] for v in on)
        summary[name] = {
            "tokens": off[0]["tokens"],
            "identical_tokens": same,
            "decode_tok_s": med,
            "e2e_tok_s": med_e2e,
            "speedup_decode": med["ngram"] / med["off"],
            "speedup_e2e": med_e2e["ngram"] / med_e2e["off"],
            "best_e2e_tok_s": best,
            "speedup_best_e2e": best["ngram"] / best["off"],
            "acceptance": acc,
        }
        print(
            f"{name}: {off[0]['tokens']} tokens, identical={same}, decode off {med['off']:.1f} ngram "
            f"{med['ngram']:.1f} tok/s (x{med['ngram'] / med['off']:.2f}), e2e off {med_e2e['off']:.1f} "
            f"ngram {med_e2e['ngram']:.1f} (x{med_e2e['ngram'] / med_e2e['off']:.2f}; best runs "
            f"x{best['ngram'] / best['off']:.2f}), acceptance {100 * acc:.0f}%"
        )
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--prompt-lookup-max", type=int, default=5)
    ap.add_argument("--copy-max-tokens", type=int, default=400)
    ap.add_argument("--num-threads", type=int, default=0)
    ap.add_argument(
        "--clock",
        choices=("wall", "thread"),
        default="wall",
        help="wall: engines with worker processes; thread: in process, CPU time per token",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    summary = asyncio.run(main_async(args))
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
