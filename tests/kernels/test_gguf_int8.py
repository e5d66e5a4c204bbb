"""aiolm::gguf_int8_linear (int8 activations x GGUF blocks) on every ISA path this build
has, against float64 references, and the real model decoding through it."""

from __future__ import annotations

import os
import resource

import gguf
import numpy as np
import pytest
import torch

from aiolm.kernels import cpu as cpu_kernels
from aiolm.quant import gguf_blocks
from aiolm.quant.base import LinearMethod, LinearSpec
from kquant_blocks import random_q6_k
from paged import parity_prompt_ids

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ compiler for the CPU kernels")

ISAS = {0: "scalar", 1: "avx2", 2: "avx512-vnni"}


def _isas() -> list[int]:
    return list(range(torch.ops.aiolm.gguf_int8_best_isa() + 1)) if cpu_kernels.load() else [0]


def _x(rows: int, k: int, seed: int) -> torch.Tensor:
    x = torch.from_numpy(np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32))
    x[0, :32] *= 1e-4  # a block of tiny values
    x[-1, 32:64] = 0  # an all-zero block: scale 0
    x[-1, 64] = 40.0  # an outlier sets its block's scale
    return x


def test_every_path_quantizes_to_the_same_codes():
    x = _x(5, 128, 0)
    q0, d0 = torch.ops.aiolm.gguf_int8_quantize(x, 0)
    blocks = x.double().view(5, 4, 32)
    amax = blocks.abs().amax(-1)
    assert torch.equal(d0, (amax.float() / 127))
    want = torch.round(x.view(5, 4, 32) * torch.where(d0 > 0, 1 / d0, 0).unsqueeze(-1)).view(5, 128)
    assert torch.equal(q0.float(), want)  # torch.round is half to even, like the kernel
    assert q0.abs().max() <= 127
    for isa in _isas()[1:]:
        q, d = torch.ops.aiolm.gguf_int8_quantize(x, isa)
        assert torch.equal(q, q0) and torch.equal(d, d0), ISAS[isa]


@pytest.mark.parametrize("isa", _isas(), ids=lambda i: ISAS[i])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q8_0"])
# Tiles (gguf_int8.cpp's even_tiles) of 3-11 rows, as runs of up to 6 rows whose sums interleave:
# 11 rows, runs of 6 and 5; 12, tiles of 6 and 6; 17, tiles of 8 (4 + 4) and 9 (5 + 4);
# 70, two passes (tiles of 10-11, then 6).
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 11, 12, 13, 17, 70])
def test_matches_dequantized_weights_times_dequantized_x(isa, qtype, rows):
    """Tight against the same int8 x dequantized (only float rounding differs); within
    the quantization's own error bound against float32 x."""
    rng = np.random.default_rng(rows)
    # 4 groups of 8 rows and a padded one: an odd count, so the 4-bit types' last pair of
    # groups on VNNI has one group
    w = rng.standard_normal((37, 128)).astype(np.float32)
    w[3] *= 1e-3
    w[5] = np.abs(w[5]) + 2  # Q4_1's minimum far from 0
    w[6, :32] = -np.abs(w[6, :32]).max()  # a Q8_0 block of -127 codes (|w| of 127 on AVX2's sign trick)
    t = getattr(gguf.GGMLQuantizationType, qtype)
    blocks = gguf.quants.quantize(w, t)
    deq = torch.from_numpy(np.asarray(gguf.quants.dequantize(blocks, t), dtype=np.float64).reshape(w.shape))
    g = gguf_blocks.GGUFWeight.from_blocks(blocks, qtype)
    x = _x(rows, 128, rows + 10)
    got = g.linear_int8(x, isa=isa).double()

    q, d = torch.ops.aiolm.gguf_int8_quantize(x, isa)
    xq = (q.double().view(rows, 4, 32) * d.double().unsqueeze(-1)).view(rows, 128)
    want = xq @ deq.t()
    scale = (xq.abs() @ deq.abs().t()).clamp_min(1e-30)  # sum of |terms|: float rounding is relative to it
    assert ((got - want).abs() / scale).max() < 2e-6

    # Rounding x to codes moves each value by at most half a step d/2.
    half_step = (d.double() / 2).repeat_interleave(32, dim=1)
    bound = half_step @ deq.abs().t() + 2e-6 * scale
    exact = x.double() @ deq.t()
    assert ((got - exact).abs() <= bound).all()
    assert (got - exact).abs().max() > 0  # it did quantize


