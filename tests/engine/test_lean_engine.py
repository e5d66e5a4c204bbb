"""The engine process holds config, tokenizer, scheduler and actors: no model stack, no torch.

An AsyncEngine with worker processes starts in a fresh interpreter (so this test process's
own imports do not count), answers a plain-text request with the embedded model, and then
lists what it imported: none of aiolm's model, layer, kernel, attention or platform modules,
and not torch, before or after ``start()``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = (
    "torch",
    "aiolm.model",
    "aiolm.kernels",
    "aiolm.attention",
    "aiolm.platforms",
    "aiolm.quant",
    "aiolm.worker",
    "xgrammar",
)

_CHILD = """
import asyncio, json, sys
from aiolm import AsyncEngine, SamplingParams

FORBIDDEN = tuple(sys.argv[1].split(","))

def imported():
    return sorted(m for m in sys.modules if m in FORBIDDEN or m.startswith(tuple(f + "." for f in FORBIDDEN)))

async def main():
    engine = AsyncEngine(max_model_len=256, kv_cache_memory=64 << 20, max_num_seqs=4, num_threads=1,
                         executor="mp", device="auto")
    before = imported()
    async with engine:
        started = imported()
        async for out in engine.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0)):
            pass
        print(json.dumps({"before": before, "started": started, "after": imported(),
                          "text": out.outputs[0].text, "tokens": len(out.outputs[0].token_ids)}))

asyncio.run(main())
"""


@pytest.mark.slow
def test_engine_process_imports_no_model_stack_nor_torch():
    run = subprocess.run(
        [sys.executable, "-c", _CHILD, ",".join(FORBIDDEN)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["tokens"] == 8 and report["text"].strip(), report  # the workers did generate
    for when in ("before", "started", "after"):
        assert report[when] == [], f"{when} start(): the engine process imported {report[when][:10]}"
