"""Serving benchmark: a client for any OpenAI-compatible /v1/completions endpoint.

Requests arrive by a Poisson (or gamma, via --burstiness) process at a given rate,
or as fast as a fixed concurrency allows. Each is streamed so time to first
token (TTFT), time per output token (TPOT), inter-token latency (ITL) and
end-to-end latency can be measured from the client's side, as users feel them.
Bounded in requests and time by construction.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from aiolm.bench.workload import Item, existing_file, jsonl_workload, parse_range, random_workload, rate_list
from aiolm.config import int_in, positive


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


async def _one(client: Any, url: str, model: str, item: Item, timeout: float) -> Result:
    """One streamed request, timed as vLLM's benchmark client times it: the first token at
    the first chunk with choices, each later one at its chunk, the end at the last one. A
    stream that ends without a choice, or carries an error event, is a failed request."""
    prompt = item.prompt_text if item.prompt_text is not None else item.prompt_token_ids
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": item.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    last: float | None = None
    res = Result(ok=False)
    try:
        async with client.stream("POST", url, json=body, timeout=timeout) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):  # the server gave up mid-stream (a timeout, a dead engine)
                    error = chunk["error"]
                    res.error = f"error event: {error.get('message') if isinstance(error, dict) else error}"
                    return res
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"].get("completion_tokens", res.output_tokens)
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
        if last is None:
            res.error = "the stream ended without a token"
            return res
        res.e2e = last - t0
        if res.output_tokens == 0:
            res.output_tokens = len(res.itl) + 1
        res.ok = True
    except Exception as e:  # a failed request is counted, never fatal to the run
        res.error = f"{type(e).__name__}: {e}"
    return res


def _pcts(values: list[float]) -> dict[str, float]:
    """Mean, percentiles (numpy's linear interpolation, as vLLM's benchmarks) and max."""
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    import numpy as np

    p50, p90, p99 = (float(x) for x in np.percentile(values, [50, 90, 99]))
    return {"mean": statistics.fmean(values), "p50": p50, "p90": p90, "p99": p99, "max": max(values)}


async def run_load(
    base_url: str,
    model: str,
    items: list[Item],
    rate: float,
    concurrency: int,
    burstiness: float = 1.0,
    seed: int = 0,
    timeout: float = 600.0,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
) -> dict[str, Any]:
    try:
        import httpx
    except ImportError as e:  # a `make serve` install has the server, not the load generator
        raise SystemExit("aiolm bench serve needs httpx: pip install -e '.[bench]' (make test installs it)") from e
    import numpy as np

    rng = np.random.default_rng(seed)
    base = base_url.rstrip("/")
    url = base + "/v1/completions"
    sem = asyncio.Semaphore(concurrency if concurrency > 0 else len(items))
    limits = httpx.Limits(max_connections=max(1, concurrency if concurrency > 0 else len(items)))
    key = os.environ.get("OPENAI_API_KEY")  # as vLLM's client: for a server started with --api-key
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
        if not model:  # the server's first model, as vLLM's benchmark takes it
            model = await _served_model(client, base)

        async def gated(it: Item) -> Result:
            async with sem:
                return await _one(client, url, model, it, timeout)

        t0 = time.perf_counter()
        tasks = []
        for it in items:
            tasks.append(asyncio.ensure_future(gated(it)))
            if rate > 0 and rate != float("inf"):
                if burstiness == float("inf"):  # no randomness left: evenly spaced (gamma gave NaN)
                    await asyncio.sleep(1.0 / rate)
                else:
                    theta = 1.0 / (rate * burstiness)
                    await asyncio.sleep(float(rng.gamma(burstiness, theta)))
        results = await asyncio.gather(*tasks)
        dur = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(len(it.prompt_token_ids) for it, r in zip(items, results) if r.ok)
    good = [r for r in ok if (slo_ttft is None or r.ttft <= slo_ttft) and (slo_tpot is None or r.tpot <= slo_tpot)]
    return {
        "rate": rate,
        "concurrency": concurrency,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": dur,
        "output_tok_s": out_tokens / dur,
        "prompt_tokens": in_tokens,  # of the completed requests, as output_tokens
        "output_tokens": out_tokens,
        "requests_s": len(ok) / dur,
        "goodput_req_s": len(good) / dur,
        "ttft_s": _pcts([r.ttft for r in ok]),
        "tpot_s": _pcts([r.tpot for r in ok if r.output_tokens > 1]),
        "itl_s": _pcts([x for r in ok for x in r.itl]),
        "e2e_s": _pcts([r.e2e for r in ok]),
    }


async def _served_model(client: Any, base: str) -> str:
    """The id of the first model the server lists; one line naming the problem otherwise."""
    try:
        r = await client.get(base + "/v1/models")
        listed = r.json()["data"][0]["id"] if r.status_code == 200 else None
    except Exception as e:
        raise BenchError(f"cannot read {base}/v1/models ({type(e).__name__}: {e}); give --model") from None
    if listed is None:
        hint = "set OPENAI_API_KEY to the server's --api-key" if r.status_code == 401 else "give --model"
        raise BenchError(f"{base}/v1/models answered {r.status_code}: {r.text[:200]} ({hint})")
    return str(listed)


class BenchError(Exception):
    """Why a serving benchmark cannot run or measured nothing: printed in one line."""


def plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["rate"] if r["rate"] not in (0, float("inf")) else r["concurrency"] for r in results]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for key, ax in zip(("ttft_s", "tpot_s"), axes):
        for p in ("p50", "p99"):
            ax.plot(xs, [1e3 * r[key][p] for r in results], marker="o", label=p)
        ax.set_xlabel("request rate (req/s) or concurrency")
        ax.set_ylabel(key.replace("_s", " (ms)"))
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def add_args(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="client benchmark against an OpenAI-compatible server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000")
    s.add_argument("--model", default="", help="model name sent in requests (default: the server's first model)")
    s.add_argument("--num-requests", type=int_in(1), default=64, help="requests per rate")
    s.add_argument("--prompt-len", type=parse_range, default="64-256")
    s.add_argument("--output-len", type=parse_range, default="32-128")
    s.add_argument("--dataset", type=existing_file)
    s.add_argument(
        "--text-prompts",
        action="store_true",
        help="send prompts as text (decoded with the embedded model's tokenizer) to servers that refuse token ids",
    )
    s.add_argument(
        "--request-rate", type=rate_list, default="inf", help="req/s (comma list to sweep); inf = all at once"
    )
    s.add_argument("--max-concurrency", type=int_in(0), default=0, help="0 = unbounded")
    s.add_argument("--burstiness", type=positive, default=1.0, help="gamma shape; 1 = Poisson")
    s.add_argument("--slo-ttft-ms", type=positive, help="goodput's bound on time to first token")
    s.add_argument("--slo-tpot-ms", type=positive, help="goodput's bound on time per output token")
    s.add_argument("--timeout", type=positive, default=600.0, help="seconds one request may take")
    s.add_argument("--seed", type=int_in(0), default=0)
    s.add_argument("--plot", help="write a latency-vs-load PNG here")
    s.add_argument("--json", action="store_true")
    s.set_defaults(bench_fn=None, serve_bench=True)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    items = (
        jsonl_workload(args.dataset)
        if args.dataset
        else random_workload(args.num_requests, args.prompt_len, args.output_len, args.seed)
    )
    if args.text_prompts:
        from aiolm.bench.workload import as_text
        from aiolm.checkpoint.source import resolve_model

        items = as_text(items, resolve_model(None).load_tokenizer())
    rates = list(args.request_rate)
    results = []
    for rate in rates:
        results.append(
            asyncio.run(
                run_load(
                    args.base_url,
                    args.model,
                    items,
                    rate,
                    args.max_concurrency,
                    args.burstiness,
                    args.seed,
                    args.timeout,
                    None if args.slo_ttft_ms is None else args.slo_ttft_ms / 1e3,
                    None if args.slo_tpot_ms is None else args.slo_tpot_ms / 1e3,
                )
            )
        )
        print(json.dumps(results[-1], indent=None if args.json else 2))
    if args.plot:
        plot(results, args.plot)
    for r in results:
        if not r["completed"]:
            why = r["errors"][0] if r["errors"] else "no answer"
            raise BenchError(f"no request completed at rate {r['rate']:g}: {why}")
    return results
