"""Two versions of one CPU kernel source, timed in turns in one process.

    python benchmarks/ab_kernel.py CASE [--old REV] [--threads N] [--rounds N]

On a shared 2-vCPU box the speed of the machine wanders by 10-20% within minutes, more
than most kernel changes: separate runs of a benchmark cannot tell two versions apart.
This builds the case's source file as it is at git revision REV (default HEAD) and as it
is in the working tree, each with its own revision's headers and as a library of its own
whose ops are registered under another namespace (aiolm_old, aiolm_new), checks that both
give the same outputs, and times them call for call in alternation, so that the box's drift
falls on both.

Cases (the real model's shapes where it has them):
  head          the embedded model's LM head (Q8_0 49152 x 576, 30 MB: from memory) at
                --rows (default 11), int8 x (ext/cpu/gguf_int8.cpp)
  moe-head      the benchmark MoE's LM head (its Q4_K_M file's Q6_K 49152 x 1024, 63 MB as
                the kernels keep it) at --rows (default 16), int8 x
  moe-head-float  the same with float x (ext/cpu/gguf_linear.cpp and gguf_linear.h)
  prompt-layer  a 2048-row prompt through one layer's four linears (Q4_1 blocks of random
                codes in the embedded model's shapes), int8 x
  model         every linear of the embedded model (30 layers' and the head, its own GGUF
                blocks: from memory) in a decode step's order, at --rows (default 11), int8 x
  model-float   the same with float x (ext/cpu/gguf_linear.cpp and gguf_linear.h: the default
                path of a decode step), at --rows
  panels        every float32 linear of the embedded model (panels of 16 columns, 540 MB:
                from memory) in a decode step's order, at --rows (ext/cpu/panel_gemm.cpp)
  tinyllama     make_model.py's 1.1B shapes, three layers' linears of random Q4_0 codes (from
                memory), at --rows (default 11), int8 x
  tinyllama-float  the same with float x (ext/cpu/gguf_linear.cpp), at --rows
  decode-attn   a decode step's attention, --rows rows (default 64) x 256 keys, 30 layers'
                caches of --kv-dtype (default float16), pages at random
                (ext/cpu/paged_attention.cpp)
  prefill-attn  one layer of a 2048-token prefill's attention, float16 cache
  encoder-attn  a BERT step's bidirectional attention (bench_embed.py's MiniLM shapes: 169
                sentences of 10-80 tokens, 12 heads of 32), its 6 layers, q, k and v in
                --kv-dtype (float16 means bfloat16 here: what the model hands over)
                (ext/cpu/encoder_attention.cpp)
  moe           every expert layer of the benchmark MoE (make_model.py --moe: its Q4_K_M
                file's blocks, from memory) for --rows tokens (default 16) routed top-8 at
                random, int8 x (aiolm::gguf_moe, ext/cpu/fused_moe.cpp)
  moe-float     the same with float x (aiolm::gguf_moe's default path)
  moe-bf16      one layer of the benchmark MoE's shapes as bfloat16 experts (random weights)
                for --rows tokens (default 2048, a prompt step) routed top-8 at random
                (aiolm::fused_moe's best path: AMX tiles where the CPU has them)
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_linear import random_blocks  # noqa: E402  (this folder: the script's own)

from aiolm.kernels import cpu  # noqa: E402

SOURCES = {
    "head": "gguf_int8.cpp",
    "moe-head": "gguf_int8.cpp",
    "moe-head-float": "gguf_linear.cpp",
    "prompt-layer": "gguf_int8.cpp",
    "tinyllama": "gguf_int8.cpp",
    "model": "gguf_int8.cpp",
    "model-float": "gguf_linear.cpp",
    "tinyllama-float": "gguf_linear.cpp",
    "panels": "panel_gemm.cpp",
    "decode-attn": "paged_attention.cpp",
    "prefill-attn": "paged_attention.cpp",
    "encoder-attn": "encoder_attention.cpp",
    "moe": "fused_moe.cpp",
    "moe-float": "fused_moe.cpp",
    "moe-bf16": "fused_moe.cpp",
}
MOE = Path.home() / ".cache/aiolm-bench/qwen3moe-2b-random/model-Q4_K_M.gguf"


def build(source: str, namespace: str, out_dir: Path, include: Path) -> None:
    """Compiles one source with the kernels' own flags and the headers in `include`, its ops
    registered under `namespace`."""
    for macro in ("TORCH_LIBRARY_FRAGMENT", "TORCH_LIBRARY_IMPL", "TORCH_LIBRARY"):
        source = source.replace(f"{macro}(aiolm,", f"{macro}({namespace},")
    src, obj, lib = (out_dir / f"{namespace}{ext}" for ext in (".cpp", ".o", ".so"))
    src.write_text(source)
    flags, compiler = [*cpu._compile_flags(), f"-I{include}"], cpu._compiler()
    subprocess.run([compiler, *flags, "-c", str(src), "-o", str(obj)], check=True, capture_output=True)
    subprocess.run(cpu._link_command([obj], lib, compiler), check=True, capture_output=True)
    torch.ops.load_library(str(lib))


def linear_case(case: str, rows: int):
    """(weights, inputs) of a linear case: each call runs every weight on its input."""
    rng = np.random.default_rng(0)
    if case == "head":
        from aiolm.checkpoint.source import resolve_model
        from aiolm.model.registry import build_model

        ws = [build_model(resolve_model(None)).lm_head.gguf.blocks]
    elif case == "moe-head":
        from aiolm.checkpoint.source import resolve_model
        from aiolm.quant.gguf_blocks import GGUFBlocksConfig

        ws = [GGUFBlocksConfig(MOE, resolve_model(str(MOE)).config, inner=None).blocks(["lm_head.weight"])]  # type: ignore[arg-type]
    elif case == "model":
        from aiolm.checkpoint.source import resolve_model
        from aiolm.model.registry import build_model

        ws = [
            mod.gguf.blocks
            for mod in build_model(resolve_model(None)).modules()
            if getattr(mod, "gguf", None) is not None
        ]
    elif case == "prompt-layer":
        rows = 2048
        ws = [random_blocks(n, k, rng, "Q4_1") for n, k in ((960, 576), (576, 576), (3072, 576), (576, 1536))]
    else:
        ws = [
            random_blocks(n, k, rng)
            for n, k in ((2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632))
            for _ in range(3)
        ]
    xs = [torch.randn(rows, w.nblocks * 32) for w in ws]
    return ws, xs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case", choices=sorted(SOURCES))
    ap.add_argument("--old", default="HEAD", help="git revision of the first version (default HEAD)")
    ap.add_argument("--rows", type=int, default=None, help="default: 64 for decode-attn, else 11")
    ap.add_argument("--kv-dtype", choices=("float16", "float32"), default="float16", help="decode-attn's caches")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=21)
    a = ap.parse_args()
    if a.rows is None:
        sizes = {"decode-attn": 64, "moe": 16, "moe-float": 16, "moe-head": 16, "moe-head-float": 16, "moe-bf16": 2048}
        a.rows = sizes.get(a.case, 11)
    torch.set_num_threads(a.threads)
    assert cpu.load(), "the CPU kernels did not build"
    path = f"ext/cpu/{SOURCES[a.case]}"
    old = subprocess.run(
        ["git", "show", f"{a.old}:{path}"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "archive", a.old, "ext/cpu"], cwd=ROOT, check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        build(old, "aiolm_old", Path(tmp), Path(tmp) / "ext" / "cpu")
        build((ROOT / path).read_text(), "aiolm_new", Path(tmp), ROOT / "ext" / "cpu")
    versions = ("aiolm_old", "aiolm_new")

    if a.case == "panels":
        ws, xs = panel_case(a.rows)

        def call(ns: str):
            op = getattr(torch.ops, ns).panel_linear
            return [op(x, w.data, w.out_features) for w, x in zip(ws, xs)]
    elif a.case.endswith("-float") and a.case != "moe-float":
        ws, xs = linear_case(a.case.removesuffix("-float"), a.rows)

        def call(ns: str):
            op = getattr(torch.ops, ns).gguf_linear
            return [op(x, w.qs, w.scale, w.mins, w.qtype, w.n) for w, x in zip(ws, xs)]
    elif a.case in ("head", "moe-head", "prompt-layer", "tinyllama", "model"):
        ws, xs = linear_case(a.case, a.rows)

        def call(ns: str):
            op = getattr(torch.ops, ns).gguf_int8_linear
            return [op(x, w.qs, w.scale, w.mins, w.qtype, w.n, -1) for w, x in zip(ws, xs)]
    elif a.case == "moe-bf16":
        call = moe_bf16_case(a.rows)
    elif a.case.startswith("moe"):
        call = moe_case(a.rows, int8=a.case == "moe")
    elif a.case == "encoder-attn":
        call = encoder_case(torch.bfloat16 if a.kv_dtype == "float16" else torch.float32)
    else:
        call = attention_case(a.case, a.rows, getattr(torch, a.kv_dtype))
    first, second = (call(ns) for ns in versions)
    # tiling may reorder float sums: close, not equal (a bfloat16 output by one step of its own)
    tol = 1e-2 if a.case == "encoder-attn" and a.kv_dtype == "float16" else 1e-4
    for f, s in zip(first, second):
        torch.testing.assert_close(s, f, rtol=tol, atol=tol)
    times = {ns: [] for ns in versions}
    for _ in range(a.rounds):
        for ns in versions:
            t0 = time.perf_counter()
            call(ns)
            times[ns].append(time.perf_counter() - t0)
    base = statistics.median(times["aiolm_old"])
    rows = f", {a.rows} rows" if a.case not in ("prompt-layer", "prefill-attn", "encoder-attn") else ""
    for ns, label in zip(versions, (f"{a.old} ", "worktree")):
        med = statistics.median(times[ns])
        print(
            f"{a.case} ({a.threads} threads{rows}), "
            f"{label}: median {med * 1e3:.2f} ms, best {min(times[ns]) * 1e3:.2f} ms, {med / base:.3f}x the old"
        )


def panel_case(rows: int):
    """(weights, inputs): the embedded model's float32 panels, as its float32 steps above the
    blocks' rows run them (the LM head's too)."""
    from aiolm.checkpoint.source import resolve_model
    from aiolm.model.registry import build_model

    ws = []
    for mod in build_model(resolve_model(None), torch.float32).modules():
        packed = getattr(mod, "packed", None)  # a layer's float32 matmul (a GGUF layer's beside its blocks)
        if getattr(packed, "panels", False):
            ws.append(packed)
    return ws, [torch.randn(rows, w.data.shape[1]) for w in ws]


def moe_case(rows: int, int8: bool):
    """A call running every expert layer of the benchmark MoE's GGUF file on version ns."""
    from aiolm.checkpoint.source import resolve_model
    from aiolm.quant.base import ExpertsSpec
    from aiolm.quant.gguf_blocks import GGUFBlocksConfig

    if not MOE.exists():
        raise SystemExit(f"{MOE} is missing: python benchmarks/make_model.py --moe --formats q4_k_m")
    cfg = resolve_model(str(MOE)).config
    blocks = GGUFBlocksConfig(MOE, cfg, inner=None)  # type: ignore[arg-type]
    layers = [
        blocks.expert_blocks(ExpertsSpec(f"model.layers.{i}.mlp.experts", cfg.num_experts, 0), cfg.num_experts)
        for i in range(cfg.num_layers)
    ]
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, cfg.hidden_size, generator=g)
    weights, ids = torch.rand(rows, cfg.num_experts, generator=g).softmax(-1).topk(cfg.top_k, dim=-1)

    def call(ns: str):
        op = getattr(torch.ops, ns).gguf_moe
        return [op(x, e.tensors, list(e.types), weights, ids, e.intermediate, int8, -1) for e in layers if e]

    return call


