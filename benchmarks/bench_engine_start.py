"""How long an engine takes to start, answer a first request and shut down, in a fresh process.

    python benchmarks/bench_engine_start.py                  # the embedded model, default engine
    python benchmarks/bench_engine_start.py --light          # the test suite's engine (tests/engine)
    python benchmarks/bench_engine_start.py --light --grammar
    python benchmarks/ab_revisions.py ff55226 --rounds 5 --fields first_request_s,shutdown_s \\
        -- benchmarks/bench_engine_start.py --light

One life cycle per process, because only the first start in a process pays for the imports
(a server's or a test's start does). Prints one JSON line: ``start_s`` (``AsyncEngine.start``:
the workers' torch import and model build, the engine's tokenizer), ``first_request_s`` (an
8-token greedy request, or with ``--grammar`` a JSON-schema one, the first grammar being what
costs), ``shutdown_s`` (until every worker has exited), and ``import_s`` (importing the engine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

# The test suite's engine (tests/engine/engine_harness.py): small context and KV cache, one thread.
LIGHT = dict(max_model_len=1024, kv_cache_memory=256 << 20, max_num_seqs=32, max_num_batched_tokens=1024, num_threads=1)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}


async def life(light: bool, grammar: bool) -> dict[str, float]:
    t0 = time.perf_counter()
    from aiolm import AsyncEngine, SamplingParams
    from aiolm.structured.spec import StructuredOutputs

    t1 = time.perf_counter()
    engine = AsyncEngine(**(LIGHT if light else {}))
    await engine.start()
    t2 = time.perf_counter()
    spec = StructuredOutputs("json", json.dumps(SCHEMA)) if grammar else None
    params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=spec)
    async for _ in engine.generate("Give me a person as JSON:", params):
        pass
    t3 = time.perf_counter()
    await engine.shutdown()
    t4 = time.perf_counter()
    return {"start_s": t2 - t1, "first_request_s": t3 - t2, "shutdown_s": t4 - t3, "import_s": t1 - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--light", action="store_true", help="the test suite's engine arguments")
    ap.add_argument("--grammar", action="store_true", help="the first request asks for a JSON schema")
    a = ap.parse_args()
    print(json.dumps({k: round(v, 3) for k, v in asyncio.run(life(a.light, a.grammar)).items()}))


if __name__ == "__main__":
    main()
