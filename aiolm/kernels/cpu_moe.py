"""One mixture-of-experts layer's experts on the CPU, run by ``torch.ops.aiolm.fused_moe``.

The op (ext/cpu/fused_moe.cpp) takes a layer's routed tokens in one call: it groups the
(token, slot) pairs by expert, runs each routed expert's gate/up and down GEMMs over its
tokens and adds the weighted results into the output, reading only the routed experts'
weights. Per expert loops in torch cost a dispatch and a copy per expert and read each
expert's weight through MKL's per-call re-layout; here the weights are laid out once, at
load time, as the op reads them: panels of 16 output columns, as the dense linears'
(aiolm/quant/cpu_packed.py), with an expert's gate and up panels side by side so one tile
makes both halves of SiLU(gate) * up. Without the compiled kernels the experts keep their
dense weights and run as a torch loop.

``GGUFExperts`` keeps a GGUF file's experts as the file's quantized blocks instead, for
``torch.ops.aiolm.gguf_moe`` (the same routing, each expert's projections run by the dense
GGUF kernels' routines, ext/cpu/gguf_linear.h and gguf_int8.h): a decode step then reads the
routed experts' blocks (4.5 to 10 bits a weight as the kernels keep them) rather than 32
or 16 bits a weight.
"""

from __future__ import annotations

import torch

from aiolm.kernels import cpu as cpu_kernels
from aiolm.kernels.moe_reference import experts_reference

PANEL = 16  # output columns per panel, as fused_moe.cpp reads them


def available() -> bool:
    """Whether ``torch.ops.aiolm.fused_moe`` is loaded (a C++ compiler built the kernels)."""
    return cpu_kernels.load()


def _ceil(n: int, m: int) -> int:
    return -(-n // m) * m


def _panels(w: torch.Tensor, cols: int, depth: int, dtype: torch.dtype) -> torch.Tensor:
    """[E, n, K] -> [E, cols / 16, depth * 16] zero-padded to ``cols`` rows and ``depth`` features:
    float32 panels as [k][16]; bfloat16 ones with k in pairs, [k / 2][16][2] (vdpbf16ps's operand)."""
    e, n, k = w.shape
    padded = w.new_zeros(e, cols, depth, dtype=dtype)
    padded[:, :n, :k] = w
    p = padded.view(e, cols // PANEL, PANEL, depth)
    if dtype == torch.float32:
        p = p.transpose(2, 3)  # [E, P, depth, 16]
    else:
        p = p.view(e, cols // PANEL, PANEL, depth // 2, 2).permute(0, 1, 3, 2, 4)  # [E, P, depth / 2, 16, 2]
    return p.reshape(e, cols // PANEL, depth * PANEL).contiguous()


class CpuExperts:
    """One MoE layer's experts laid out for torch.ops.aiolm.fused_moe.

    ``w13`` is [E, P13, 2, Kp * 16]: for each panel p of 16 intermediate features its gate
    panel then its up panel over the Kp = H features (H rounded up to 32 for bfloat16, as is
    I: whole AMX tiles); ``w2`` is [E, P2, Ip * 16] with Ip = 16 * P13 and P2 = ceil(H / 16)
    rounded up to even.
    Zeros pad both (padded intermediate features come out silu(0) * 0 = 0). Without the
    kernels they are the dense [E, 2I, H] and [E, H, I] in ``dtype`` instead."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, hidden: int, intermediate: int, packed: bool) -> None:
        self.w13, self.w2 = w13, w2
        self.hidden, self.intermediate, self.packed = hidden, intermediate, packed
        self.num_experts = w13.shape[0]

    @classmethod
    def from_dense(cls, w13: torch.Tensor, w2: torch.Tensor, dtype: torch.dtype = torch.float32) -> CpuExperts:
        """From w13 [E, 2I, H] (rows 0..I-1 the gate projection, I..2I-1 the up one) and
        w2 [E, H, I] of any float dtype; ``dtype`` (float32 or bfloat16) is what the kernel reads."""
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"CPU experts run in float32 or bfloat16, not {dtype}")
        if w13.dim() != 3 or w2.dim() != 3 or w13.shape[1] % 2:
            raise ValueError(f"w13 must be [E, 2I, H] and w2 [E, H, I], got {tuple(w13.shape)} and {tuple(w2.shape)}")
        e, two_i, h = w13.shape
        i = two_i // 2
        if tuple(w2.shape) != (e, h, i):
            raise ValueError(f"w2 must be [E, H, I] = {(e, h, i)} for w13 {tuple(w13.shape)}, not {tuple(w2.shape)}")
        w13, w2 = w13.detach().cpu(), w2.detach().cpu()
        if not available():
            return cls(w13.to(dtype).contiguous(), w2.to(dtype).contiguous(), h, i, packed=False)
        # bfloat16 pads both reduced dimensions to AMX's 32 (whole tiles); float32 panels only I, to 16
        ip = _ceil(i, 2 * PANEL) if dtype == torch.bfloat16 else _ceil(i, PANEL)
        kp = _ceil(h, 2 * PANEL) if dtype == torch.bfloat16 else h
        gate = _panels(w13[:, :i], ip, kp, dtype)
        up = _panels(w13[:, i:], ip, kp, dtype)
        packed13 = torch.stack([gate, up], dim=2).contiguous()  # [E, P13, 2, Kp * 16]
        packed2 = _panels(w2, _ceil(h, 2 * PANEL), ip, dtype)
        return cls(packed13, packed2, h, i, packed=True)

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """float32 [T, H]: sum over j of topk_weights[t, j] * expert topk_ids[t, j] (x[t]),
        where an id of -1 (an expert on another rank) contributes nothing."""
        if x.dtype not in (torch.float32, torch.bfloat16):
            x = x.float()
        weights = topk_weights.float()
        if self.packed:
            return torch.ops.aiolm.fused_moe(x, self.w13, self.w2, weights, topk_ids)
        return experts_reference(x, self.w13, self.w2, weights, topk_ids)
