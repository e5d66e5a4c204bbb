"""Keep a GGUF model's quantized blocks next to its float32 weights, for small batches.

A GGUF model is converted to float32 once (gguf_convert.py), and large batches run
on those float32 weights. Decoding a handful of sequences, though, is bound by
reading the weights, and the file's own Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q6_K blocks, kept as
3.2-7x fewer bytes, hold exactly the values the float32 copy was dequantized from
(the k-quants' 256-weight super-blocks are unpacked at load time: Q4_K into Q4_1
blocks of 32 whose scales and mins keep the file's codes, 4.75 bits a weight against the
file's 4.5, Q6_K into Q8_0 codes with a float32 scale per 16 weights, 10 bits against
6.6, so that the kernels keep to few block layouts and the values stay exact; Q5_0 keeps
its 5.5 bits, its fifth bits regrouped beside its nibbles). So the
linear layers also keep their blocks and ``aiolm::gguf_linear`` computes from them
when a step has at most ``MAX_ROWS`` rows; the answers are those of the float32
path up to the order of the sums. With ``AIOLM_GGUF_INT8=1`` the blocks go further, as
llama.cpp does: x is rounded to int8 per block of 32 and the blocks are multiplied
with integer dot products (``aiolm::gguf_int8_linear``), faster but no longer the
float32 path's arithmetic.

The CPU platform chooses this method for a GGUF checkpoint when the C++ kernels load
and there is one tensor-parallel rank (platforms/cpu.py); each layer's blocks come from
the file when its weights are processed after loading, beside the method it would have
had otherwise (``inner``: packed panels), which takes the larger steps. A layer whose
fused tensors differ in block type (a Q4_K_M file's Q4_K q and k beside a Q6_K v) runs
one block matmul per run of a type (``GGUFParts``); the fused decode step takes a QKV's
parts, other fused tensors only of one type.

A layer of experts keeps its blocks the same way (``GGUFBlocksExpertsMethod``): the file's
stacked ``ffn_{gate,up,down}_exps`` (or a Mixtral file's one tensor per expert) beside the
inner method's packed experts, run by ``aiolm::gguf_moe`` (``GGUFExperts``) for the steps
that route few rows to an expert, float or int8, each projection in its own type; the fused
decode step runs them with the layer's router.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from aiolm.attention.cpu_backend import CpuPagedAttention
from aiolm.checkpoint.gguf_convert import (
    gguf_architecture,
    hf_expert_names,
    hf_name,
    permuted_qk,
    unpermute_rope_rows,
)
from aiolm.kernels import cpu as cpu_kernels
from aiolm.model.gguf_index import read_tensors
from aiolm.model.layers.fused_moe import EXPERT_PARTS, FusedMoE, Router
from aiolm.quant.base import ExpertsMethod, ExpertsSpec, LinearMethod, LinearSpec, QuantConfig

log = logging.getLogger(__name__)

# ggml's ids, as aiolm::gguf_linear takes them: what a layer may keep blocks of
TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}
# Not a ggml type: Q4_1 blocks with float32 scales and mins (from_codes; ext/cpu/gguf_blocks.h)
Q4_1F = 112
BLOCK_TYPES = tuple(TYPE_IDS)
# Above this many rows the float32 panel GEMM beats the blocks in float arithmetic
# (benchmarks/bench_linear.py): 16 on an AVX2 CPU, 6 where the panels run on AVX-512. On
# Intel's AVX-512 cores the blocks convert once for all the rows of a step (gguf_linear.h,
# wide_group), which keeps them ahead of the panels until past 24 rows (docs/benchmarks.md,
# issue 43, "float32 steps of 4-24 rows").
MAX_ROWS = (6 if cpu_kernels.is_amd() else 24) if cpu_kernels.has_avx512() else 16
# With AIOLM_GGUF_INT8=1 (INT8), steps of up to GGUFWeight.int8_rows rows quantize x to int8
# per block of 32 and use integer dot products (GGUFWeight.linear_int8): one instruction
# multiplies 64 weights where the float path converts each. Opt-in because greedy answers
# part from the float32 path's after some tokens (tests/kernels/test_gguf_int8.py prints
# where), and the float path matches transformers token for token.
INT8 = os.environ.get("AIOLM_GGUF_INT8") == "1"
# How far int8 goes (bench_linear.py, section 1d; docs/benchmarks/log.md): with VNNI the kernel
# (16 output rows a block, one per int32 lane, for steps of 3 rows on) beats the float32
# matmuls, and bfloat16 oneDNN without AMX, at every step size measured, 1 to 1024 rows, so it
# takes prompts too; without VNNI int8 stays with small steps; beside bfloat16 matmuls on AMX
# tiles, which overtake int8 beyond a few dozen rows, it stops at 32.
INT8_LIMIT = sys.maxsize if cpu_kernels.has_avx512_vnni() else 16 if cpu_kernels.has_avx512() else MAX_ROWS
INT8_LIMIT_AMX_BF16 = 32
# Q5_0 blocks (a Q4_K_M file's tensors whose rows are not whole 256-weight super-blocks) keep
# the file's 5.5 bits where int8 activations meet them on VNNI, whose kernels read them near
# the read bound, so fewer bytes are less time; elsewhere they are widened at load to 8.5-bit
# Q8_0 codes of the same values, since the float kernels, bound by converting each weight, and
# AVX2's int8 kernel pay more for the fifth bits than the bytes save (the A/B:
# docs/benchmarks.md, issue 35). Every kernel takes both.
KEEP_Q5_0 = INT8 and cpu_kernels.has_avx512_vnni()


# An expert's projection as hf_name / hf_expert_names name it (Qwen's or Mixtral's names)
_EXPERT_NAME = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")

_LAYOUT = {  # type -> (bytes per block, offset of the quants, has a min)
    "Q4_0": (18, 2, False),
    "Q4_1": (20, 4, True),
    "Q8_0": (34, 2, False),
}


_Q4K_BYTES = 144  # f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles


def _q4k_as_q4_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks [N, S, 144] as Q4_1 blocks of 32, regrouped (``grouped``): nibbles
    (weight j low, j + 16 high), and the scales and mins as the file codes them (``coded``). A
    sub-block j's weights are d * sc_j * q - dmin * m_j; d * sc_j and dmin * m_j (an f16
    times a 6-bit integer) are exact in float32, so the kernels' scale * q + min is the value
    gguf dequantizes to, bit for bit."""
    n, s = b.shape[:2]
    d = b[:, :, 0:2].copy().view(np.float16).astype(np.float32)  # [N, S, 1]
    dmin = b[:, :, 2:4].copy().view(np.float16).astype(np.float32)
    k = b[:, :, 4:16]
    # Sub-blocks 0-3 keep 6 bits in bytes 0-3 (scales) and 4-7 (mins); 4-7 take their low
    # 4 bits from bytes 8-11 (scale low nibble, min high nibble) and their top 2 bits from
    # the top bits of bytes 0-3 (scales) and 4-7 (mins).
    sc = np.concatenate([k[..., 0:4] & 63, (k[..., 8:12] & 15) | (k[..., 0:4] >> 6 << 4)], -1)
    mn = np.concatenate([k[..., 4:8] & 63, (k[..., 8:12] >> 4) | (k[..., 4:8] >> 6 << 4)], -1)
    # Each 64 weights are 32 bytes: sub-block 2i in their low nibbles, 2i + 1 in their high ones.
    chunks = b[:, :, 16:].reshape(n, s, 4, 1, 32)
    q = (chunks >> np.array([0, 4], np.uint8).reshape(2, 1) & 15).reshape(n, 8 * s, 32)
    qs = q[..., :16] | (q[..., 16:] << 4)
    return grouped(qs), coded(sc.reshape(n, 8 * s, 1), d), coded(mn.reshape(n, 8 * s, 1), -dmin)


