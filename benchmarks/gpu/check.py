"""The GPU checks that need a real CUDA device, one per subcommand (run by check.sh).

    python benchmarks/gpu/check.py parity       greedy tokens: aiolm on CUDA vs transformers on the same GPU
    python benchmarks/gpu/check.py graphs       greedy tokens: the engine with CUDA graphs vs --enforce-eager
    python benchmarks/gpu/check.py decode-speed decode step time, eager vs graphs, Triton attention
    python benchmarks/gpu/check.py engine       offline-64 and single stream through the engine, graphs and eager
    python benchmarks/gpu/check.py lora         LoRA adapters in one batch: tokens vs transformers + PEFT
    python benchmarks/gpu/check.py vision       LLaVA and Gemma 3 with images: tokens vs transformers

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

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea:",
    "List three prime numbers greater than ten, separated by commas:",
    "Explain in one sentence why the sky is blue:",
]
SKIP = 3


def _model(dtype: torch.dtype = torch.float32, attention: str = "auto"):
    """The embedded model on CUDA, its layers' ops the CUDA platform's (TritonOps), as the
    engine runs it."""
    from aiolm.checkpoint.source import resolve_model
    from aiolm.model.registry import build_model

    source = resolve_model(None)
    return source, build_model(source, dtype, torch.device("cuda"), attention=attention)


def _agreement(got: list[int], want: list[int]) -> int:
    """How many leading tokens are the same."""
    n = 0
    while n < min(len(got), len(want)) and got[n] == want[n]:
        n += 1
    return n


def _hf_greedy_on_cuda(dtype: torch.dtype, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """transformers' own model read from the same GGUF file, on the GPU in ``dtype``."""
    from transformers import AutoModelForCausalLM

    from aiolm.checkpoint.source import embedded_model_path
    from paged import hf_greedy

    path = embedded_model_path()
    kwargs = {}
    try:  # a plain dense model in ``dtype``, not GGUF blocks behind float32 matmul kernels
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older transformers dequantize anyway
        pass
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype, **kwargs)
    hf = hf.to("cuda").eval()
    try:
        return [hf_greedy(hf, p, max_new, device="cuda") for p in prompts]
    finally:
        del hf
        torch.cuda.empty_cache()


def parity(max_new: int, bf16_prefix: int) -> int:
    """float32: the same greedy tokens as transformers, every one (torch and Triton attention).
    bfloat16: two implementations round differently, so a near tie may go the other way
    some tokens in; the first ``bf16_prefix`` tokens of every prompt must agree and the
    France prompt must answer Paris; how far each prompt agrees is printed."""
    from paged import PagedHarness

    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        for attention in ("triton", "torch") if dtype == torch.float32 else ("triton",):
            source, model = _model(dtype, attention)
            tok = source.load_tokenizer()
            prompts = [tok.encode(p) for p in PROMPTS]
            if attention == "triton":
                want = _hf_greedy_on_cuda(dtype, prompts, max_new)
            got = PagedHarness(model, dtype=dtype, device="cuda").greedy(prompts, max_new, split=4)
            del model
            agree = [_agreement(g, w) for g, w in zip(got, want)]
            if dtype == torch.float32:
                good = got == want
            else:
                good = min(agree) >= bf16_prefix and "Paris" in tok.decode(got[0])
            ok &= good
            print(
                f"{name}, {attention} attention: {'ok' if good else 'FAILED'}: tokens agreeing with "
                f"transformers per prompt {agree} of {max_new}; "
                f"France -> {tok.decode(got[0])[:40]!r} (transformers {tok.decode(want[0])[:40]!r})"
            )
        torch.cuda.empty_cache()
    return 0 if ok else 1


def _triton_model():
    return _model(torch.bfloat16, attention="triton")[1]


def _decode_setup(model, batch: int, context: int, device: str = "cuda"):
    """One KV cache of random values and `batch` decode rows, each `context` tokens in."""
    from aiolm.attention.metadata import AttentionMetadata
    from aiolm.attention.torch_backend import kv_cache_shape

    cfg = model.config
    bs = 16
    pages = (context + 64) // bs + 1
    caches = [
        torch.randn(
            kv_cache_shape(batch * pages + 1, bs, cfg.num_kv_heads, cfg.head_dim), dtype=torch.bfloat16, device=device
        )
        for _ in range(cfg.num_layers)
    ]
    tables = [list(range(1 + i * pages, 1 + (i + 1) * pages)) for i in range(batch)]

    def step_inputs(pos: int):
        meta = AttentionMetadata.build([1] * batch, [pos + 1] * batch, tables, bs, device)
        ids = torch.randint(100, 1000, (batch,), device=device)
        return ids, torch.full((batch,), pos, device=device), meta

    return caches, step_inputs, pages * bs