def moe_bf16_case(rows: int):
    """A call running one layer of bfloat16 experts in the benchmark MoE's shapes on version ns."""
    from aiolm.kernels.cpu_moe import CpuExperts

    g = torch.Generator().manual_seed(0)
    e, h, i, k = 64, 1024, 384, 8
    experts = CpuExperts.from_dense(
        torch.randn(e, 2 * i, h, generator=g) / h**0.5, torch.randn(e, h, i, generator=g) / i**0.5, torch.bfloat16
    )
    x = torch.randn(rows, h, generator=g)
    weights, ids = torch.rand(rows, e, generator=g).softmax(-1).topk(k, dim=-1)

    def call(ns: str):
        return [getattr(torch.ops, ns).fused_moe(x, experts.w13, experts.w2, weights, ids, -1)]

    return call


def encoder_case(dtype: torch.dtype):
    """A call running an embedding step's 6 layers of encoder attention on version ns."""
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(10, 81, (169,), generator=g)
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    layers = [torch.randn(int(qsl[-1]), 3, 12, 32, generator=g).to(dtype) for _ in range(6)]

    def call(ns: str):
        op, outs = getattr(torch.ops, ns).encoder_attention, []
        for qkv in layers:
            out = torch.empty(qkv.shape[0], 12, 32, dtype=dtype)
            op(out, qkv[:, 0], qkv[:, 1], qkv[:, 2], qsl, 32**-0.5)
            outs.append(out.float())
        return outs

    return call