def test_leading_dims_bias_and_bad_arguments():
    w = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    g = gguf_blocks.GGUFWeight.from_blocks(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1), "Q4_1")
    x = torch.randn(2, 3, 64)
    assert g.linear_int8(x).shape == (2, 3, 8)
    torch.testing.assert_close(g.linear_int8(x, torch.ones(8)), g.linear_int8(x) + 1)
    with pytest.raises(RuntimeError, match="x has 32 features, W has 64"):
        g.linear_int8(torch.zeros(1, 32))
    with pytest.raises(RuntimeError, match="unsupported GGUF type id 13"):
        torch.ops.aiolm.gguf_int8_linear(torch.zeros(1, 64), g.qs, g.scale, g.mins, 13, g.n)
    with pytest.raises(RuntimeError, match="isa 7 is not built here"):
        g.linear_int8(torch.zeros(1, 64), isa=7)
    with pytest.raises(RuntimeError, match="not whole blocks of 32"):
        torch.ops.aiolm.gguf_int8_quantize(torch.zeros(1, 40))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q6_K"])
@pytest.mark.parametrize("matmul_dtype", [torch.float32, torch.bfloat16])
def test_int8_mode_sends_prompt_steps_to_the_int8_kernel_only_with_vnni(qtype, matmul_dtype, monkeypatch):
    """AIOLM_GGUF_INT8=1 multiplies a weight's steps of any size with int8 activations where
    the VNNI kernel beats the layer's matmuls (bench_linear.py, section 1d), Q6_K's too;
    without VNNI, steps of up to 16 rows; beside bfloat16 matmuls on AMX, up to 32.
    Off, no step is int8."""
    if qtype == "Q6_K":
        g = gguf_blocks.GGUFWeight.from_blocks(random_q6_k(16, 256, np.random.default_rng(2), (1e-3, 1e-2)), qtype)
    else:
        w = np.random.default_rng(2).standard_normal((16, 256)).astype(np.float32)
        g = gguf_blocks.GGUFWeight.from_blocks(gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype]), qtype)
    layer = torch.nn.Module()  # a linear layer as GGUFBlocksMethod leaves it: blocks beside a dense weight
    layer.weight = torch.nn.Parameter(g.dequantize(), requires_grad=False)
    layer.gguf = gguf_blocks.GGUFLinear(g, gguf_blocks.int8_rows(g, matmul_dtype))
    method = gguf_blocks.GGUFBlocksMethod(None, LinearSpec(()), LinearMethod(), matmul_dtype)  # type: ignore[arg-type]

    def lin(x: torch.Tensor) -> torch.Tensor:
        return method.apply(layer, x)

    if not cpu_kernels.has_avx512_vnni():
        limit = 16
    else:
        limit = 32 if matmul_dtype == torch.bfloat16 and cpu_kernels.has_amx() else 300
    monkeypatch.setattr(gguf_blocks, "INT8", True)
    for rows in (3, 16, 17, 32, 33, 300):
        x = torch.randn(rows, 256)
        assert torch.equal(lin(x), g.linear_int8(x)) == (rows <= limit), rows
        assert not torch.equal(g.linear_int8(x), LinearMethod().apply(layer, x))  # the two are told apart
    small = torch.randn(3, 256)
    monkeypatch.setattr(gguf_blocks, "INT8", False)
    assert not torch.equal(lin(small), g.linear_int8(small))


def test_bfloat16_model_keeps_int8_from_its_amx_matmuls_but_not_from_its_float32_head(real_source, monkeypatch):
    """With --dtype bfloat16 the decoder layers' large steps go to bfloat16 matmuls (on AMX
    beyond 32 rows), while the LM head multiplies in float32, which int8 beats at every
    size where it has VNNI: a 64-row step of the head stays int8."""
    from aiolm.model.registry import build_model

    model = build_model(real_source, torch.bfloat16)
    monkeypatch.setattr(gguf_blocks, "INT8", True)
    vnni = cpu_kernels.has_avx512_vnni()
    head, gate_up = model.lm_head, model.layers[0].mlp.gate_up_proj
    x = torch.randn(64, 576)
    assert torch.equal(head._matmul(x), head.gguf.blocks.linear_int8(x)) == vnni
    assert torch.equal(gate_up._matmul(x).float(), gate_up.gguf.blocks.linear_int8(x)) == (
        vnni and not cpu_kernels.has_amx()
    )


