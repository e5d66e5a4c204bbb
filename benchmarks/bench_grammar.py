"""The grammar processor's cost per decode step: fill each row's bitmask and mask the logits.

64 rows (``--rows``) under one JSON schema on the embedded model's tokenizer,
driven greedily through random logits so every matcher walks its document; each
timed step is the processor's ``apply`` (the host-side bitmask fill of every row
plus the masking) and ``advance`` with the picked tokens. For scale, the same
loop times the greedy sampler on those rows without the grammar. ``--clock
thread`` times this thread's CPU time only, steadier on a shared machine.

    python benchmarks/bench_grammar.py [--rows 64] [--steps 100] [--clock wall|thread] [--schema JSON]
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

from aiolm.model.loader import resolve_model
from aiolm.params import SamplingParams
from aiolm.sample.logits_processors import BatchRows
from aiolm.sample.logits_processors.grammar import Grammar
from aiolm.sample.sampler import Sampler, SamplingMetadata, make_generator
from aiolm.structured.backend import Compiler
from aiolm.structured.spec import StructuredOutputs

SCHEMA = {"type": "array", "minItems": 40, "items": {"type": "object", "properties": {
    "id": {"type": "integer"}, "name": {"type": "string", "maxLength": 12}}, "required": ["id", "name"]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
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
    params = [SamplingParams(temperature=0, structured_outputs=spec, eos_token_ids=source.eos_token_ids)
              for _ in range(args.rows)]
    plain = [SamplingParams(temperature=0) for _ in range(args.rows)]
    t0 = time.perf_counter()
    proc = Grammar.build(BatchRows(params, [[] for _ in params], [[] for _ in params], vocab, torch.device("cpu")))
    print(f"first build (compile + {args.rows} matchers): {(time.perf_counter() - t0) * 1e3:.1f} ms")
    assert proc is not None
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(args.rows, vocab, generator=g) * 3 for _ in range(4)]
    sampler = Sampler()
    meta = SamplingMetadata.build(plain, [[] for _ in plain], [[] for _ in plain], vocab, "cpu",
                                  [None] * args.rows, make_generator(0))
    grammar_ms, sampler_ms = [], []
    for i in range(args.steps):
        x = logits[i % len(logits)].clone()
        t = clock()
        proc.apply(x)
        picks = x.argmax(-1).tolist()
        proc.advance([[p] for p in picks])
        grammar_ms.append((clock() - t) * 1e3)
        t = clock()
        sampler(logits[i % len(logits)], meta)
        sampler_ms.append((clock() - t) * 1e3)
    for name, ms in (("grammar apply + advance", grammar_ms), ("greedy sampler (reference)", sampler_ms)):
        ms = sorted(ms[3:])
        print(f"{name:<28} rows={args.rows}  median={statistics.median(ms):7.2f} ms  min={ms[0]:7.2f} ms")


if __name__ == "__main__":
    main()
