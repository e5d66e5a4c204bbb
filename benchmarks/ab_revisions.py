"""Benchmark two revisions of aiolm round-robin in one run: before vs after a change.

    python benchmarks/ab_revisions.py BEFORE [AFTER] --rounds 3 -- bench throughput --repeats 1
    python benchmarks/ab_revisions.py 9cd6f87 HEAD --rounds 3 -- bench latency --batch-size 1
    python benchmarks/ab_revisions.py 9cd6f87 --fields step_costs_ms.decode_steps.schedule \
        -- bench latency --batch-size 64 --input-len 128 --output-len 32 --repeats 1
    python benchmarks/ab_revisions.py ff55226 --rounds 5 -- benchmarks/bench_engine_start.py --light

Each revision is checked out once into a temporary git worktree; every round runs the
aiolm command (``python -m aiolm.cli ...`` with that worktree first on the path) once per
revision, alternating which goes first, so the machine's slow spells fall on both alike.
AFTER defaults to the working tree itself. A command that names a ``.py`` file runs this
tree's script of that name instead, on each revision's aiolm (a benchmark script that the
older revision lacks); it prints one JSON line of its own. Prints each run and the medians of the
``--json`` fields that bench prints (output_throughput / decode tok/s), and of any
``--fields`` named by their dotted path in that JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _checkout(rev: str, into: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(into), rev], check=True)
    return into


def _run(tree: Path, command: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    if command[0].endswith(".py"):  # this tree's script, which prints its JSON line as it is
        argv = [str(ROOT / command[0]), *command[1:]]
    else:
        argv = ["-m", "aiolm.cli", *command, "--json"]
    out = subprocess.run(
        [sys.executable, *argv],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def _headline(result: dict) -> tuple[str, float]:
    for key in ("output_throughput", "output_tok_s", "decode_tok_s", "tok_s"):
        if key in result:
            return key, float(result[key])
    number = next((k for k, v in result.items() if isinstance(v, (int, float))), None)
    if number is None:
        raise SystemExit(f"no number in the bench output: {result}")
    return number, float(result[number])


def _field(result: dict, path: str) -> float:
    value: object = result
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            raise SystemExit(f"no field {path!r} in the bench output: {result}")
        value = value[part]
    return float(value)  # type: ignore[arg-type]


def main() -> None:
    argv = sys.argv[1:]
    command = argv[argv.index("--") + 1 :] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before")
    ap.add_argument("after", nargs="?", default=None, help="a revision (default: this working tree)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fields", default="", help="comma-separated dotted paths of more JSON numbers to compare")
    a = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if not command:
        raise SystemExit("give the aiolm command after --, e.g. -- bench throughput --repeats 1")
    with tempfile.TemporaryDirectory(prefix="aiolm-ab-") as tmp:
        trees = {"before": _checkout(a.before, Path(tmp) / "before")}
        trees["after"] = _checkout(a.after, Path(tmp) / "after") if a.after else ROOT
        try:
            fields = [f for f in a.fields.split(",") if f]
            results: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
            for r in range(a.rounds):
                order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
                for name in order:
                    out = _run(trees[name], command)
                    key, value = _headline(out)
                    got = {key: value, **{f: _field(out, f) for f in fields}}
                    for k, v in got.items():
                        results[name].setdefault(k, []).append(v)
                    print(f"round {r + 1} {name}: " + ", ".join(f"{k} = {v:.3f}" for k, v in got.items()), flush=True)
            for k in results["before"]:
                before, after = statistics.median(results["before"][k]), statistics.median(results["after"][k])
                print(f"median {k}: before {before:.3f}, after {after:.3f} ({after / before:.3f}x)")
        finally:
            for tree in trees.values():
                if tree != ROOT:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)


if __name__ == "__main__":
    main()