@pytest.mark.parametrize("kernel", ["linear_int8", "linear"])
def test_large_outputs_reuse_a_dropped_buffer_and_never_a_held_one(kernel):
    """Outputs of 32 MiB and more come from buffers kept per thread (ext/cpu/linear_rows.h),
    so that a prompt step's large matmuls do not fault fresh pages in on every call: a
    dropped output's memory is handed out again, one still held (or viewed) never."""
    w = np.random.default_rng(3).standard_normal((9000, 32)).astype(np.float32)
    g = gguf_blocks.GGUFWeight.from_blocks(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0), "Q4_0")
    f = getattr(g, kernel)
    x = torch.randn(1000, 32)  # 1000 x 9000 floats: 34 MiB
    a = f(x)
    ref = a.clone()
    b = f(x + 1)
    assert b.data_ptr() != a.data_ptr() and torch.equal(a, ref)
    view = a[:5]
    del a
    c = f(x + 2)  # a's storage is still held through the view
    assert view.data_ptr() not in (b.data_ptr(), c.data_ptr()) and torch.equal(view, ref[:5])
    ptr = c.data_ptr()
    del c
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    d = f(x)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    assert d.data_ptr() == ptr and torch.equal(d, ref)
    assert faults < d.numel() * 4 // os.sysconf("SC_PAGE_SIZE") // 10, faults  # a fresh mapping: every page


def _agreement(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _forced_agreement(harness, prompts: list[list[int]], ref: list[list[int]]) -> tuple[int, int]:
    """Next-token agreement with ``ref`` when every step is fed ref's tokens (teacher forcing):
    unlike the length of greedy agreement, one early difference does not decide it."""
    logits = harness.step(dict(enumerate(prompts)))
    hits = 0
    for t in range(len(ref[0])):
        hits += sum(int(logits[i].argmax()) == ref[i][t] for i in logits)
        logits = harness.step({i: [ref[i][t]] for i in logits})
    return hits, len(ref[0]) * len(ref)


def test_embedded_model_greedy_tokens_agree_with_the_float_block_path(real_source, tokenizer, monkeypatch):
    """The parity prompts decoded together (6 rows per step) through int8 activations and
    through the float-block kernel: the length of greedy agreement is printed per prompt,
    and the int8 path must still say Paris and pick the float path's next token at almost
    every step of its answers."""
    from aiolm.model.registry import build_model
    from paged import PagedHarness

    model = build_model(real_source, torch.float32)
    prompts = parity_prompt_ids(tokenizer)
    assert len(prompts) <= min(gguf_blocks.INT8_LIMIT, gguf_blocks.MAX_ROWS)  # decode steps: int8, or float blocks
    n = 48
    monkeypatch.setattr(gguf_blocks, "INT8", False)
    floats = PagedHarness(model).greedy(prompts, n)
    monkeypatch.setattr(gguf_blocks, "INT8", True)  # as AIOLM_GGUF_INT8=1 sets it (with VNNI, prompts too)
    int8 = PagedHarness(model).greedy(prompts, n)
    hits, steps = _forced_agreement(PagedHarness(model), prompts, floats)
    # The float path's answers fed back as one prompt step each: with VNNI an int8 matmul of
    # every row (gguf_blocks.INT8_LIMIT), elsewhere the float32 panels.
    logits = PagedHarness(model).step({i: p + f for i, (p, f) in enumerate(zip(prompts, floats))}, every=True)
    in_prompt = sum(
        int((logits[i][len(p) - 1 : -1].argmax(-1) == torch.tensor(floats[i])).sum()) for i, p in enumerate(prompts)
    )
    agree = [_agreement(a, b) for a, b in zip(int8, floats)]
    print(
        f"\nint8 vs float-block greedy agreement (tokens of {n}): {agree}; next token under teacher "
        f"forcing: {hits}/{steps} decoding, {in_prompt}/{steps} in one prompt step"
    )
    assert "Paris" in tokenizer.decode(int8[-1])
    assert int8[-1][:12] == floats[-1][:12]
    # Greedy agreement is chaotic (one near-tie decides the rest), so only the teacher-forced
    # counts are gates: with int8 decode steps after float prompts, the scalar path, the
    # reference arithmetic, gave [48, 16, 12, 15, 24, 26] here and AVX2 [26, 48, 12, 15, 48, 19],
    # VNNI with int8 prompts [5, 16, 6, 15, 24, 48]; under teacher forcing every path picked
    # the float path's token at 281-283 of 288 steps.
    assert hits >= 0.95 * steps, (hits, steps)
    assert in_prompt >= 0.95 * steps, (in_prompt, steps)


def test_bfloat16_matmuls_with_int8_activations_still_answer_paris(real_source, tokenizer, monkeypatch):
    """The fastest single-stream mode (docs/benchmarks.md): bfloat16 matmuls for the prompt,
    a float16 KV cache and int8 activations for every decode step still answer the chat
    question."""
    from aiolm.model.registry import build_model
    from paged import PagedHarness

    model = build_model(real_source, torch.bfloat16)
    monkeypatch.setattr(gguf_blocks, "INT8", True)
    chat = parity_prompt_ids(tokenizer)[-1]
    out = PagedHarness(model, dtype=torch.float16).greedy([chat], 16)[0]
    assert "Paris" in tokenizer.decode(out), tokenizer.decode(out)
