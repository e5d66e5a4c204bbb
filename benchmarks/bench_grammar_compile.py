"""How long grammars take to compile (the figures behind --structured-outputs-compile-timeout),
and what a compile process costs.

Each grammar is compiled as the engine's compile processes do it (aiolm/structured/compile_worker.py):
one thread, no cache, the embedded model's tokenizer. ``--props`` lists sizes of JSON schemas of
that many optional integer properties; the series stops after the first that takes longer than
``--stop-after`` seconds. ``--pool`` also starts the engine's compile pool
(aiolm/structured/validator.py) and reports how long its first check waited and each process's
memory.

    python benchmarks/bench_grammar_compile.py [--props 100,400,1000,1500,2000] [--stop-after 60] [--pool]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from aiolm.checkpoint.source import resolve_model
from aiolm.structured.backend import compile_spec, tokenizer_info, xgrammar_module
from aiolm.structured.spec import StructuredOutputs, choice_grammar

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}


def tools_schema(n: int) -> dict:
    """tool_choice "required" over ``n`` tools of four parameters each (as aiolm/server/tools.py builds it)."""

    def call(i: int) -> dict:
        params = {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "unit": {"enum": ["c", "f"]},
                "detail": {"type": "boolean"},
            },
            "required": ["city"],
        }
        return {
            "type": "object",
            "properties": {"name": {"const": f"tool_{i}"}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }

    return {"type": "array", "items": {"anyOf": [call(i) for i in range(n)]}, "minItems": 1}


def props_schema(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}


def memory_mb(pid: int) -> tuple[int, int]:
    """(RSS, private) in MB."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split()[:2]
        fields[key] = int(value)
    return fields["Rss:"] // 1024, (fields["Private_Clean:"] + fields["Private_Dirty:"]) // 1024


async def pool_costs(folder: Path, vocab: int) -> None:
    from aiolm.structured.validator import Validator

    v = Validator("xgrammar", 60)
    v.configure(folder, vocab)
    t0 = time.perf_counter()
    await v.check(StructuredOutputs("regex", "[a-z]+"))
    print(f"pool: first check (processes starting) {time.perf_counter() - t0:.1f} s")
    assert v.pool is not None
    while not (len(v.pool.procs) == v.processes and all(p.ready for p in v.pool.procs)):
        await asyncio.sleep(0.1)
    print(f"pool: all {v.processes} processes ready after {time.perf_counter() - t0:.1f} s")
    for p in v.pool.procs:
        assert p.pid is not None
        rss, private = memory_mb(p.pid)
        print(f"pool: process {p.pid}: RSS {rss} MB, private {private} MB")
    await v.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--props", default="100,400,1000,1500,2000")
    ap.add_argument("--stop-after", type=float, default=60.0)
    ap.add_argument("--pool", action="store_true")
    args = ap.parse_args()
    source = resolve_model(None)
    vocab = source.config.vocab_size
    info = tokenizer_info(source.load_tokenizer, vocab, source.path)
    compiler = xgrammar_module().GrammarCompiler(info, max_threads=1, cache_enabled=False)
    cases = [
        ("choice of 3", StructuredOutputs("grammar", choice_grammar(["yes", "no", "maybe"]))),
        ("regex (phone)", StructuredOutputs("regex", r"\(\d{3}\) \d{3}-\d{4}")),
        ("json_object", StructuredOutputs("json_object")),
        ("person schema", StructuredOutputs("json", json.dumps(PERSON))),
        ("20 tools, required", StructuredOutputs("json", json.dumps(tools_schema(20)))),
    ]
    cases += [
        (f"{n} optional integer properties", StructuredOutputs("json", json.dumps(props_schema(int(n)))))
        for n in args.props.split(",")
    ]
    print(f"{'grammar':36} {'text':>10} {'compile':>10}")
    for name, spec in cases:
        t0 = time.perf_counter()
        compile_spec(compiler, spec)
        took = time.perf_counter() - t0
        print(f"{name:36} {len(spec.text):>8} B {took:>8.3f} s", flush=True)
        if took > args.stop_after:
            break
    if args.pool:
        asyncio.run(pool_costs(source.path, vocab))


if __name__ == "__main__":
    main()
