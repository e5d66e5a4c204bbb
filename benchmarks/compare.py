"""One command: aiolm and every installed peer on the same workload, one table with ratios.

    python benchmarks/compare.py [--repeats 3] [--single] [--markdown docs/benchmarks_table.md]

Peers are found in ./peers/<name> (benchmarks/peers/install.sh makes them). Each
runs in its own process and virtual environment, one after the other, so none
competes with another for the two cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / "peers"
HERE = Path(__file__).resolve().parent / "peers"


def _result(cmd: list[str], timeout: float) -> dict | None:
    print("$", " ".join(cmd), flush=True)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        print("  timed out", flush=True)
        return None
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
        if line.startswith("{") and '"output_tok_s"' in line:
            return json.loads(line)
    print("  failed:", (p.stderr or p.stdout)[-2000:], flush=True)
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--single", action="store_true", help="one 128-token prompt, 128 output tokens")
    ap.add_argument("--aiolm-dtypes", default="float32")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--markdown", help="also write the table to this file")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from aiolm.model.loader import embedded_model_path, resolve_model

    gguf = str(embedded_model_path())
    hf_dir = str(resolve_model(None).path)
    rows = []
    for dt in a.aiolm_dtypes.split(","):
        work = (["latency", "--batch-size", "1", "--input-len", "128", "--output-len", "128"] if a.single
                else ["throughput", "--num-requests", str(a.num_requests)])
        r = _result([sys.executable, "-c", "import sys; from aiolm.bench.cli import standalone; "
                     "sys.exit(standalone(sys.argv[1:]))", *work, "--repeats", str(a.repeats),
                     "--dtype", dt, "--json"], a.timeout)
        if r:
            if a.single:
                r["output_tok_s"] = r["decode_tok_s"]
            rows.append({"peer": "aiolm", "dtype": dt, **r})
    single = ["--single"] if a.single else []
    n = ["--num-requests", str(a.num_requests)]
    peers = [
        ("vllm", lambda dt: [str(PEERS / "vllm/bin/python"), str(HERE / "run_vllm.py"), hf_dir, "--dtype", dt,
                             "--repeats", str(a.repeats), *n, *single], ["float32", "bfloat16"]),
        ("transformers", lambda dt: [str(PEERS / "transformers/bin/python"), str(HERE / "run_transformers.py"),
                                     gguf, "--dtype", dt, "--repeats", str(a.repeats), *n], ["bfloat16", "float32"]),
        ("llamacpp", lambda dt: [str(PEERS / "llamacpp/bin/python"), str(HERE / "run_llamacpp.py"), gguf,
                                 "--repeats", str(a.repeats), *n, *single], ["q4_1"]),
    ]
    for name, cmd, dtypes in peers:
        if not (PEERS / name / "bin/python").exists():
            print(f"(peer {name} not installed: benchmarks/peers/install.sh {name})")
            continue
        if a.single and name == "transformers":
            continue
        for dt in dtypes:
            r = _result(cmd(dt), a.timeout)
            if r:
                rows.append(r)
    base = next((r["output_tok_s"] for r in rows if r["peer"] == "aiolm"), None)
    lines = ["| engine | dtype | output tok/s (median of %d) | aiolm / engine |" % a.repeats, "|---|---|---|---|"]
    for r in rows:
        ratio = f"{base / r['output_tok_s']:.2f}x" if base and r["peer"] != "aiolm" else ""
        lines.append(f"| {r['peer']} | {r['dtype']} | {r['output_tok_s']:.1f} | {ratio} |")
    table = "\n".join(lines)
    print(table)
    if a.markdown:
        Path(a.markdown).write_text(table + "\n")


if __name__ == "__main__":
    main()
