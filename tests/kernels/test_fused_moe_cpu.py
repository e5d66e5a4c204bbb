"""aiolm::fused_moe (ext/cpu/fused_moe.cpp) and CpuExperts against a per-expert loop in float64.

Tolerances, relative to the largest output magnitude: float32 weights 1e-5 (only the order of
the float32 sums differs from the reference); bfloat16 weights 1e-2 against the reference on the
same bfloat16-rounded weights (the AVX512-BF16 and AMX paths also round x and the intermediate
activations to bfloat16; the other paths keep them float32).
"""

from __future__ import annotations

import pytest
import torch

from aiolm.kernels import cpu as cpu_kernels
from aiolm.kernels import cpu_moe
from aiolm.kernels.cpu_moe import CpuExperts

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ compiler for the CPU kernels")

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """sum_j w[t, j] * w2[e] @ (silu(gate_e x_t) * up_e x_t) in float64, one routed expert at a time."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape[0], w13.shape[2], dtype=torch.float64)
    for e in range(w13.shape[0]):
        tok, slot = (ids.long() == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gate_up = x[tok].double() @ w13[e].double().t()
        act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, tok, (act @ w2[e].double().t()) * weights[tok, slot, None].double())
    return out


def _weights(experts: int, hidden: int, inter: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5,
        torch.randn(experts, hidden, inter, generator=g) / inter**0.5,
    )


def _routing(tokens: int, experts: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weights, ids = torch.rand(tokens, experts, generator=g).topk(k, dim=-1)
    return weights, ids


def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape
    scale = float(want.abs().max()) if want.numel() else 1.0
    torch.testing.assert_close(got.double(), want, rtol=0, atol=TOL[dtype] * scale)


def _all_paths(experts: CpuExperts, x, weights, ids) -> list[torch.Tensor]:
    """The op's result on every path this build has (scalar, AVX2, AVX-512, AVX512-BF16, AMX)."""
    best = torch.ops.aiolm.fused_moe_best_isa()
    return [torch.ops.aiolm.fused_moe(x, experts.w13, experts.w2, weights, ids, isa) for isa in range(best + 1)]


