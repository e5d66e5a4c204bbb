"""The engine process's footprint: `aiolm serve`'s time to /health and its resident memory.

Starts `aiolm serve` (the embedded model unless --model is given; run it once first so the
GGUF conversion cache is warm) from one or more source trees, alternating between them,
and reports per run and as medians: seconds from launch until /health answers 200, and
the serving process's VmRSS (/proc/<pid>/status) once /health answers and after one
completion; and whether libtorch is mapped into that process.

    python benchmarks/engine_footprint.py --runs 3 before=/tmp/base after=.

Each tree runs with PYTHONPATH set to it and this interpreter, so an old commit checked
out with `git worktree add /tmp/base <commit>` is measured with the same packages.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from typing import Any

_SERVE = "import sys; from aiolm.cli import main; sys.argv[0] = 'aiolm'; sys.exit(main())"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _torch_mapped(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return any("libtorch" in line for line in f)


def _get(url: str, body: dict[str, Any] | None = None, timeout: float = 120) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def one_run(tree: str, extra: list[str]) -> dict[str, Any]:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVE, "serve", "--port", str(port), *extra],
        cwd=tree,
        env=dict(os.environ, PYTHONPATH=os.path.abspath(tree)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None:
                raise SystemExit(f"{tree}: aiolm serve exited with {proc.returncode}")
            time.sleep(0.05)
        health_s = time.monotonic() - start
        rss_health = _rss_mib(proc.pid)
        model = _get(base + "/v1/models")["data"][0]["id"]
        _get(
            base + "/v1/completions",
            {"model": model, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0},
        )
        time.sleep(0.5)
        return {
            "health_s": health_s,
            "rss_health_mib": rss_health,
            "rss_after_mib": _rss_mib(proc.pid),
            "torch_mapped": _torch_mapped(proc.pid),
        }
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trees", nargs="+", help="NAME=PATH of a source tree")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--serve-args", default="--num-threads 1", help="extra flags for aiolm serve")
    a = p.parse_args()
    trees = dict(t.split("=", 1) for t in a.trees)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for i in range(a.runs):
        for name, tree in trees.items():  # alternating, so drift in the machine's load hits both
            r = one_run(tree, a.serve_args.split())
            results[name].append(r)
            print(
                name, i, json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}), flush=True
            )
    for name, rs in results.items():
        medians = {
            k: round(statistics.median(r[k] for r in rs), 2) for k in ("health_s", "rss_health_mib", "rss_after_mib")
        }
        print(name, "median", json.dumps(medians), "libtorch mapped:", sorted({r["torch_mapped"] for r in rs}))


if __name__ == "__main__":
    main()
