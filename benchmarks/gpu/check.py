"""The GPU checks that need a real CUDA device, one per subcommand (run by check.sh).

    python benchmarks/gpu/check.py parity       greedy tokens: CUDA (torch and Triton attention) vs CPU
    python benchmarks/gpu/check.py graphs       CudaGraphRunner replay vs eager on the real model
    python benchmarks/gpu/check.py decode-speed decode step time, eager vs graphs, Triton attention
    python benchmarks/gpu/check.py engine       offline-64 and single stream through the engine, graphs and eager

Exit status: 0 passed, 1 failed, 2 no GPU, 3 skipped (a line "skipped: <reason>" says why).
The model is the embedded SmolLM2-135M; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # a checkout without installing; tests/paged.py

import torch  # noqa: E402

PROMPTS = ["The capital of France is", "Write a haiku about the sea:",
           "List three prime numbers greater than ten, separated by commas:"]
SKIP = 3


def _model(device: str, dtype: torch.dtype = torch.float32, attention: str = "auto"):
    from aiolm.model.loader import resolve_model
    from aiolm.model.registry import build_model

    source = resolve_model(None)
    return source, build_model(source, dtype, torch.device(device), attention=attention)


def parity(max_new: int) -> int:
    from paged import PagedHarness

    source, cpu_model = _model("cpu")
    tok = source.load_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    want = PagedHarness(cpu_model).greedy(prompts, max_new, split=4)
    results = {}
    for attention in ("torch", "triton"):
        _, cuda_model = _model("cuda", attention=attention)
        results[f"cuda {attention} attention"] = PagedHarness(cuda_model, device="cuda").greedy(
            prompts, max_new, split=4)
    ok = True
    for name, got in results.items():
        same = [sum(a == b for a, b in zip(g, w)) for g, w in zip(got, want)]
        match = got == want
        ok &= match
        print(f"{name}: {'same tokens' if match else 'DIFFERENT'} as the CPU path "
              f"({sum(same)}/{sum(len(w) for w in want)} tokens equal)")
    return 0 if ok else 1


def _triton_model():
    return _model("cuda", torch.bfloat16, attention="triton")[1]


def _decode_setup(model, batch: int, context: int, device: str = "cuda"):
    """One KV cache of random values and `batch` decode rows, each `context` tokens in."""
    from aiolm.attention.metadata import AttentionMetadata
    from aiolm.attention.torch_backend import kv_cache_shape

    cfg = model.config
    bs = 16
    pages = (context + 64) // bs + 1
    caches = [torch.randn(kv_cache_shape(batch * pages + 1, bs, cfg.num_kv_heads, cfg.head_dim),
                          dtype=torch.bfloat16, device=device) for _ in range(cfg.num_layers)]
    tables = [list(range(1 + i * pages, 1 + (i + 1) * pages)) for i in range(batch)]

    def step_inputs(pos: int):
        meta = AttentionMetadata.build([1] * batch, [pos + 1] * batch, tables, bs, device)
        ids = torch.randint(100, 1000, (batch,), device=device)
        return ids, torch.full((batch,), pos, device=device), meta

    return caches, step_inputs, pages * bs


def graphs(max_num_seqs: int) -> int:
    from aiolm.worker.cuda_graph import CudaGraphRunner, capture_sizes, plan_step

    ok = True
    model = _triton_model()
    for batch in (1, 3, 8, 13):
        caches, step_inputs, max_len = _decode_setup(model, batch, 100)
        sizes = capture_sizes(max_num_seqs)
        runner = CudaGraphRunner(lambda i, p, m: model(i, p, caches, m), sizes, max_len // 16, 16, max_len, "cuda")
        runner.capture()
        worst = 0.0
        for pos in range(100, 110):
            ids, p, meta = step_inputs(pos)
            saved = [c.clone() for c in caches]
            eager = model(ids, p, caches, meta).float()
            for c, s in zip(caches, saved):
                c.copy_(s)
            plan = plan_step(meta.num_reqs, meta.num_tokens, sizes)
            got = runner.run(plan.size, ids, p, meta).float()
            worst = max(worst, (got - eager).abs().max().item())
            ok &= got.shape == eager.shape
        good = worst < 1e-2  # bfloat16 hidden states; the same kernels either way
        ok &= good
        print(f"batch {batch}: graph {plan.size}, max |graph - eager| = {worst:.2e} {'ok' if good else 'TOO FAR'}")
    return 0 if ok else 1


def decode_speed(max_num_seqs: int, steps: int) -> int:
    from aiolm.worker.cuda_graph import CudaGraphRunner, capture_sizes, plan_step

    model = _triton_model()
    print(f"{'batch':>5} {'eager ms':>9} {'graph ms':>9} {'speed-up':>8}")
    for batch in (1, 8, 32, 64):
        caches, step_inputs, max_len = _decode_setup(model, batch, 512)
        sizes = capture_sizes(max_num_seqs)
        runner = CudaGraphRunner(lambda i, p, m: model(i, p, caches, m), sizes, max_len // 16, 16, max_len, "cuda")
        runner.capture()
        ids, p, meta = step_inputs(512)
        plan = plan_step(batch, batch, sizes)
        times = {}
        for name, fn in (("eager", lambda: model(ids, p, caches, meta)),
                         ("graph", lambda: runner.run(plan.size, ids, p, meta))):
            fn()
            torch.cuda.synchronize()
            t = []
            for _ in range(steps):
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                t.append(time.perf_counter() - t0)
            times[name] = statistics.median(t) * 1e3
        print(f"{batch:>5} {times['eager']:>9.2f} {times['graph']:>9.2f} {times['eager'] / times['graph']:>7.1f}x")
    return 0


def engine() -> int:
    """The whole engine on the GPU (worker process, Triton attention, bfloat16): offline-64
    throughput and single-stream decode through `aiolm bench`, with CUDA graphs (the
    default) and with --enforce-eager."""
    import json
    import subprocess

    base = ["--device", "cuda", "--attention-backend", "triton", "--json"]
    runs = {"offline-64, graphs": ["bench", "throughput", "--repeats", "2"],
            "offline-64, eager": ["bench", "throughput", "--repeats", "2", "--enforce-eager"],
            "single stream, graphs": ["bench", "latency", "--batch-size", "1", "--input-len", "128",
                                      "--output-len", "128", "--repeats", "3"],
            "single stream, eager": ["bench", "latency", "--batch-size", "1", "--input-len", "128",
                                     "--output-len", "128", "--repeats", "3", "--enforce-eager"]}
    for name, cmd in runs.items():
        out = subprocess.run([sys.executable, "-m", "aiolm.cli", *cmd, *base], capture_output=True, text=True,
                             timeout=300)
        if out.returncode != 0:
            print(f"{name}: FAILED\n{out.stderr[-3000:]}")
            return 1
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{name}: {r.get('output_tok_s', r.get('decode_tok_s')):.1f} tok/s (bfloat16, Triton attention)")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=["parity", "graphs", "decode-speed", "engine"])
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--steps", type=int, default=50)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("no GPU: torch.cuda.is_available() is False")
        return 2
    from aiolm.kernels import triton as triton_kernels

    if not triton_kernels.available():
        print("skipped: triton is not installed")
        return SKIP
    if a.part == "engine":
        return engine()
    if a.part == "parity":
        return parity(a.max_new)
    if a.part == "graphs":
        return graphs(a.max_num_seqs)
    return decode_speed(a.max_num_seqs, a.steps)


if __name__ == "__main__":
    sys.exit(main())
