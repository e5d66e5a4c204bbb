"""aiolm::gguf_linear against gguf-py's own dequantization, and the model using it."""

from __future__ import annotations

import gguf
import isa_builds
import numpy as np
import pytest
import torch

from aiolm.kernels import cpu as cpu_kernels
from aiolm.quant import gguf_blocks

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ compiler for the CPU kernels")


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 4, 8, 9, 20, 40])
@pytest.mark.parametrize("cols", [96, 608])  # 608: two of the wide path's chunks of 256 and a part
def test_matches_dequantized_matmul(qtype, rows, cols):
    rng = np.random.default_rng(rows)
    w = rng.standard_normal((43, cols)).astype(np.float32)  # 5 groups of 8 rows and a padded one
    w[3] *= 1e-3  # tiny scales
    w[5] = np.abs(w[5]) + 2  # all positive: Q4_1's minimum is far from 0
    t = getattr(gguf.GGMLQuantizationType, qtype)
    blocks = gguf.quants.quantize(w, t)
    deq = torch.from_numpy(np.asarray(gguf.quants.dequantize(blocks, t), dtype=np.float32).reshape(w.shape))
    x = torch.from_numpy(rng.standard_normal((rows, cols)).astype(np.float32))
    got = gguf_blocks.GGUFWeight.from_blocks(blocks, qtype).linear(x)
    want = (x.double() @ deq.double().t()).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_keeps_leading_dims_and_rejects_mismatches():
    w = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    g = gguf_blocks.GGUFWeight.from_blocks(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0), "Q8_0")
    assert g.linear(torch.zeros(2, 3, 64)).shape == (2, 3, 8)
    with pytest.raises(RuntimeError, match="x has 32 features, W has 64"):
        g.linear(torch.zeros(1, 32))
    with pytest.raises(RuntimeError, match="unsupported GGUF type id 13"):
        torch.ops.aiolm.gguf_linear(torch.zeros(1, 64), g.qs, g.scale, g.mins, 13, g.n)
    with pytest.raises(RuntimeError, match="Q4_1 needs float16 mins"):
        torch.ops.aiolm.gguf_linear(
            torch.zeros(1, 64), g.qs[:, : g.qs.shape[1] // 2].contiguous().view(torch.uint8), g.scale, g.mins, 3, g.n
        )


def test_embedded_model_decodes_from_its_blocks_like_the_float32_path(real_source, tokenizer, monkeypatch):
    """One sequence decodes through the GGUF blocks (1 row per step, float arithmetic: int8
    activations are tests/kernels/test_gguf_int8.py's); the same greedy tokens come out when
    the blocks are taken away and every step runs in float32 through oneDNN."""
    from aiolm.model.registry import build_model
    from paged import PagedHarness

    monkeypatch.setattr(gguf_blocks, "INT8", False)
    model = build_model(real_source, torch.float32)
    layers = [m for m in model.modules() if isinstance(getattr(m, "gguf", None), gguf_blocks.GGUFLinear)]
    assert len(layers) == 4 * model.config.num_layers + 1  # every linear layer and the LM head
    assert {m.gguf.blocks.qtype for m in layers} == {3, 8}  # the file's Q4_1 layers, its Q8_0 embedding
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    with_blocks = PagedHarness(model).greedy([prompt], 24)[0]
    for m in layers:
        m.gguf = None  # the blocks taken away: the method it had beside them
    without = PagedHarness(model).greedy([prompt], 24)[0]
    assert with_blocks == without
    assert "Paris" in tokenizer.decode(with_blocks)


@pytest.mark.slow
@pytest.mark.parametrize("isa", list(isa_builds.ISA_BUILDS))
def test_other_isa_builds_match_the_references(isa, isa_runs):
    """The float kernel's AVX2 and scalar paths (here a CPU with AVX-512 reaches neither),
    for every block type, k-quants included; the int8 kernel is built in too, since the
    k-quant tests' module asks it which of its paths exist."""
    isa_builds.check_build_flags(isa)
    isa_runs.check("gguf_linear", isa)  # isa_builds.SUITES["gguf_linear"]


def test_q5_0_blocks_keep_their_bits_or_are_widened_with_the_files_values(monkeypatch):
    """A Q5_0 tensor (Q4_K_M files keep some down projections in it) is kept at the file's 5.5
    bits a weight (20 bytes of codes a block, the f16 scale beside), or widened to Q8_0 codes
    where a model keeps it so (gguf_blocks.kept); both hold exactly the values gguf dequantizes
    it to, and multiply as they do."""
    w = np.random.default_rng(5).standard_normal((27, 96)).astype(np.float32)  # a padded group
    w[2, :32] = np.linspace(-1, 1, 32)  # every code from 0 to 31: each fifth bit set and clear
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q5_0)
    want = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q5_0).reshape(27, 96))
    g = gguf_blocks.GGUFWeight.from_blocks(blocks, "Q5_0")
    assert g.qtype == gguf_blocks.TYPE_IDS["Q5_0"] and g.qs.shape == (4, 3 * 8 * 20) and g.scale.dtype == torch.float16
    for keep, qtype in ((True, "Q5_0"), (False, "Q8_0")):
        monkeypatch.setattr(gguf_blocks, "KEEP_Q5_0", keep)
        g = gguf_blocks.GGUFWeight.from_blocks(*gguf_blocks.kept(blocks, "Q5_0"))
        assert g.qtype == gguf_blocks.TYPE_IDS[qtype]
        assert torch.equal(g.dequantize(), want)
        x = torch.randn(3, 96)
        torch.testing.assert_close(g.linear(x), x @ want.T, rtol=1e-5, atol=1e-4)