# tokens: one decode step, a few, a prompt over one tile of every path; hidden and intermediate
# sizes off every tile width (16, 32) and odd (bfloat16 pairs pad them); k from 1 to 8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "tokens,experts,hidden,inter,k",
    [(1, 8, 72, 40, 1), (1, 16, 100, 24, 8), (3, 6, 37, 23, 2), (13, 8, 48, 17, 3), (200, 12, 88, 56, 4)],
)
def test_matches_per_expert_loop(dtype, tokens, experts, hidden, inter, k):
    w13, w2 = _weights(experts, hidden, inter, tokens + hidden)
    weights, ids = _routing(tokens, experts, k, tokens * k)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1))
    moe = CpuExperts.from_dense(w13, w2, dtype)
    want = _reference(x, w13.to(dtype), w2.to(dtype), weights, ids)
    _check(moe(x, weights, ids), want, dtype)
    for got in _all_paths(moe, x, weights, ids):
        _check(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tokens_result_does_not_depend_on_the_step_it_is_in(dtype):
    """Each vector path's sums for a token are its own row's alone, in a fixed order: the same
    bits alone, among a few and among a prompt's worth of tokens (AMX: whether its rows fill
    one tile or two, and wherever they fall in a tile). Not the scalar path's: the compiler
    contracts its products into FMAs differently for each tile height."""
    w13, w2 = _weights(4, 96, 64, 11)
    x = torch.randn(70, 96, generator=torch.Generator().manual_seed(11))
    weights, ids = _routing(70, 4, 2, 11)  # some 35 rows an expert: blocks of 32 and a rest
    moe = CpuExperts.from_dense(w13, w2, dtype)
    for isa in range(1, torch.ops.aiolm.fused_moe_best_isa() + 1):
        whole = torch.ops.aiolm.fused_moe(x, moe.w13, moe.w2, weights, ids, isa)
        for part in (slice(0, 1), slice(33, 36), slice(5, 70)):
            alone = torch.ops.aiolm.fused_moe(x[part], moe.w13, moe.w2, weights[part], ids[part], isa)
            assert torch.equal(alone, whole[part]), f"isa {isa}, tokens {part}"


@pytest.mark.parametrize("k", [5, 6, 7, 8])
def test_every_top_k_up_to_8(k):
    w13, w2 = _weights(9, 40, 20, k)
    weights, ids = _routing(7, 9, k, k)
    x = torch.randn(7, 40)
    _check(CpuExperts.from_dense(w13, w2)(x, weights, ids), _reference(x, w13, w2, weights, ids), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_expert_takes_every_token_and_the_others_none(dtype):
    w13, w2 = _weights(6, 64, 48, 3)
    x = torch.randn(200, 64)
    ids = torch.full((200, 2), 4)
    ids[:, 1] = 1  # two experts busy, four with no tokens at all
    weights = torch.rand(200, 2)
    moe = CpuExperts.from_dense(w13, w2, dtype)
    want = _reference(x, w13.to(dtype), w2.to(dtype), weights, ids)
    for got in _all_paths(moe, x, weights, ids):
        _check(got, want, dtype)


def test_ids_of_minus_one_are_skipped_and_int32_ids_equal_int64():
    w13, w2 = _weights(5, 40, 24, 4)
    x = torch.randn(30, 40)
    weights, ids = _routing(30, 5, 3, 4)
    ids[::2, 1] = -1  # another rank's experts
    ids[7] = -1  # a token with no local expert: a zero row
    moe = CpuExperts.from_dense(w13, w2)
    got64 = moe(x, weights, ids)
    got32 = moe(x, weights, ids.int())
    assert torch.equal(got64, got32)
    assert torch.equal(got64[7], torch.zeros(40))
    _check(got64, _reference(x, w13, w2, weights, ids), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_step_reads_only_routed_experts(dtype):
    w13, w2 = _weights(8, 64, 32, 5)
    ids = torch.tensor([[2, 6]])
    poisoned13, poisoned2 = w13.clone(), w2.clone()
    for e in set(range(8)) - {2, 6}:
        poisoned13[e], poisoned2[e] = float("nan"), float("nan")
    moe = CpuExperts.from_dense(poisoned13, poisoned2, dtype)
    x, weights = torch.randn(1, 64), torch.tensor([[0.7, 0.3]])
    want = _reference(x, w13.to(dtype), w2.to(dtype), weights, ids)
    for got in _all_paths(moe, x, weights, ids):
        assert torch.isfinite(got).all()
        _check(got, want, dtype)


def test_empty_step_and_bfloat16_input():
    w13, w2 = _weights(4, 48, 16, 6)
    moe = CpuExperts.from_dense(w13, w2, torch.bfloat16)
    empty = moe(torch.zeros(0, 48), torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.long))
    assert empty.shape == (0, 48) and empty.dtype == torch.float32
    x = torch.randn(5, 48).bfloat16()
    weights, ids = _routing(5, 4, 2, 6)
    _check(moe(x, weights, ids), _reference(x.float(), w13.bfloat16(), w2.bfloat16(), weights, ids), torch.bfloat16)


def test_rejects_ids_out_of_range_and_mismatched_shapes():
    w13, w2 = _weights(4, 32, 16, 7)
    moe = CpuExperts.from_dense(w13, w2)
    with pytest.raises(RuntimeError, match="expert id 4 outside"):
        moe(torch.zeros(1, 32), torch.ones(1, 1), torch.tensor([[4]]))
    with pytest.raises(RuntimeError, match="x has 16 features"):
        moe(torch.zeros(1, 16), torch.ones(1, 1), torch.tensor([[0]]))
    with pytest.raises(ValueError, match="w2 must be"):
        CpuExperts.from_dense(w13, w2[:, :, :8])


def test_without_the_kernels_the_torch_loop_gives_the_same_sums(monkeypatch):
    monkeypatch.setattr(cpu_moe, "available", lambda: False)
    w13, w2 = _weights(6, 40, 24, 8)
    moe = CpuExperts.from_dense(w13, w2)
    assert not moe.packed
    weights, ids = _routing(9, 6, 2, 8)
    ids[0, 0] = -1
    x = torch.randn(9, 40)
    _check(moe(x, weights, ids), _reference(x, w13, w2, weights, ids), torch.float32)


def test_baseline_x86_64_build_matches_the_reference(isa_runs):
    """The #if guards: a build without AVX (the scalar path alone) gives the same sums."""
    isa_runs.check("fused_moe", "baseline-x86-64")  # isa_builds.SUITES["fused_moe"]