def _engine_tokens(
    dtype: str, enforce_eager: bool, prompts: list[str], max_new: int, max_model_len: int
) -> list[list[int]]:
    """Greedy tokens of every prompt through the whole engine (worker process, Triton
    attention and ops); ``ignore_eos`` keeps the rows in step, so after the prefill step
    every step is a decode step of len(prompts) rows."""
    from aiolm import LLM, SamplingParams

    with LLM(
        device="cuda",
        dtype=dtype,
        enforce_eager=enforce_eager,
        max_num_seqs=8,
        max_model_len=max_model_len,
        max_num_batched_tokens=256,
        gpu_memory_utilization=0.3,
    ) as llm:
        outs = llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True), use_tqdm=False
        )
        return [o.outputs[0].token_ids for o in outs]


def graphs(max_new: int) -> int:
    """The engine's greedy tokens with CUDA graphs (the default) and with --enforce-eager
    must be identical, in two set-ups:

    - float32, 3 prompts, max_model_len 1024: decode steps of 3 rows replay the graph of 4
      (one padding row), and the graph, captured for max_model_len keys per row, splits
      the pages (split-KV) where eager steps over short contexts do not;
    - bfloat16, 4 prompts, max_model_len 112 (under 8 pages of 16, so neither path splits):
      no padding and the same kernels either way, so even bfloat16 rounding is the same.
    """
    ok = True
    for dtype, prompts, max_model_len in (("float32", PROMPTS[:3], 1024), ("bfloat16", PROMPTS, 112)):
        eager = _engine_tokens(dtype, True, prompts, max_new, max_model_len)
        graph = _engine_tokens(dtype, False, prompts, max_new, max_model_len)
        agree = [_agreement(g, e) for g, e in zip(graph, eager)]
        good = graph == eager and all(len(e) == max_new for e in eager)
        ok &= good
        print(
            f"{dtype}, {len(prompts)} prompts: graphs vs eager {'identical' if good else 'DIFFERENT'} "
            f"(tokens agreeing per prompt {agree} of {max_new})"
        )
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
        for name, fn in (
            ("eager", lambda: model(ids, p, caches, meta)),
            ("graph", lambda: runner.run(plan.size, ids, p, meta)),
        ):
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
    runs = {
        "offline-64, graphs": ["bench", "throughput", "--repeats", "2"],
        "offline-64, eager": ["bench", "throughput", "--repeats", "2", "--enforce-eager"],
        "single stream, graphs": [
            "bench",
            "latency",
            "--batch-size",
            "1",
            "--input-len",
            "128",
            "--output-len",
            "128",
            "--repeats",
            "3",
        ],
        "single stream, eager": [
            "bench",
            "latency",
            "--batch-size",
            "1",
            "--input-len",
            "128",
            "--output-len",
            "128",
            "--repeats",
            "3",
            "--enforce-eager",
        ],
    }
    for name, cmd in runs.items():
        out = subprocess.run(
            [sys.executable, "-m", "aiolm.cli", *cmd, *base], capture_output=True, text=True, timeout=120
        )
        if out.returncode != 0:
            print(f"{name}: FAILED\n{out.stderr[-3000:]}")
            return 1
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{name}: {r.get('output_tok_s', r.get('decode_tok_s')):.1f} tok/s (bfloat16, Triton attention)")
    return 0


def lora(max_new: int) -> int:
    """A tiny random Llama with three PEFT adapters (ranks 8, 16, 16 with rsLoRA) and the base
    model in one batch, through the engine on the GPU in float32, with CUDA graphs and with
    --enforce-eager: each request's greedy tokens must equal transformers + PEFT's (on the
    CPU) for its adapter."""
    import tempfile

    from aiolm import LLM, LoRARequest, SamplingParams
    from aiolm.checkpoint.source import resolve_model
    from lora_models import hf_lora_greedy, peft_adapter, tiny_base

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = tiny_base("llama", root / "base", resolve_model(None).path)
        kinds = [dict(rank=8), dict(rank=16, targets=("q_proj", "v_proj", "o_proj")), dict(rank=16, rslora=True)]
        adapters = [peft_adapter(base, root / f"a{i}", seed=i + 1, **kw) for i, kw in enumerate(kinds)]
        prompts = [[1, 400 + 37 * i, 500 + 11 * i, 9 + i] for i in range(4)]
        loras = [None] + [LoRARequest(f"a{i}", i + 1, str(a)) for i, a in enumerate(adapters)]
        want = {
            i: hf_lora_greedy(base, None if i == 0 else adapters[i - 1], prompts, max_new) for i in range(len(loras))
        }
        ok = True
        for eager in (False, True):
            with LLM(
                model=str(base),
                device="cuda",
                dtype="float32",
                enforce_eager=eager,
                enable_lora=True,
                max_loras=3,
                max_num_seqs=16,
                max_model_len=256,
                gpu_memory_utilization=0.3,
            ) as llm:
                batch = [(j, p) for j in range(len(loras)) for p in range(len(prompts))]
                outs = llm.generate(
                    [{"prompt_token_ids": prompts[p]} for _, p in batch],
                    SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True),
                    use_tqdm=False,
                    lora_request=[loras[j] for j, _ in batch],
                )
            got = [list(o.outputs[0].token_ids) for o in outs]
            agree = [_agreement(g, want[j][p]) for g, (j, p) in zip(got, batch)]
            good = all(a == max_new for a in agree)
            ok &= good
            print(
                f"{'eager' if eager else 'graphs'}: {len(batch)} requests over {len(adapters)} adapters and the "
                f"base {'match' if good else 'DIFFER FROM'} transformers + PEFT (leading tokens agreeing {agree})"
            )
        return 0 if ok else 1


