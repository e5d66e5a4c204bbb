"""The grammar processor's cost per decode step, by part: bitmask fill, mask, matcher advance.

64 rows (``--rows``), of which ``--constrained`` are under one JSON schema on the
embedded model's tokenizer, driven greedily through random logits so every
matcher walks its document. Each step times the processor's parts: ``fill``
(xgrammar walks each constrained row's state into the bitmask), ``mask`` (-inf
on the forbidden logits) and ``advance`` (each matcher accepts the picked
token). For scale, the same loop times the greedy sampler on those rows without
the grammar. ``--clock thread`` times this thread's CPU time only, steadier on a
shared machine.

    python benchmarks/bench_grammar.py [--rows 64] [--constrained 64] [--steps 100] [--clock wall|thread]
                                       [--schema JSON]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch

from aiolm.checkpoint.source import resolve_model
from aiolm.params import SamplingParams
from aiolm.sample.logits_processors import BatchRows
from aiolm.sample.logits_processors.grammar import Grammar
from aiolm.sample.sampler import Sampler, SamplingMetadata, make_generator
from aiolm.structured.backend import Compiler
from aiolm.structured.spec import StructuredOutputs

SCHEMA = {
    "type": "array",
    "minItems": 40,
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 12}},
        "required": ["id", "name"],
    },
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--constrained", type=int, default=None, help="rows under the schema (default: all)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--clock", choices=["wall", "thread"], default="wall")
    ap.add_argument("--schema", default=json.dumps(SCHEMA))
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    source = resolve_model(None)
    tok = source.load_tokenizer()
    vocab = source.config.vocab_size
    Compiler.configure(lambda: tok)
    spec = StructuredOutputs("json", args.schema)
    constrained = args.rows if args.constrained is None else args.constrained
    params = [
        SamplingParams(
            temperature=0, structured_outputs=spec if i < constrained else None, eos_token_ids=source.eos_token_ids
        )
        for i in range(args.rows)
    ]
    plain = [SamplingParams(temperature=0) for _ in range(args.rows)]
    t0 = time.perf_counter()
    proc = Grammar.build(BatchRows(params, [[] for _ in params], [[] for _ in params], vocab, torch.device("cpu")))
    print(f"first build (compile + {constrained} matchers): {(time.perf_counter() - t0) * 1e3:.1f} ms")
    assert proc is not None
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(args.rows, vocab, generator=g) * 3 for _ in range(4)]
    sampler = Sampler()
    meta = SamplingMetadata.build(
        plain, [[] for _ in plain], [[] for _ in plain], vocab, "cpu", [None] * args.rows, make_generator(0)
    )
    parts: dict[str, list[float]] = {
        "fill": [],
        "mask": [],
        "advance": [],
        "all three": [],
        "greedy sampler (reference)": [],
    }
    for i in range(args.steps):
        x = logits[i % len(logits)].clone()
        t0 = clock()
        proc.fill()
        t1 = clock()
        proc.mask(x)
        t2 = clock()
        picks = x.argmax(-1).tolist()
        t3 = clock()
        proc.advance([[p] for p in picks])
        t4 = clock()
        sampler(logits[i % len(logits)], meta)
        t5 = clock()
        for name, sec in (
            ("fill", t1 - t0),
            ("mask", t2 - t1),
            ("advance", t4 - t3),
            ("all three", t2 - t0 + t4 - t3),
            ("greedy sampler (reference)", t5 - t4),
        ):
            parts[name].append(sec * 1e3)
    print(f"rows={args.rows} constrained={constrained}")
    for name, ms in parts.items():
        ms = sorted(ms[3:])
        print(f"{name:<28} median={statistics.median(ms):7.3f} ms  min={ms[0]:7.3f} ms")


if __name__ == "__main__":
    main()
