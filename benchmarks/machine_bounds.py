"""The two bounds a CPU inference engine runs into, measured on this machine, and what they
allow a model: how fast memory is read, and how fast float32 matrices are multiplied.

    python benchmarks/machine_bounds.py [--model FOLDER]

Single-stream decode reads every weight once per token, so tokens/s cannot pass read
bandwidth ÷ the bytes of weights; a large batch is arithmetic, 2 FLOPs per weight per token
processed (prompt and output alike), so it cannot pass the SGEMM rate ÷ 2 × the matmul
weights. Both are measured with torch on every core, as the engines run: read bandwidth as
a sum over a buffer far larger than the caches, the SGEMM rate as a large square product.
benchmarks/compare.py prints each result as a fraction of its bound.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

READ_BUFFER_BYTES = 1 << 30  # far beyond any L3 here
SGEMM_SIZE = 2048


@dataclass(frozen=True)
class Bounds:
    read_gb_s: float  # memory read bandwidth, GB/s (1e9 bytes)
    sgemm_gflop_s: float  # float32 large-matmul rate, GFLOP/s
    threads: int
    bf16_gflop_s: float = 0.0  # bfloat16 large-matmul rate (torch), GFLOP/s


def _median_time(fn, repeats: int) -> float:
    fn()  # warm: page faults, thread pool start
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _read_seconds(repeats: int) -> float:
    import torch

    buf = torch.ones(READ_BUFFER_BYTES // 4, dtype=torch.float32)
    return _median_time(lambda: buf.sum(), repeats)


def measure(repeats: int = 7) -> Bounds:
    import torch

    read_s = _read_seconds(repeats)
    a = torch.randn(SGEMM_SIZE, SGEMM_SIZE)
    b = torch.randn(SGEMM_SIZE, SGEMM_SIZE)
    mm_s = _median_time(lambda: torch.mm(a, b), repeats)
    a16, b16 = a.bfloat16(), b.bfloat16()
    mm16_s = _median_time(lambda: torch.mm(a16, b16), repeats)
    flops = 2 * SGEMM_SIZE**3
    return Bounds(
        read_gb_s=READ_BUFFER_BYTES / read_s / 1e9,
        sgemm_gflop_s=flops / mm_s / 1e9,
        threads=torch.get_num_threads(),
        bf16_gflop_s=flops / mm16_s / 1e9,
    )


@dataclass(frozen=True)
class ModelCost:
    """A model's matmul weights: what a token costs in FLOPs and, per dtype, in bytes read."""

    matmul_params: int

    def decode_bound(self, bounds: Bounds, weight_bytes: float) -> float:
        """Single-stream tokens/s if reading the weights were all a step did."""
        return bounds.read_gb_s * 1e9 / weight_bytes

    def batch_bound(self, bounds: Bounds, bf16: bool = False) -> float:
        """Tokens processed per second (prompt and output) if every FLOP ran at the matmul rate
        (``bf16``: the bfloat16 one, where a row multiplies in bfloat16)."""
        rate = bounds.bf16_gflop_s if bf16 and bounds.bf16_gflop_s else bounds.sgemm_gflop_s
        return rate * 1e9 / (2 * self.matmul_params)

    def bytes_for(self, dtype: str, files: dict[str, str]) -> float:
        """Bytes of weights a decode step reads in a row's dtype: a GGUF row's file, a quantized
        folder's (gptq) tensors but its input embedding, else the matmul weights in the dtype."""
        key = dtype.removesuffix("+int8").split(":")[0]
        if key in files and Path(files[key]).is_dir():
            return float(_folder_bytes(Path(files[key])))
        if key in files:
            return float(Path(files[key]).stat().st_size)
        return self.matmul_params * (2 if "16" in key else 4)


def _folder_bytes(folder: Path) -> int:
    """The bytes of a folder's tensors a decode step reads: all but an untied input embedding."""
    from safetensors import safe_open

    sizes: dict[str, int] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                t = st.get_slice(name)
                n = 1
                for d in t.get_shape():
                    n *= d
                sizes[name] = n * {"F32": 4, "I32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "U8": 1, "I8": 1}.get(
                    t.get_dtype(), 4
                )
    tied = not any(n.endswith("lm_head.weight") for n in sizes)
    return sum(v for n, v in sizes.items() if tied or not n.endswith("embed_tokens.weight"))


def model_cost(hf_dir: str) -> ModelCost:
    """The matmul weights of a Hugging Face folder: every 2-D weight, the input embedding
    counted only when the LM head is tied to it (then it is the LM head's matrix)."""
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shapes[name] = list(st.get_slice(name).get_shape())
    tied = not any(n.endswith("lm_head.weight") for n in shapes)
    total = 0
    for name, shape in shapes.items():
        if len(shape) != 2:
            continue
        if name.endswith("embed_tokens.weight") and not tied:
            continue  # a lookup, not a matmul
        total += shape[0] * shape[1]
    return ModelCost(total)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a Hugging Face folder (default: the embedded model's float32 folder)")
    a = ap.parse_args()
    b = measure()
    from aiolm.checkpoint.source import resolve_model

    cost = model_cost(a.model or str(resolve_model(None).path))
    out = {
        **asdict(b),
        "matmul_params": cost.matmul_params,
        "decode_bound_float32_tok_s": cost.decode_bound(b, cost.bytes_for("float32", {})),
        "batch_bound_tok_s": cost.batch_bound(b),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