def vision_cases(root: Path, max_new: int) -> Path:
    """Tiny random LLaVA and Gemma 3 folders (weights stored in bfloat16, to travel light; both
    sides read them as float32), chats with one and two images, each prompt's ids and
    ImageInputs as aiolm's processor makes them, and transformers' greedy tokens on the CPU
    in float32, pickled into ``root/cases.pkl``; returns that file. Runs anywhere."""
    import pickle

    from safetensors.torch import load_file, save_file

    from aiolm.checkpoint.source import resolve_model
    from aiolm.multimodal.processor import ImagePrompts
    from vlm_models import hf_vlm_greedy, png_image, tiny_gemma3_vision, tiny_llava

    tok = resolve_model(None).path
    pngs = [png_image(seed) for seed in (1, 2, 3)]
    chats = [
        ([{"type": "image"}, {"type": "text", "text": "What is this?"}], pngs[:1]),
        (
            [
                {"type": "text", "text": "Compare"},
                {"type": "image"},
                {"type": "text", "text": "and"},
                {"type": "image"},
            ],
            pngs[1:],
        ),
    ]
    cases = []
    for name, build in (("llava", tiny_llava), ("gemma3", tiny_gemma3_vision)):
        folder = build(root / name, tok)
        weights = folder / "model.safetensors"
        save_file({k: v.to(torch.bfloat16) for k, v in load_file(weights).items()}, weights)
        cfg = resolve_model(str(folder)).config
        images = ImagePrompts(folder, cfg.image_token_id, cfg.image_tokens, 4)  # type: ignore[attr-defined]
        for content, shots in chats:
            from io import BytesIO

            from PIL import Image

            messages = [{"role": "user", "content": content}]
            text = images.processor().tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            pil = [Image.open(BytesIO(p)).convert("RGB") for p in shots]
            ids, inputs = images._encode(text, pil, special=False)
            want_ids, want = hf_vlm_greedy(folder, messages, shots, max_new)
            assert ids == want_ids, f"{name}: aiolm's prompt ids differ from transformers'"
            cases.append({"model": name, "ids": ids, "images": inputs, "want": want})
    out = root / "cases.pkl"
    out.write_bytes(pickle.dumps(cases))
    return out


def vision(max_new: int, cases_file: str | None) -> int:
    """LLaVA (CLIP tower) and Gemma 3 (SigLIP tower; image tokens attend both ways) with one
    and two images through the engine on the GPU in float32, with CUDA graphs and with
    --enforce-eager: each prompt's greedy tokens must equal transformers' (``cases_file``:
    prepared elsewhere by ``vision_cases``; else prepared here)."""
    import pickle
    import tempfile

    from aiolm import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(cases_file) if cases_file else vision_cases(Path(tmp), max_new)
        cases = pickle.loads(path.read_bytes())
        ok = True
        for name in ("llava", "gemma3"):
            mine = [c for c in cases if c["model"] == name]
            for eager in (False, True):
                with LLM(
                    model=str(path.parent / name),
                    device="cuda",
                    dtype="float32",
                    enforce_eager=eager,
                    max_model_len=256,
                    gpu_memory_utilization=0.3,
                ) as llm:
                    outs = llm.generate(
                        [{"prompt_token_ids": c["ids"], "mm_inputs": c["images"]} for c in mine],
                        SamplingParams(temperature=0.0, max_tokens=len(mine[0]["want"]), ignore_eos=True),
                        use_tqdm=False,
                    )
                agree = [_agreement(list(o.outputs[0].token_ids), c["want"]) for o, c in zip(outs, mine)]
                good = all(a == len(c["want"]) for a, c in zip(agree, mine))
                ok &= good
                print(
                    f"{name}, {'eager' if eager else 'graphs'}: one and two images "
                    f"{'match' if good else 'DIFFER FROM'} transformers (leading tokens agreeing {agree})"
                )
        return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=["parity", "graphs", "decode-speed", "engine", "lora", "vision", "vision-cases"])
    p.add_argument("--cases", help="vision: a cases.pkl prepared by the vision-cases part (its folder beside it)")
    p.add_argument("--out", help="vision-cases: the folder to write the models and cases.pkl into")
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument(
        "--bf16-prefix",
        type=int,
        default=3,
        help="parity: leading bfloat16 tokens every prompt must share with transformers",
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--steps", type=int, default=50)
    a = p.parse_args()
    if a.part == "vision-cases":  # no GPU needed: prepared on one machine, run on another
        print(vision_cases(Path(a.out), min(a.max_new, 12)))
        return 0
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
        return parity(a.max_new, a.bf16_prefix)
    if a.part == "graphs":
        return graphs(a.max_new)
    if a.part == "lora":
        return lora(min(a.max_new, 12))
    if a.part == "vision":
        return vision(min(a.max_new, 12), a.cases)
    return decode_speed(a.max_num_seqs, a.steps)


if __name__ == "__main__":
    sys.exit(main())
