"""What --max-step-ms does to serving: the same load against `aiolm serve` with each cap.

    python benchmarks/bench_step_time.py [--caps 0,500] [--rounds 3] [--num-requests 64]
        [--concurrency 64] [--json-out FILE]

Each round starts one server per cap in turn (127.0.0.1, the embedded model's Hugging Face
folder in float32 unless --model, --max-model-len 2048), sends one warm-up load (dropped) and one measured load with
`aiolm bench serve` (random token-id prompts of 64-256 tokens, outputs of 32-128, streamed,
ignore_eos; a fresh seed each round, the same seeds for every cap, so no run is served from
a prefix cache an earlier one filled), and stops it: the caps alternate, so the machine's
slow spells fall on all. Every figure is the median over the rounds: output tokens/s, TPOT
p50, TTFT p99 and the inter-token latency p99 (the longest pauses a stream sees, which a
step carrying a long prompt chunk causes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from compare import _free_port as free_port  # noqa: E402  (the same server start-up as compare.py's)
from compare import _wait_ready as wait_ready  # noqa: E402

AIOLM = str(Path(sys.executable).parent / "aiolm")


def _load(url: str, a: argparse.Namespace, seed: int) -> dict[str, Any]:
    cmd = [AIOLM, "bench", "serve", "--base-url", url, "--model", "bench", "--num-requests", str(a.num_requests)]
    cmd += ["--max-concurrency", str(a.concurrency), "--seed", str(seed), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=3600).stdout
    result = json.loads(out.strip().splitlines()[-1])
    if result["failed"]:
        raise SystemExit(f"failed requests: {result['errors']}")
    return result


def run_cap(cap: str, a: argparse.Namespace, seed: int) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [AIOLM, "serve", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048"]
    cmd += ["--model", a.model, "--dtype", "float32", "--served-model-name", "bench", "--max-step-ms", cap]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        if wait_ready(url, proc, 600) is None:
            raise SystemExit(f"the server with --max-step-ms {cap} did not start")
        _load(url, a, 1000 + seed)  # warm-up, dropped
        return _load(url, a, seed)
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--caps", default="0,500", help="--max-step-ms values (0: no cap)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--json-out")
    ap.add_argument("--model", help="default: the embedded model's Hugging Face folder (float32 weights)")
    a = ap.parse_args()
    if a.model is None:
        sys.path.insert(0, str(ROOT))
        from aiolm.checkpoint.source import resolve_model

        a.model = str(resolve_model(None).path)
    caps = a.caps.split(",")
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in caps}
    for rnd in range(a.rounds):
        for cap in caps:
            r = run_cap(cap, a, rnd)
            runs[cap].append(r)
            print(
                f"round {rnd + 1} cap {cap}: {r['output_tok_s']:.1f} tok/s, TPOT p50 "
                f"{1e3 * r['tpot_s']['p50']:.0f} ms, TTFT p99 {r['ttft_s']['p99']:.2f} s, "
                f"ITL p99 {1e3 * r['itl_s']['p99']:.0f} ms",
                flush=True,
            )
    print("\n| --max-step-ms | output tok/s | TPOT p50 (ms) | TTFT p99 (s) | ITL p99 (ms) | ITL max (ms) |")
    print("|---|---|---|---|---|---|")
    for cap in caps:
        rs = runs[cap]

        def med(f: Any, rs: list[dict[str, Any]] = rs) -> float:
            return statistics.median(f(r) for r in rs)

        print(
            f"| {cap} | {med(lambda r: r['output_tok_s']):.1f} | {med(lambda r: 1e3 * r['tpot_s']['p50']):.0f} "
            f"| {med(lambda r: r['ttft_s']['p99']):.2f} | {med(lambda r: 1e3 * r['itl_s']['p99']):.0f} "
            f"| {med(lambda r: 1e3 * r['itl_s']['max']):.0f} |"
        )
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