def coded(codes: np.ndarray, factors: np.ndarray) -> np.ndarray:
    """Q4_K's per-block scale (or min) codes [N, nblocks, 1] and per-super-block factors
    [N, nblocks / 8, 1] (float32: d, or -dmin) as the kernels read them (ext/cpu/gguf_blocks.h):
    uint8 [N/8, nblocks * 12], a group's codes then its factors' bytes; a value is factor * code."""
    return np.concatenate([grouped(codes), grouped(factors.astype(np.float32)).view(np.uint8)], 1)


def uncoded(arr: torch.Tensor, nblocks: int) -> torch.Tensor:
    """A coded array's values, float32 [N/8, nblocks * 8], as the kernels make them."""
    groups, n = arr.shape[0], nblocks * 8
    codes = arr[:, :n].float().view(groups, nblocks // 8, 8, 8)
    factors = arr[:, n:].contiguous().view(torch.float32).view(groups, nblocks // 8, 1, 8)
    return (codes * factors).reshape(groups, n)


_Q5_0_BYTES = 22  # f16 d, 4 bytes of high bits, 16 bytes of low nibbles


def _q5_0_as_q8_0(b: np.ndarray) -> np.ndarray:
    """Q5_0 blocks [N, nb * 22] as Q8_0 blocks [N, nb * 34]: the same f16 d, and each 5-bit
    code q (low nibble, plus bit j of qh for weight j, bit j + 16 for weight j + 16) as the
    int8 q - 16, so d * code is the value gguf dequantizes to."""
    n = b.shape[0]
    blocks = np.ascontiguousarray(b).reshape(n, -1, _Q5_0_BYTES)
    qh = blocks[:, :, 2:6].copy().view("<u4")  # [N, nb, 1]
    qs = blocks[:, :, 6:22]
    j = np.arange(16, dtype=np.uint32)
    low = (qs & 15) | (((qh >> j) & 1) << 4).astype(np.uint8)
    high = (qs >> 4) | (((qh >> (j + 16)) & 1) << 4).astype(np.uint8)
    codes = (np.concatenate([low, high], -1).astype(np.int16) - 16).astype(np.int8)
    return np.concatenate([blocks[:, :, 0:2], codes.view(np.uint8)], -1).reshape(n, -1)


def kept(blocks: np.ndarray, ttype: str) -> tuple[np.ndarray, str]:
    """A tensor's raw rows as the kernels keep them: Q5_0 widened to Q8_0 unless KEEP_Q5_0."""
    if ttype == "Q5_0" and not KEEP_Q5_0:
        return _q5_0_as_q8_0(blocks), "Q8_0"
    return blocks, ttype


def _q5_0_regrouped(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q5_0 blocks [N, nb, 22] (f16 d, 4 bytes of fifth bits: bit j for weight j, 16 bytes of
    nibbles: weight j low, j + 16 high) as the kernels read them (ext/cpu/gguf_blocks.h): per
    group of 8 rows and block, the 8 rows' nibbles, then 16 words of fifth bits, the rows' bits
    of weights 0-15, then of 16-31; and the f16 scales, grouped. w = d * (code - 16)."""
    n, nb = b.shape[:2]
    nibbles = grouped(b[:, :, 6:22]).reshape(-1, nb, 8 * 16)
    words = grouped(b[:, :, 2:6].copy().view("<u2")).reshape(-1, nb, 8, 2).transpose(0, 1, 3, 2)  # [G, nb, half, row]
    qs = np.concatenate([nibbles, np.ascontiguousarray(words).view(np.uint8).reshape(-1, nb, 32)], -1)
    return qs.reshape(qs.shape[0], -1), grouped(b[:, :, 0:2].copy().view(np.float16))


_Q6K_BYTES = 210  # 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, f16 d


def _q6k_as_q8(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K super-blocks [N, S, 210] as int8 codes q - 32 in blocks of 32 [N, 8S, 32] and
    float32 scales d * sc_k, two a block [N, 8S, 2] (weights 0-15, 16-31). d * sc_k (an f16
    times an 8-bit integer) and its product with a code of 6 bits fit float32's 24-bit
    mantissa, so scale * code is the value gguf dequantizes to, bit for bit."""
    n, s = b.shape[:2]
    # Each 128 weights take 64 bytes of ql and 32 of qh. Weight l of their quarter k (of 32)
    # is nibble k // 2 (low, high) of ql byte 32 * (k % 2) + l, below bits 2k, 2k + 1 of qh byte l.
    ql = b[:, :, 0:128].reshape(n, s, 2, 1, 2, 32) >> np.array([0, 4], np.uint8).reshape(2, 1, 1) & 15
    qh = b[:, :, 128:192].reshape(n, s, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1) & 3
    codes = (ql.reshape(n, s, 2, 4, 32) | qh << 4).reshape(n, 8 * s, 32).view(np.int8) - np.int8(32)
    d = b[:, :, 208:210].copy().view(np.float16).astype(np.float32)  # [N, S, 1]
    scale = d * b[:, :, 192:208].view(np.int8).astype(np.float32)  # [N, S, 16]
    return codes, scale.reshape(n, 8 * s, 2)


def grouped(a: np.ndarray) -> np.ndarray:
    """A weight's per-row blocks [N, nblocks, k] as kernel groups [N/8, nblocks * 8 * k]: rows in
    groups of 8 (the last padded with zeros), a group's block b of all 8 rows side by side."""
    pad = -a.shape[0] % 8
    if pad:
        a = np.concatenate([a, np.zeros((pad,) + a.shape[1:], a.dtype)])
    groups = a.shape[0] // 8
    a = a.reshape(groups, 8, a.shape[1], -1).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(a).reshape(groups, -1)


@dataclass(frozen=True)
class GGUFWeight:
    """A weight's blocks regrouped into the arrays aiolm::gguf_linear reads: output rows
    in groups of 8, a group's block b of all 8 rows side by side (one stream per tile)."""

    qs: torch.Tensor  # uint8/int8 [N/8, nblocks * 8 * quant bytes]
    # float16 [N/8, nblocks * 8], as the file stores it (fewer bytes to read); Q4_K: uint8
    # [N/8, nblocks * 12], the file's codes and factors (``coded``); Q4_1F: float32; Q6_K:
    # float32 [N/8, nblocks * 8 * 2], one scale per 16 weights
    scale: torch.Tensor
    mins: torch.Tensor  # Q4_1, Q4_K and Q4_1F: as scale; else empty
    qtype: int
    n: int  # output rows (the last group is padded with zero blocks)

    @classmethod
    def from_blocks(cls, blocks: np.ndarray, ttype: str) -> GGUFWeight:
        """Split raw GGUF rows (uint8 [N, nblocks * block bytes]) into quants, scales and mins
        (Q5_0: at its 5.5 bits; ``kept`` says where a model widens it first)."""
        n = blocks.shape[0]
        if ttype == "Q5_0":
            qs, scale = _q5_0_regrouped(np.ascontiguousarray(blocks).reshape(n, -1, _Q5_0_BYTES))
            empty = torch.zeros(0, dtype=torch.float16)
            return cls(torch.from_numpy(qs), torch.from_numpy(scale), empty, TYPE_IDS[ttype], n)
        if ttype == "Q4_K":
            qs, scale, mins = _q4k_as_q4_1(np.ascontiguousarray(blocks).reshape(n, -1, _Q4K_BYTES))
            return cls(*(torch.from_numpy(a) for a in (qs, scale, mins)), TYPE_IDS[ttype], n)
        if ttype == "Q6_K":
            codes, scale = _q6k_as_q8(np.ascontiguousarray(blocks).reshape(n, -1, _Q6K_BYTES))
            return cls(
                torch.from_numpy(grouped(codes)),
                torch.from_numpy(grouped(scale)),
                torch.zeros(0, dtype=torch.float32),
                TYPE_IDS[ttype],
                n,
            )
        size, off, has_min = _LAYOUT[ttype]
        b = np.ascontiguousarray(blocks).reshape(n, -1, size)
        qs = grouped(b[:, :, off:])
        if ttype == "Q8_0":
            qs = qs.view(np.int8)
        scale = grouped(b[:, :, 0:2].copy().view(np.float16))
        mins = grouped(b[:, :, 2:4].copy().view(np.float16)) if has_min else np.zeros((0,), np.float16)
        return cls(torch.from_numpy(qs), torch.from_numpy(scale), torch.from_numpy(mins), TYPE_IDS[ttype], n)

    @classmethod
    def from_codes(cls, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> GGUFWeight:
        """4-bit codes (uint8 [N, K], 0-15) with a float32 scale and min per block of 32
        ([N, K/32]): w = d * q + m, as Q4_1F (Q4_1 blocks with float32 scales and mins), which
        keeps a checkpoint's scales and zero points exact."""
        n, k = codes.shape
        c = codes.reshape(n, k // 32, 32).numpy()
        qs = (c[:, :, :16] | (c[:, :, 16:] << 4)).astype(np.uint8)  # weight j low, j + 16 high
        scales = (d.float().reshape(n, -1, 1).numpy(), m.float().reshape(n, -1, 1).numpy())
        return cls(torch.from_numpy(grouped(qs)), *(torch.from_numpy(grouped(a)) for a in scales), Q4_1F, n)

    @property
    def nblocks(self) -> int:
        """Blocks of 32 a row: K / 32."""
        int8 = self.qs.dtype == torch.int8  # Q8_0, Q6_K: 32 bytes a block; Q5_0 20; else 16 of nibbles
        return self.qs.shape[1] // (8 * (32 if int8 else 20 if self.qtype == TYPE_IDS["Q5_0"] else 16))

    def dequantize(self) -> torch.Tensor:
        """The float32 weights [N, K] these arrays hold, as the kernels read them (for tests)."""
        groups, nb = self.qs.shape[0], self.nblocks
        if self.qs.dtype == torch.int8:
            codes = self.qs.view(groups, nb, 8, -1).transpose(1, 2).float()  # [N/8, 8, nblocks, 32]
        elif self.qtype == TYPE_IDS["Q5_0"]:
            block = self.qs.view(groups, nb, 160)
            q = block[:, :, :128].reshape(groups, nb, 8, 16).transpose(1, 2)
            words = block[:, :, 128:].contiguous().view(torch.int16).int() & 0xFFFF  # [N/8, nblocks, 16]
            bits = words.view(groups, nb, 2, 8).permute(0, 3, 1, 2).unsqueeze(-1) >> torch.arange(16) & 1
            fifth = bits.reshape(groups, 8, nb, 32)  # [.., half, weight] -> weights 0-31
            codes = (torch.cat([q & 15, q >> 4], -1).int() | fifth << 4).float() - 16
        else:
            q = self.qs.view(groups, nb, 8, 16).transpose(1, 2)  # [N/8, 8, nblocks, 16 bytes of nibbles]
            codes = torch.cat([q & 15, q >> 4], -1).float() - (8 if self.qtype == TYPE_IDS["Q4_0"] else 0)
        scale, mins = self.scale, self.mins
        if scale.dtype == torch.uint8:  # Q4_K: the file's codes and factors
            scale, mins = uncoded(scale, nb), uncoded(mins, nb)
        d = scale.view(groups, nb, 8, -1).transpose(1, 2).float()  # [.., scales a block]
        w = d.repeat_interleave(32 // d.shape[-1], -1) * codes
        if mins.numel():
            w = w + mins.view(groups, nb, 8, 1).transpose(1, 2).float()
        return w.reshape(groups * 8, -1)[: self.n]

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.ops.aiolm.gguf_linear(x, self.qs, self.scale, self.mins, self.qtype, self.n)
        return y if bias is None else y + bias

    @property
    def int8_rows(self) -> int:
        """The most rows a step may have for linear_int8 to be the faster method (INT8)."""
        return INT8_LIMIT

    def linear_int8(self, x: torch.Tensor, bias: torch.Tensor | None = None, isa: int = -1) -> torch.Tensor:
        """x quantized per block of 32 to int8 and multiplied with integer dot products
        (ext/cpu/gguf_int8.cpp); ``isa`` picks a compiled path (-1: the best)."""
        y = torch.ops.aiolm.gguf_int8_linear(x, self.qs, self.scale, self.mins, self.qtype, self.n, isa)
        return y if bias is None else y + bias


@dataclass(frozen=True)
class GGUFParts:
    """A fused layer's weight whose tensors differ in block type: each run of one type is a
    GGUFWeight of its own, and their outputs are laid side by side (the layer's rows in order)."""

    parts: tuple[GGUFWeight, ...]

    @property
    def n(self) -> int:
        return sum(p.n for p in self.parts)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.cat([p.linear(x) for p in self.parts], -1)
        return y if bias is None else y + bias

    @property
    def int8_rows(self) -> int:
        return min(p.int8_rows for p in self.parts)

    def linear_int8(self, x: torch.Tensor, bias: torch.Tensor | None = None, isa: int = -1) -> torch.Tensor:
        y = torch.cat([p.linear_int8(x, isa=isa) for p in self.parts], -1)
        return y if bias is None else y + bias


# Expert rows regrouped at a time: bounds the unpacking's temporary arrays (a k-quant's codes
# unpack to several times the file's bytes) for a large model's thousands of expert rows.
_REGROUP_BYTES = 64 << 20


@dataclass(frozen=True)
class ExpertBlocks:
    """One projection of every expert in aiolm::gguf_linear's layout (``GGUFWeight``), stacked:
    expert e's groups of 8 output rows are qs[e], scale[e], mins[e]."""

    qs: torch.Tensor  # uint8 / int8 [E, G, bytes]
    scale: torch.Tensor  # [E, G, n]
    mins: torch.Tensor  # [E, G, n], or empty for the types without a min
    qtype: int
    rows: int  # output rows an expert

    @classmethod
    def from_rows(cls, rows: np.ndarray, ttype: str, num_experts: int) -> ExpertBlocks:
        """From a stacked GGUF tensor's raw rows, uint8 [E * rows, bytes per row] (expert e's are
        rows e * rows .. (e + 1) * rows - 1, as read_tensors gives ``ffn_*_exps``)."""
        if rows.ndim != 2 or rows.shape[0] % num_experts:
            raise ValueError(f"{ttype} expert rows {rows.shape} do not split into {num_experts} experts")
        n = rows.shape[0] // num_experts
        if n % 8:  # an expert's rows are the other projection's features, whole blocks of 32
            raise ValueError(f"{n} rows an expert do not make whole groups of 8")
        per = rows.reshape(num_experts, n, rows.shape[1])
        step = max(1, _REGROUP_BYTES // max(1, per[0].nbytes))
        parts = []
        for e0 in range(0, num_experts, step):
            chunk = np.asarray(per[e0 : e0 + step], dtype=np.uint8)
            parts.append(GGUFWeight.from_blocks(*kept(chunk.reshape(-1, chunk.shape[2]), ttype)))
        groups = n // 8  # whole groups, so that expert e's are groups e * G .. (e + 1) * G - 1

        def stack(ts: list[torch.Tensor]) -> torch.Tensor:
            if ts[0].numel() == 0:
                return ts[0]
            return torch.cat(ts).view(num_experts, groups, -1)

        return cls(
            stack([w.qs for w in parts]),
            stack([w.scale for w in parts]),
            stack([w.mins for w in parts]),
            parts[0].qtype,
            n,
        )

    def tensors(self) -> list[torch.Tensor]:
        return [self.qs, self.scale, self.mins]


class GGUFExperts:
    """One MoE layer's experts as a GGUF file's blocks, run by torch.ops.aiolm.gguf_moe: gate,
    up and down each in its own block type (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K or Q6_K)."""

    def __init__(self, gate: ExpertBlocks, up: ExpertBlocks, down: ExpertBlocks, num_experts: int) -> None:
        if gate.rows != up.rows:
            raise ValueError(f"gate has {gate.rows} rows an expert, up {up.rows}")
        self.gate, self.up, self.down = gate, up, down
        self.num_experts, self.intermediate, self.hidden = num_experts, gate.rows, down.rows
        self.tensors = gate.tensors() + up.tensors() + down.tensors()  # as aiolm::gguf_moe takes them
        self._qtypes = [gate.qtype, up.qtype, down.qtype]

    @classmethod
    def from_blocks(
        cls, gate: np.ndarray, up: np.ndarray, down: np.ndarray, types: tuple[str, str, str], num_experts: int
    ) -> GGUFExperts:
        """From the raw rows of a layer's stacked ``ffn_{gate,up,down}_exps`` tensors (uint8
        [E * I, bytes] for gate and up, [E * H, bytes] for down) and their GGUF type names."""
        return cls(*(ExpertBlocks.from_rows(r, t, num_experts) for r, t in zip((gate, up, down), types)), num_experts)

    @property
    def types(self) -> tuple[int, int, int]:
        return self.gate.qtype, self.up.qtype, self.down.qtype

    def __call__(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, int8: bool = False, isa: int = -1
    ) -> torch.Tensor:
        """float32 [T, H], as CpuExperts gives it: x times the blocks' values in float32 or, with
        ``int8``, x rounded to int8 per block of 32 and integer dot products (gguf_int8.cpp's
        arithmetic; ``isa`` picks its compiled path, -1 the best)."""
        return torch.ops.aiolm.gguf_moe(
            x.float(), self.tensors, self._qtypes, topk_weights.float(), topk_ids, self.intermediate, int8, isa
        )


def int8_rows(blocks: GGUFWeight | GGUFParts | GGUFExperts, matmul_dtype: torch.dtype) -> int:
    """The most rows a step may have for int8 activations to beat ``blocks``' alternative,
    the layer's matmuls in ``matmul_dtype``: bfloat16 ones on AMX tiles take all but small
    steps."""
    rows = INT8_LIMIT if isinstance(blocks, GGUFExperts) else blocks.int8_rows
    if matmul_dtype == torch.bfloat16 and cpu_kernels.has_amx():
        return min(rows, INT8_LIMIT_AMX_BF16)
    return rows


@dataclass(frozen=True)
class GGUFLinear:
    """A layer's blocks, for steps of up to ``MAX_ROWS`` rows (with INT8, up to ``int8_rows``)."""

    blocks: GGUFWeight | GGUFParts
    int8_rows: int  # int8_rows(blocks, the layer's other matmul dtype)


def _step_tables(meta: Any) -> tuple[torch.Tensor, ...]:
    """The step's attention tables, in the order the C++ decode calls take them."""
    return meta.block_table, meta.query_start_loc, meta.seq_lens, meta.slot_mapping


QKV_PARTS = 3  # the most block types a fused layer's QKV may mix (ext/cpu/decode_layer.cpp)


def _parts(blocks: GGUFWeight | GGUFParts) -> tuple[GGUFWeight, ...]:
    return blocks.parts if isinstance(blocks, GGUFParts) else (blocks,)


def _routed_experts(mlp: Any) -> tuple[Router, FusedMoE] | None:
    """``mlp``'s router and experts where the fused step can run them, else None: a router and
    a layer of experts and nothing else (aiolm/model/moe.py's SparseMoeBlock without a shared
    expert), the experts all on this rank with their blocks, the router in float32."""
    moe, router = getattr(mlp, "experts", None), getattr(mlp, "gate", None)
    if not isinstance(moe, FusedMoE) or not isinstance(router, Router) or getattr(mlp, "shared_expert", 1) is not None:
        return None
    ok = isinstance(moe.gguf_experts, GGUFExperts) and not moe.expert_parallel and moe.tp.world_size == 1
    return (router, moe) if ok and router.weight.dtype == torch.float32 else None


@dataclass(frozen=True)
class FusedDecodeLayer:
    """A Llama-family layer whose linears all have blocks (a QKV's maybe in parts of different
    types), as one C++ call (ext/cpu/decode_layer.cpp) for the steps the blocks take: the same
    kernels in the same order as the modules, without the interpreter between them. A layer
    of experts runs its router and experts' blocks in the call too; one with more than those
    (a shared expert) gets its attention half as the call and runs its ``mlp`` after it."""

    attn: Any  # the layer's CpuPagedAttention: its cache views
    cos: torch.Tensor
    sin: torch.Tensor
    weights: list[torch.Tensor]
    ints: dict[bool, list[int]]  # by "int8 activations"
    int8_rows: int  # the linears' least
    floats: list[float]
    mlp: Any = None  # the feed-forward block run after the call (a layer of experts), or None

    @classmethod
    def of(cls, layer: Any) -> FusedDecodeLayer | None:
        """The fused step for ``layer``, a Llama-shaped decoder layer (input norm, attention
        with qkv/o projections and maybe QK-norm, post-attention norm, then a SiLU MLP with
        gate_up/down or a layer of experts), or None where its parts are not all what the C++
        step computes."""
        a, mlp = layer.self_attn, layer.mlp
        dense = hasattr(mlp, "gate_up_proj")
        linears = [a.qkv_proj, a.o_proj] + ([mlp.gate_up_proj, mlp.down_proj] if dense else [])
        gguf = [getattr(m, "gguf", None) for m in linears]
        norms = [n for n in (a.q_norm, a.k_norm) if n is not None]
        if (
            type(a.attn) is not CpuPagedAttention
            or not all(isinstance(g, GGUFLinear) for g in gguf)
            or not all(isinstance(g.blocks, GGUFWeight) for g in gguf[1:])
            or len(_parts(gguf[0].blocks)) > QKV_PARTS
            or any(m.bias is not None for m in linears[1:])
            or a.rotary.cos.dtype != torch.float32
            or any(n.weight.dtype != torch.float32 for n in [layer.input_layernorm, *norms])
            or (norms and norms[0].eps != layer.input_layernorm.eps)
        ):
            return None
        experts = None if dense else _routed_experts(mlp)
        none = torch.empty(0)
        qkv = _parts(gguf[0].blocks)  # a Q4_K_M file's q and k in one block type, v in another
        slots: list[GGUFWeight | None] = [*qkv, *[None] * (QKV_PARTS - len(qkv))]
        slots += [g.blocks for g in gguf[1:]] + ([] if dense else [None, None])
        weights = [layer.input_layernorm.weight.data, layer.post_attention_layernorm.weight.data]
        ints = []
        for b in slots:
            weights += [none] * 3 if b is None else [b.qs, b.scale, b.mins]
            ints += [0, 0] if b is None else [b.qtype, b.n]
        bias = a.qkv_proj.bias
        weights.append(bias.data if bias is not None else none)
        weights += [n.weight.data for n in norms] if norms else [none, none]
        ints += [a.num_heads, a.num_kv_heads, a.head_dim, a.attn.sliding_window or 0]
        tail = [0] * 6  # the experts' types, width, top-k (0: none in the call), renormalise
        int8_rows = min(g.int8_rows for g in gguf)
        if experts is not None:
            router, moe = experts
            g = moe.gguf_experts
            weights += [router.weight.data, moe.expert_counts, *g.tensors]
            tail = [*g.types, g.intermediate, router.top_k, int(router.renormalize)]
            int8_rows = min(int8_rows, moe.gguf_experts_int8_rows)
        return cls(
            a.attn,
            a.rotary.cos,
            a.rotary.sin,
            weights,
            {False: ints + [0] + tail, True: ints + [1] + tail},
            int8_rows,
            [layer.input_layernorm.eps, a.attn.scale, a.attn.soft_cap or 0.0],
            None if dense or experts is not None else mlp,
        )

    def __call__(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, kv_cache: torch.Tensor, meta: Any
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        rows = x.shape[0]
        int8 = INT8 and rows <= self.int8_rows
        if (
            not (int8 or rows <= MAX_ROWS)
            or x.dtype != torch.float32
            or kv_cache.dtype not in (torch.float32, torch.float16)
        ):
            return None
        h, residual = torch.ops.aiolm.decode_layer(
            x,
            residual,
            positions,
            kv_cache,
            *self.attn.pages(kv_cache),
            *_step_tables(meta),
            self.cos,
            self.sin,
            self.weights,
            self.ints[int8],
            self.floats,
        )
        return (h, residual) if self.mlp is None else (self.mlp(h), residual)


class FusedDecodeStack:
    """A stage's fused layers as one C++ call per step (``decode_layers``): each layer
    exactly as its FusedDecodeLayer computes it, without a Python round per layer. Taken
    where every layer of the stage has a fused step that runs it whole (no ``mlp`` after the
    call) and they share one rotary table; a step a layer's blocks would not take goes the
    per-layer way."""

    def __init__(self, layers: list[FusedDecodeLayer]) -> None:
        self.layers = layers
        self.weights = [w for f in layers for w in f.weights]
        self.floats = [v for f in layers for v in f.floats]
        self.cos, self.sin = layers[0].cos, layers[0].sin
        self._ints: dict[tuple[bool, ...], list[int]] = {}
        self._pages_of: list[torch.Tensor] | None = None
        self._pages: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])

    @classmethod
    def of(cls, steps: list[Any]) -> FusedDecodeStack | None:
        if not steps or not all(isinstance(f, FusedDecodeLayer) and f.mlp is None for f in steps):
            return None
        if any(f.cos is not steps[0].cos or f.sin is not steps[0].sin for f in steps):
            return None
        return cls(steps)

    def _int_args(self, int8: tuple[bool, ...]) -> list[int]:
        ints = self._ints.get(int8)
        if ints is None:
            ints = self._ints[int8] = [v for f, i in zip(self.layers, int8) for v in f.ints[i]]
        return ints

    def _page_args(self, kv_caches: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each layer's K and V pages, taken again only when the runner's caches change."""
        seen = self._pages_of
        if seen is None or len(seen) != len(kv_caches) or any(a is not b for a, b in zip(seen, kv_caches)):
            pages = [f.attn.pages(c) for f, c in zip(self.layers, kv_caches)]
            self._pages_of, self._pages = list(kv_caches), ([k for k, _ in pages], [v for _, v in pages])
        return self._pages

    def takes(self, rows: int, dtype: torch.dtype, kv_caches: list[torch.Tensor]) -> bool:
        """Whether a step of ``rows`` rows in ``dtype`` goes through the one call."""
        int8 = all(INT8 and rows <= f.int8_rows for f in self.layers)
        return (
            (int8 or rows <= MAX_ROWS)
            and dtype == torch.float32
            and kv_caches[0].dtype in (torch.float32, torch.float16)
        )

    def args(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_caches: list[torch.Tensor],
        meta: Any,
    ) -> list[Any]:
        """decode_layers' arguments for a step the call takes."""
        rows = x.shape[0]
        int8 = tuple(INT8 and rows <= f.int8_rows for f in self.layers)
        k_pages, v_pages = self._page_args(kv_caches)
        return [
            x,
            residual,
            positions,
            kv_caches,
            k_pages,
            v_pages,
            *_step_tables(meta),
            self.cos,
            self.sin,
            self.weights,
            self._int_args(int8),
            self.floats,
        ]

    def __call__(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_caches: list[torch.Tensor],
        meta: Any,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.takes(x.shape[0], x.dtype, kv_caches):
            return None
        h, residual = torch.ops.aiolm.decode_layers(*self.args(positions, x, residual, kv_caches, meta))
        return h, residual


class FusedSampleStep:
    """The stage's fused layers with the model's end in the same call (``decode_sample``):
    the final norm, the LM head's blocks and each row's token, so a decode step comes back
    from C++ as its tokens. The ops are the ones the model's forward and its compute_logits
    run, and the draw is the sampler's CPU one (each row's argmax, or ``aiolm::sample_rows``'s
    row sampler with the uniform number the sampler would take), so the tokens are theirs."""

    def __init__(self, stack: FusedDecodeStack, norm: Any, head: GGUFLinear, vocab_size: int) -> None:
        self.stack, self.head = stack, head
        b = head.blocks
        self.weights = [norm.weight.data, b.qs, b.scale, b.mins]
        self.eps, self.qtype, self.n, self.vocab = norm.eps, b.qtype, b.n, vocab_size

    @classmethod
    def of(cls, stack: Any, norm: Any, lm_head: Any) -> FusedSampleStep | None:
        """The step for a model whose layers are ``stack`` and whose end is the RMSNorm
        ``norm`` and ``lm_head`` (a ParallelLMHead), or None where the head has no blocks the
        kernels take or is split over ranks."""
        g = getattr(lm_head, "gguf", None)
        if (
            not isinstance(stack, FusedDecodeStack)
            or not isinstance(g, GGUFLinear)
            or not isinstance(g.blocks, GGUFWeight)
            or lm_head.tp.world_size != 1
            or norm.weight.dtype != torch.float32
        ):
            return None
        return cls(stack, norm, g, lm_head.vocab_size)

    def __call__(
        self,
        positions: torch.Tensor,
        input_ids: torch.Tensor,
        embed: Any,
        kv_caches: list[torch.Tensor],
        meta: Any,
        sampling: Any = None,
    ) -> torch.Tensor | None:
        """Each row's token ([rows] int64): its argmax where ``sampling`` is None, else as the
        sampler draws it with ``sampling`` (a SamplingMetadata without processors or logprobs,
        whose ``draws`` are taken only once the call takes the step); None where the call does
        not take the step (then the model's own way runs it)."""
        rows = input_ids.shape[0]
        int8 = INT8 and rows <= self.head.int8_rows
        if not (int8 or rows <= MAX_ROWS) or not self.stack.takes(rows, torch.float32, kv_caches):
            return None
        x = embed(input_ids)
        if x.dtype != torch.float32:
            return None
        head_ints = [self.qtype, self.n, self.vocab, int(int8)]
        args = self.stack.args(positions, x, None, kv_caches, meta)
        uniforms, knobs = (None, None) if sampling is None else sampling.draws()
        return torch.ops.aiolm.decode_sample(*args, self.weights, head_ints, self.eps, uniforms, knobs)


class GGUFBlocksMethod(LinearMethod):
    """``inner``'s weights and multiply, plus the file's blocks in ``layer.gguf`` (None where
    a tensor of the layer is not in a block type the kernels take) for the small steps."""

    def __init__(self, config: GGUFBlocksConfig, spec: LinearSpec, inner: LinearMethod, dtype: torch.dtype) -> None:
        self.config, self.names, self.inner, self.dtype = config, spec.names, inner, dtype

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        self.inner.create_weights(layer, in_features, out_features)
        layer.gguf = None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.inner.process_weights_after_loading(layer)
        blocks = self.config.blocks([n + ".weight" for n in self.names])
        layer.gguf = None if blocks is None else GGUFLinear(blocks, int8_rows(blocks, self.dtype))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        g = layer.gguf
        if g is not None:
            rows = x.shape[0]
            if INT8 and rows <= g.int8_rows:
                return g.blocks.linear_int8(x.float(), bias)
            if rows <= MAX_ROWS:
                return g.blocks.linear(x.float(), bias)
        return self.inner.apply(layer, x, bias)


class GGUFBlocksExpertsMethod(ExpertsMethod):
    """``inner``'s experts and their call, plus the file's blocks of this rank's experts in
    ``layer.gguf_experts`` (None where a projection is missing or in a type the kernels do not
    take) for the small steps, with their int8 limit in ``layer.gguf_experts_int8_rows``."""

    def __init__(self, config: GGUFBlocksConfig, spec: ExpertsSpec, inner: ExpertsMethod, dtype: torch.dtype) -> None:
        self.config, self.spec, self.inner, self.dtype = config, spec, inner, dtype

    def create_weights(self, layer: nn.Module, num_experts: int, hidden: int, intermediate: int) -> None:
        self.inner.create_weights(layer, num_experts, hidden, intermediate)
        layer.gguf_experts = None
        layer.gguf_experts_int8_rows = 0

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.inner.process_weights_after_loading(layer)
        blocks = self.config.expert_blocks(self.spec, layer.local_experts)
        if blocks is not None and (blocks.hidden, blocks.intermediate) != (layer.hidden, layer.local_intermediate):
            blocks = None  # intermediate features split over ranks: the blocks are whole experts'
        layer.gguf_experts = blocks
        layer.gguf_experts_int8_rows = 0 if blocks is None else int8_rows(blocks, self.dtype)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        g = layer.gguf_experts
        if g is not None:
            # An expert's matmuls have the rows routed to it, about T * k / E of them (16 decode
            # rows of a top-8 of 64: 2 each): that, not T, is what the float32 panels' limits
            # (measured on dense matmuls of that many rows) compare with.
            rows = -(-topk_ids.numel() // layer.local_experts)
            if INT8 and rows <= layer.gguf_experts_int8_rows:
                return g(x, topk_weights, topk_ids, int8=True)
            if rows <= MAX_ROWS:
                return g(x, topk_weights, topk_ids)
        return self.inner.apply(layer, x, topk_weights, topk_ids)


class GGUFBlocksConfig(QuantConfig):
    """The blocks of the GGUF file at ``path`` beside ``inner``'s methods (whose decoder
    layers multiply in ``matmul_dtype``, the LM head in float32). ``model_config`` says which
    q/k rows the file stores permuted (llama.cpp's RoPE layout for Llama and Mistral)."""

    name = "gguf_blocks"

    def __init__(
        self, path: Path, model_config: Any, inner: QuantConfig, matmul_dtype: torch.dtype = torch.float32
    ) -> None:
        self.path, self.model_config, self.inner, self.matmul_dtype = Path(path), model_config, inner, matmul_dtype
        self._raw: dict[str, tuple[np.ndarray, str]] | None = None
        # experts' tensors by (layer, "gate" / "up" / "down") and expert (-1: all of them stacked)
        self._experts: dict[tuple[int, str], dict[int, tuple[np.ndarray, str]]] = {}
        self.layers = self.fused = self.expert_layers = 0

    def linear_method(self, spec: LinearSpec) -> LinearMethod:
        dtype = torch.float32 if spec.lm_head else self.matmul_dtype  # as the inner method multiplies
        return GGUFBlocksMethod(self, spec, self.inner.linear_method(spec), dtype)

    def experts_method(self, spec: ExpertsSpec) -> ExpertsMethod:
        return GGUFBlocksExpertsMethod(self, spec, self.inner.experts_method(spec), self.matmul_dtype)

    def fused_decoder_layer(self, layer: Any) -> FusedDecodeLayer | None:
        fused = FusedDecodeLayer.of(layer)
        self.fused += fused is not None
        return fused

    def fused_decoder_stack(self, steps: list[Any]) -> FusedDecodeStack | None:
        return FusedDecodeStack.of(steps)

    def fused_sample_step(self, stack: Any, norm: Any, lm_head: Any) -> FusedSampleStep | None:
        return FusedSampleStep.of(stack, norm, lm_head)

    def _tensors(self) -> dict[str, tuple[np.ndarray, str]]:
        if self._raw is None:
            self._raw = {}
            arch = gguf_architecture(self.model_config.architecture)
            for t in read_tensors(self.path).values():
                if t.type_name not in BLOCK_TYPES:
                    continue
                name = hf_name(t.name, arch)
                stacked = hf_expert_names(t.name, arch, 1)  # expert 0's name says the layer and part
                expert = _EXPERT_NAME.match(name or (stacked[0] if stacked else ""))
                if expert is None:
                    if name is not None:
                        self._raw[name] = (t.data, t.type_name)
                    continue
                layer, e, proj = int(expert[1]), int(expert[2]), EXPERT_PARTS[expert[3]]
                self._experts.setdefault((layer, proj), {})[-1 if stacked else e] = (t.data, t.type_name)
        return self._raw

    def _expert_rows(self, layer: int, part: str, num_experts: int) -> tuple[np.ndarray, str] | None:
        """A layer's ``part`` projection of all its experts as rows [E * rows, bytes], and their type."""
        self._tensors()
        got = self._experts.get((layer, part), {})
        if -1 in got:  # the stacked tensor
            data, ttype = got[-1]
            return np.asarray(data, dtype=np.uint8), ttype
        # one tensor per expert (older Mixtral files), all of one type
        if sorted(got) != list(range(num_experts)) or len({ttype for _, ttype in got.values()}) != 1:
            return None
        return np.concatenate([np.asarray(got[e][0], dtype=np.uint8) for e in range(num_experts)]), got[0][1]

    def expert_blocks(self, spec: ExpertsSpec, local_experts: int) -> GGUFExperts | None:
        """The blocks of experts spec.expert_start .. + local_experts of the layer ``spec``
        names, or None where a projection is missing or in a type the kernels do not take."""
        m = re.match(r"^model\.layers\.(\d+)\.", spec.prefix)
        if m is None:
            return None
        parts = [self._expert_rows(int(m[1]), part, spec.num_experts) for part in ("gate", "up", "down")]
        if any(p is None for p in parts):
            return None
        rows = []
        for data, _ in parts:  # type: ignore[misc]
            per = data.shape[0] // spec.num_experts
            rows.append(data[spec.expert_start * per : (spec.expert_start + local_experts) * per])
        types = tuple(ttype for _, ttype in parts)  # type: ignore[misc]
        self.expert_layers += 1
        return GGUFExperts.from_blocks(*rows, types, local_experts)  # type: ignore[arg-type]

    def _rows(self, name: str) -> tuple[np.ndarray, str] | None:
        got = self._tensors().get(name)
        if got is None:
            return None
        data, ttype = got
        data = np.asarray(data, dtype=np.uint8)
        cfg = self.model_config
        if permuted_qk(cfg.architecture) and name.endswith(("q_proj.weight", "k_proj.weight")):
            data = unpermute_rope_rows(data, cfg.num_heads if "q_proj" in name else cfg.num_kv_heads)
        return kept(data, ttype)  # before the runs, so that a widened Q5_0 joins its Q8_0 neighbours

    def blocks(self, names: list[str]) -> GGUFWeight | GGUFParts | None:
        """The blocks of the tensors ``names`` side by side, or None where one is missing
        or in a type the kernels do not take."""
        parts = [self._rows(n) for n in names]
        if any(p is None for p in parts):
            return None
        runs: list[tuple[list[np.ndarray], str]] = []  # consecutive tensors of one type, concatenated
        for data, ttype in parts:  # type: ignore[misc]
            if runs and runs[-1][1] == ttype:
                runs[-1][0].append(data)
            else:
                runs.append(([data], ttype))
        weights = tuple(GGUFWeight.from_blocks(np.concatenate(d), t) for d, t in runs)
        self.layers += 1
        return weights[0] if len(weights) == 1 else GGUFParts(weights)

    def release(self) -> None:
        self._raw = None  # the file's mapping: the blocks are copies
        self._experts = {}
        log.info(
            "%d layers and %d layers of experts also keep their GGUF blocks for steps of up to %d rows%s; "
            "%d decoder layers run such steps as one call",
            self.layers,
            self.expert_layers,
            MAX_ROWS,
            " (int8 x: AIOLM_GGUF_INT8=1)" if INT8 else "",
            self.fused,
        )
        self.inner.release()