def attention_case(case: str, rows: int, kv_dtype: torch.dtype):
    """A call running one attention case on version ns (returns the outputs to compare)."""
    g = torch.Generator().manual_seed(0)
    H, KVH, D, bs = 9, 3, 64, 16
    if case == "decode-attn":
        B, ctx, L = rows, 256, 30
        nblocks = B * ctx // bs
        caches = [
            (torch.randn(nblocks, bs, KVH, D).to(kv_dtype), torch.randn(nblocks, bs, KVH, D).to(kv_dtype))
            for _ in range(L)
        ]
        table = torch.randperm(nblocks, generator=g).view(B, ctx // bs).contiguous()
        q, qsl, sl = torch.randn(B, H, D), torch.arange(B + 1), torch.full((B,), ctx)
    else:
        lens = [160] * 12 + [128]
        nblocks = sum(n // bs for n in lens)
        caches = [(torch.randn(nblocks, bs, KVH, D).half(), torch.randn(nblocks, bs, KVH, D).half())]
        rows, nxt = [], 0
        for n in lens:
            rows.append(list(range(nxt, nxt + n // bs)) + [0] * (10 - n // bs))
            nxt += n // bs
        table = torch.tensor(rows)
        q, qsl = torch.randn(sum(lens), H, D), torch.tensor([0, *np.cumsum(lens)])
        sl = torch.tensor(lens)

    def call(ns: str):
        op, outs = getattr(torch.ops, ns).paged_attention, []
        for kc, vc in caches:
            out = torch.empty_like(q)
            op(out, q, kc, vc, table, qsl, sl, 0.125)
            outs.append(out)
        return outs

    return call


if __name__ == "__main__":
    main()