def _q4_weight(qtype: str, seed: int = 0) -> tuple[gguf_blocks.GGUFWeight, torch.Tensor]:
    """A weight of 3 groups (K = 2048, 64 blocks a row) as qtype's blocks, and its float32 values."""
    w = np.random.default_rng(seed).standard_normal((24, 2048)).astype(np.float32)
    t = getattr(gguf.GGMLQuantizationType, qtype)
    blocks = gguf.quants.quantize(w, t)
    deq = np.asarray(gguf.quants.dequantize(blocks, t), dtype=np.float32).reshape(w.shape)
    return gguf_blocks.GGUFWeight.from_blocks(blocks, qtype), torch.from_numpy(deq)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_x_of_any_size_gives_the_results_times_the_same_power_of_2(qtype):
    """On an AMD AVX2 core the tiles read 4-bit codes as float32 subnormals and scale x to
    suit its largest value (ext/cpu/gguf_linear.h, raw_codes): x times 2^k must give the
    result times 2^k exactly, from tiny to huge activations, and match the float64 matmul."""
    g, deq = _q4_weight(qtype)
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((3, 2048)).astype(np.float32))
    x[1, 100] = 40.0  # one row with a large value beside small ones
    base = g.linear(x)
    want = (x.double() @ deq.double().t()).float()
    torch.testing.assert_close(base, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    for k in (-100, -60, -20, -1, 1, 20, 60, 90):
        scaled = g.linear(x * 2.0**k)
        assert torch.isfinite(scaled).all(), k
        assert torch.equal(scaled, base * 2.0**k), k


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_a_thread_that_flushes_subnormals_gets_the_same_results(qtype):
    """torch.set_flush_denormal(True) sets this thread's DAZ and FTZ flags, under which a
    subnormal reads as zero; the kernel clears them for its call (and restores them), so
    codes read as subnormals still count."""
    g, _ = _q4_weight(qtype, seed=2)
    x = torch.from_numpy(np.random.default_rng(3).standard_normal((1, 2048)).astype(np.float32))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the call runs on this thread, whose flags are set
    try:
        want = g.linear(x)
        if not torch.set_flush_denormal(True):
            pytest.skip("this CPU cannot flush subnormals")
        try:
            got = g.linear(x)
            assert torch.tensor(1e-40).item() == 0.0  # the flags are still this thread's afterwards
        finally:
            torch.set_flush_denormal(False)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got, want)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_a_rows_result_does_not_depend_on_the_batch_it_is_in(qtype):
    """The tiles take x's rows in eights, threes, pairs or one at a time (by ISA and step size), each
    row with the same arithmetic; from 4 rows on, Intel's AVX-512 cores convert a group's blocks
    once and sum in 16 lanes for every row (gguf_linear.h, WIDE_ROWS). So a row's result has the
    same bits in every step of 1-3 rows, and in every step of 4 or more, at any place in it: a
    request's tokens do not depend on who shares its steps, only on how many do (as between the
    blocks and the float32 panels, which steps of more than gguf_blocks.MAX_ROWS rows take)."""
    g, _ = _q4_weight(qtype, seed=4)
    x = torch.from_numpy(np.random.default_rng(5).standard_normal((9, 2048)).astype(np.float32))
    alone = torch.cat([g.linear(x[r : r + 1]) for r in range(9)])
    full = g.linear(x)
    torch.testing.assert_close(full, alone, rtol=1e-5, atol=1e-4)
    for rows in range(2, 10):
        want = alone if rows < 4 else full
        for r0 in (0, 9 - rows):
            assert torch.equal(g.linear(x[r0 : r0 + rows]), want[r0 : r0 + rows]), (rows, r0)
