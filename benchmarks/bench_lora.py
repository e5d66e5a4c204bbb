"""What serving LoRA adapters costs: offline-64 on the embedded model with every request on
one of 8 rank-16 adapters, against the same batch on an engine without LoRA; and how long
an adapter takes to load.

    python benchmarks/bench_lora.py [--rounds 3] [--adapters 8] [--rank 16] [--json-out FILE]

The adapters (written once to ~/.cache/aiolm-bench/lora-smollm2-r<rank>/): PEFT LoRA folders
for SmolLM2-135M-Instruct (the embedded model's converted folder), targeting q/k/v/o and
gate/up/down, A and B drawn from N(0, 0.02^2) (seed = the adapter's number) so that every
layer's output moves. The workload is offline-64 (aiolm/bench/workload.py, seed 0); request
i runs on adapter i mod --adapters.

Each round starts an engine without LoRA and times the batch, then an engine with
``--enable-lora --max-loras <adapters> --max-lora-rank <rank>`` and times the batch on the
adapters and then on the base model (no adapter rows: what LoRA costs a request that does
not use it). Engines run one at a time, each after a warm-up on 4 requests; every figure is
the median over the rounds. Load time: the engine's check of a new folder
(``AsyncEngine.load_lora``), and a worker's first use of it (reading, cutting and writing
it into a slot, ``LoRAManager.slots_for``) timed in this process on the same model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from aiolm.bench.workload import random_workload
from aiolm.checkpoint.source import resolve_model
from aiolm.config import EngineArgs
from aiolm.engine.async_engine import AsyncEngine
from aiolm.lora.request import LoRARequest
from aiolm.params import OutputKind, SamplingParams

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(count: int, rank: int) -> list[Path]:
    """PEFT folders for the embedded model, written once (``done`` marks a complete set)."""
    root = Path.home() / ".cache" / "aiolm-bench" / f"lora-smollm2-r{rank}"
    paths = [root / f"adapter{i}" for i in range(count)]
    if (root / "done").exists() and all(p.is_dir() for p in paths):
        return paths
    import peft
    import transformers

    base = resolve_model(None).path
    for i, path in enumerate(paths):
        model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        lora = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, p in lora.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        lora.save_pretrained(path)
    (root / "done").write_text("")
    return paths


async def _timed(engine: AsyncEngine, items: list[Any], loras: list[LoRARequest | None]) -> float:
    async def one(it: Any, lora: LoRARequest | None) -> None:
        p = SamplingParams(temperature=0, max_tokens=it.max_tokens, ignore_eos=True, output_kind=OutputKind.FINAL_ONLY)
        async for _ in engine.generate({"prompt_token_ids": it.prompt_token_ids}, p, lora_request=lora):
            pass

    t0 = time.perf_counter()
    await asyncio.gather(*(one(it, lr) for it, lr in zip(items, loras)))
    return time.perf_counter() - t0


async def _round(items: list[Any], adapters: list[Path], rank: int) -> dict[str, float]:
    out: dict[str, float] = {}
    none = [None] * len(items)
    async with AsyncEngine(EngineArgs()) as engine:
        await _timed(engine, items[:4], none[:4])
        engine.scheduler.reset_prefix_cache()
        out["no_lora_s"] = await _timed(engine, items, none)
    args = EngineArgs(enable_lora=True, max_loras=len(adapters), max_lora_rank=rank)
    async with AsyncEngine(args) as engine:
        loras: list[LoRARequest | None] = []
        t0 = time.perf_counter()
        for i, path in enumerate(adapters):
            loras.append(await engine.load_lora(f"adapter{i}", str(path)))
        out["check_s_per_adapter"] = (time.perf_counter() - t0) / len(adapters)
        spread = [loras[i % len(loras)] for i in range(len(items))]
        await _timed(engine, items[:4], spread[:4])
        engine.scheduler.reset_prefix_cache()
        out["lora_s"] = await _timed(engine, items, spread)
        engine.scheduler.reset_prefix_cache()
        out["lora_engine_base_s"] = await _timed(engine, items, none)
    return out


def worker_load_times(adapters: list[Path], rank: int) -> list[float]:
    """Seconds a worker takes to read an adapter and write it into a slot, per adapter."""
    from aiolm.lora.manager import LoRAManager
    from aiolm.model.registry import build_model

    source = resolve_model(None)
    model = build_model(source, torch.float32, "cpu", lora=(2, rank))
    manager = LoRAManager(model, source.config, 1)  # a host cache of one: every use reads the folder
    times = []
    for i, path in enumerate(adapters):
        t0 = time.perf_counter()
        manager.slots_for([LoRARequest(f"adapter{i}", i + 1, str(path))])
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    adapters = make_adapters(a.adapters, a.rank)
    items = random_workload(64, (64, 256), (32, 128), 0)
    out_tokens = sum(it.max_tokens for it in items)
    rounds = []
    for r in range(a.rounds):
        rounds.append(asyncio.run(_round(items, adapters, a.rank)))
        print(f"round {r + 1}: {json.dumps(rounds[-1])}", flush=True)
    load = worker_load_times(adapters, a.rank)

    def med(key: str) -> float:
        return statistics.median(x[key] for x in rounds)

    result = {
        "output_tokens": out_tokens,
        "no_lora_tok_s": out_tokens / med("no_lora_s"),
        "lora_tok_s": out_tokens / med("lora_s"),
        "lora_engine_base_tok_s": out_tokens / med("lora_engine_base_s"),
        "lora_cost": med("lora_s") / med("no_lora_s"),
        "lora_engine_base_cost": med("lora_engine_base_s") / med("no_lora_s"),
        "engine_check_ms": 1000 * med("check_s_per_adapter"),
        "worker_load_ms_median": 1000 * statistics.median(load),
        "rounds": rounds,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=1))
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
