"""Entry of `aiolm bench {throughput,latency,serve}`."""

from __future__ import annotations

import argparse
import sys

from aiolm.bench import offline, serve
from aiolm.config import CliParser, EngineArgs


def add_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="benchmarks: throughput, latency, serve")
    bsub = b.add_subparsers(dest="bench_cmd", required=True)
    offline.add_args(bsub)
    serve.add_args(bsub)


def main(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    """Run the benchmark; what stops it (bad engine flags, a workload that does not fit, a
    run where nothing completed) is one line on stderr and a non-zero exit, no traceback."""
    if getattr(args, "serve_bench", False):
        try:
            serve.run(args)
        except (serve.BenchError, ValueError) as e:
            print(f"aiolm bench serve: error: {e}", file=sys.stderr)
            return 1
        return 0
    if parser is not None:
        _check_engine_flags(parser, args)
    try:
        offline.run(args)
    except ValueError as e:  # ParamError and ModelLoadError are ones
        print(f"aiolm bench: error: {e}", file=sys.stderr)
        return 1
    return 0


def _check_engine_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The engine flags and the model, checked as `aiolm serve` checks them: exit 2."""
    from aiolm.engine.async_engine import check_model_args

    try:
        check_model_args(EngineArgs.from_namespace(args))
    except (TypeError, ValueError) as e:
        parser.error(str(e))


def standalone(argv: list[str] | None = None) -> int:
    p = CliParser(prog="aiolm")
    sub = p.add_subparsers(dest="cmd", required=True)
    add_parser(sub)
    return main(p.parse_args(["bench", *(argv or [])]) if argv is not None else p.parse_args(), p)
