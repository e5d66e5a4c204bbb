"""KV offloading: a multi-turn chat workload whose prefixes need several times the KV pool,
with the OffloadingConnector's tiers against without.

    python benchmarks/bench_kv_offload.py --rounds 3 [--json]

Each conversation grows by a user turn of ``--user-tokens`` random tokens and a greedy
answer of ``--max-tokens`` tokens per turn; the conversations take turns, one request
at a time, so every turn but the first could reuse its conversation's whole history
if the KV cache kept it. The pool holds ``--pool-blocks`` blocks, a fraction of what the
histories need, so without a second tier the prefix cache has evicted a conversation
before its next turn comes. Modes (each its own engine, run in turn each round):

* off: the prefix cache alone;
* disk: --kv-transfer-config with a small host tier and a disk tier (a fresh directory).

Per mode: prefix-hit tokens over prompt tokens, the median time to first token of the
later turns, the whole run's time, and the connector's counters. The greedy tokens of
the two modes must be equal (checked). The disk tier's bytes stay within its cap
(checked).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiolm.config import EngineArgs
from aiolm.engine.async_engine import AsyncEngine
from aiolm.params import OutputKind, SamplingParams

# SmolLM2's float32 KV block (16 tokens): 30 layers x K and V x 3 heads x 64 x 4 bytes.
EMBEDDED_BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 4


@dataclass
class Workload:
    conversations: int = 8
    turns: int = 3
    first_tokens: int = 200  # the first turn's prompt (a system prompt and a question)
    user_tokens: int = 48
    max_tokens: int = 8
    seed: int = 0

    def user_turn(self, conv: int, turn: int) -> list[int]:
        """Random ordinary token ids (no special ones), the same for every mode."""
        rng = random.Random(self.seed * 100_003 + conv * 101 + turn)
        n = self.first_tokens if turn == 0 else self.user_tokens
        return [rng.randrange(1000, 40000) for _ in range(n)]


@dataclass
class RunResult:
    tokens: list[list[int]] = field(default_factory=list)  # per request, in order
    cached: list[int] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    seconds: float = 0.0
    stats: dict[str, int] = field(default_factory=dict)
    disk_bytes: int = 0

    def summary(self, w: Workload) -> dict[str, Any]:
        later = [t for i, t in enumerate(self.ttft) if i >= w.conversations]
        return {
            "hit_tokens": sum(self.cached),
            "prompt_tokens": sum(self.prompt),
            "hit_rate": round(sum(self.cached) / max(1, sum(self.prompt)), 3),
            "ttft_ms_later_turns_median": round(1e3 * statistics.median(later), 1) if later else None,
            "seconds": round(self.seconds, 2),
            **self.stats,
            "disk_bytes": self.disk_bytes,
        }


def offload_config(disk_path: str, disk_bytes: int, cpu_bytes: int) -> str:
    return json.dumps(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes": cpu_bytes, "disk_path": disk_path, "disk_bytes": disk_bytes},
        }
    )


def dir_bytes(path: str | Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


async def run(
    w: Workload, engine_args: dict[str, Any], inspect: Callable[[AsyncEngine], None] | None = None
) -> RunResult:
    """The workload on one engine: conversations in turn, one request at a time;
    ``inspect`` sees the engine after the last request, before it shuts down."""
    out = RunResult()
    params = SamplingParams(max_tokens=w.max_tokens, temperature=0.0, ignore_eos=True, output_kind=OutputKind.DELTA)
    histories: list[list[int]] = [[] for _ in range(w.conversations)]
    async with AsyncEngine(EngineArgs(**engine_args)) as engine:
        t_run = time.perf_counter()
        for turn in range(w.turns):
            for c in range(w.conversations):
                prompt = histories[c] + w.user_turn(c, turn)
                t0 = time.perf_counter()
                first = None
                tokens: list[int] = []
                cached = 0
                async for o in engine.generate({"prompt_token_ids": prompt}, params):
                    if first is None and o.outputs[0].token_ids:
                        first = time.perf_counter() - t0
                    tokens.extend(o.outputs[0].token_ids)
                    cached = o.num_cached_tokens or 0
                out.tokens.append(tokens)
                out.cached.append(cached)
                out.prompt.append(len(prompt))
                out.ttft.append(first or 0.0)
                histories[c] = prompt + tokens
        out.seconds = time.perf_counter() - t_run
        connector = engine.scheduler.connector if engine.scheduler is not None else None
        if connector is not None:
            out.stats = dict(vars(connector.stats))
        if inspect is not None:
            inspect(engine)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--first-tokens", type=int, default=200)
    p.add_argument("--user-tokens", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--pool-blocks", type=int, default=40, help="KV pool size in blocks (of the embedded model)")
    p.add_argument("--disk-blocks", type=int, default=400, help="the disk tier's cap in blocks")
    p.add_argument("--host-blocks", type=int, default=8, help="the host tier's size in blocks")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    w = Workload(a.conversations, a.turns, a.first_tokens, a.user_tokens, a.max_tokens)
    base = dict(
        dtype="float32",
        max_model_len=512,
        kv_cache_memory=a.pool_blocks * EMBEDDED_BLOCK_BYTES,
        max_num_seqs=4,
        max_step_ms=0.0,
    )
    results: dict[str, list[dict[str, Any]]] = {"off": [], "disk": []}
    for r in range(a.rounds):
        order = ["off", "disk"] if r % 2 == 0 else ["disk", "off"]
        tokens = {}
        for mode in order:
            kwargs = dict(base)
            tmp = tempfile.mkdtemp(prefix="aiolm-kv-bench-")
            if mode == "disk":
                kwargs["kv_transfer_config"] = offload_config(
                    tmp, a.disk_blocks * EMBEDDED_BLOCK_BYTES, a.host_blocks * EMBEDDED_BLOCK_BYTES
                )
            res = asyncio.run(run(w, kwargs))
            res.disk_bytes = dir_bytes(tmp)
            shutil.rmtree(tmp, ignore_errors=True)
            tokens[mode] = res.tokens
            s = res.summary(w)
            results[mode].append(s)
            print(f"round {r} {mode}: {s}", flush=True)
        assert tokens["off"] == tokens["disk"], "greedy tokens differ between modes"
    medians = {
        mode: {
            k: statistics.median(x[k] for x in runs)
            for k in ("hit_rate", "ttft_ms_later_turns_median", "seconds")
            if runs and runs[0][k] is not None
        }
        for mode, runs in results.items()
    }
    print("medians:", medians)
    if a.json:
        print(json.dumps({"workload": vars(w), "runs": results, "medians": medians}))


if __name__ == "__main__":
    main()
