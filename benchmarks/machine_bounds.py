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
import math
import re
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
    bf16_gflop_s: float = 0.0  # bfloat16 large-matmul rate (torch), GFLOP/s; 0 without bfloat16 units


def has_cpu_flag(flag: str) -> bool:
    try:
        return any(
            line.startswith("flags") and flag in line.split() for line in Path("/proc/cpuinfo").read_text().splitlines()
        )
    except OSError:
        return False


def has_bf16_units() -> bool:
    """bfloat16 matmuls run faster than float32 ones only on AMX or AVX512-BF16."""
    return has_cpu_flag("amx_bf16") or has_cpu_flag("avx512_bf16")


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
    flops = 2 * SGEMM_SIZE**3
    bf16_gflop_s = 0.0
    if has_bf16_units():  # elsewhere torch's bfloat16 product is a scalar loop: minutes, and no row uses it
        a16, b16 = a.bfloat16(), b.bfloat16()
        bf16_gflop_s = flops / _median_time(lambda: torch.mm(a16, b16), repeats) / 1e9
    return Bounds(
        read_gb_s=READ_BUFFER_BYTES / read_s / 1e9,
        sgemm_gflop_s=flops / mm_s / 1e9,
        threads=torch.get_num_threads(),
        bf16_gflop_s=bf16_gflop_s,
    )


@dataclass(frozen=True)
class ModelCost:
    """A model's matmul weights: what a token costs in FLOPs and, per dtype, in bytes read.
    A mixture of experts' token uses ``routed`` of its experts' weights (top-k / experts), so
    its cost counts that share of them and all the rest."""

    matmul_params: int
    expert_params: int = 0  # of matmul_params, the experts' (none for a dense model)
    routed: float = 1.0  # the share of the experts a token runs

    @property
    def active_params(self) -> float:
        """The matmul weights one token multiplies."""
        return self.matmul_params - self.expert_params * (1.0 - self.routed)

    def decode_bound(self, bounds: Bounds, weight_bytes: float) -> float:
        """Single-stream tokens/s if reading the weights were all a step did."""
        return bounds.read_gb_s * 1e9 / weight_bytes

    def batch_bound(self, bounds: Bounds, bf16: bool = False) -> float:
        """Tokens processed per second (prompt and output) if every FLOP ran at the matmul rate
        (``bf16``: the bfloat16 one, where a row multiplies in bfloat16)."""
        rate = bounds.bf16_gflop_s if bf16 and bounds.bf16_gflop_s else bounds.sgemm_gflop_s
        return rate * 1e9 / (2 * self.active_params)

    def bytes_for(self, dtype: str, files: dict[str, str]) -> float:
        """Bytes of weights a decode step reads in a row's dtype: a GGUF row's file, a quantized
        folder's (gptq) tensors but its input embedding, else the matmul weights in the dtype."""
        key = dtype.removesuffix("+int8").split(":")[0]
        if key in files and Path(files[key]).is_dir():
            return _folder_bytes(Path(files[key]), self.routed)
        if key in files:
            return self.gguf_bytes(files[key])
        return self.active_params * (2 if "16" in key else 4)

    def gguf_bytes(self, path: str) -> float:
        """The bytes of a GGUF file a decode step reads: the whole file for a dense model, the
        routed share of its experts' tensors (``*_exps``) for a mixture of experts."""
        size = float(Path(path).stat().st_size)
        if self.routed == 1.0:
            return size
        from gguf import GGUFReader

        experts = sum(int(t.n_bytes) for t in GGUFReader(path).tensors if "_exps" in t.name)
        return size - experts * (1.0 - self.routed)


# An expert's tensor: per expert (Qwen-MoE's mlp.experts.3.gate_proj, Mixtral's
# block_sparse_moe.experts.3.w1) or all of a layer's stacked (mlp.experts.gate_up_proj).
_EXPERT = re.compile(r"\.experts\.")


def _folder_bytes(folder: Path, routed: float = 1.0) -> float:
    """The bytes of a folder's tensors a decode step reads: all but an untied input embedding,
    the experts' (a mixture of experts') counted at their ``routed`` share."""
    from safetensors import safe_open

    sizes: dict[str, int] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                t = st.get_slice(name)
                sizes[name] = math.prod(t.get_shape()) * {
                    "F32": 4,
                    "I32": 4,
                    "F16": 2,
                    "BF16": 2,
                    "F8_E4M3": 1,
                    "U8": 1,
                    "I8": 1,
                }.get(t.get_dtype(), 4)
    tied = not any(n.endswith("lm_head.weight") for n in sizes)
    return sum(
        v * (routed if _EXPERT.search(n) else 1.0)
        for n, v in sizes.items()
        if tied or not n.endswith("embed_tokens.weight")
    )


def model_cost(hf_dir: str) -> ModelCost:
    """The matmul weights of a Hugging Face folder: every 2-D weight (and an experts' stacked
    3-D one), the input embedding counted only when the LM head is tied to it (then it is
    the LM head's matrix); with config.json's top-k and expert count for a mixture of experts."""
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shapes[name] = list(st.get_slice(name).get_shape())
    tied = not any(n.endswith("lm_head.weight") for n in shapes)
    total = experts = 0
    for name, shape in shapes.items():
        expert = bool(_EXPERT.search(name))
        if len(shape) != 2 and not (expert and len(shape) == 3):
            continue
        if name.endswith("embed_tokens.weight") and not tied:
            continue  # a lookup, not a matmul
        n = math.prod(shape)
        total += n
        experts += n if expert else 0
    config = Path(hf_dir) / "config.json"
    cfg = json.loads(config.read_text()) if config.is_file() else {}
    num = cfg.get("num_experts") or cfg.get("num_local_experts")
    top_k = cfg.get("num_experts_per_tok")
    routed = top_k / num if experts and num and top_k else 1.0
    return ModelCost(total, experts, routed)


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
