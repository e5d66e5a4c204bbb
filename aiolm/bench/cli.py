"""Entry of `aiolm bench {throughput,latency,serve}`."""

from __future__ import annotations

import argparse

from aiolm.bench import offline, serve
from aiolm.config import CliParser


def add_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="benchmarks: throughput, latency, serve")
    bsub = b.add_subparsers(dest="bench_cmd", required=True)
    offline.add_args(bsub)
    serve.add_args(bsub)


def main(args: argparse.Namespace) -> int:
    if getattr(args, "serve_bench", False):
        serve.run(args)
    else:
        offline.run(args)
    return 0


def standalone(argv: list[str] | None = None) -> int:
    p = CliParser(prog="aiolm")
    sub = p.add_subparsers(dest="cmd", required=True)
    add_parser(sub)
    return main(p.parse_args(["bench", *(argv or [])]) if argv is not None else p.parse_args())
