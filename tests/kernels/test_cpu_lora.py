"""aiolm::lora_apply_ (ext/cpu/lora.cpp) against a per-row loop in float64, on every ISA path.

The op only sums in another order than the loop, so float32 results agree within 1e-5 of the
largest update; rows without an adapter (slot -1) must come back bit for bit unchanged.
"""

from __future__ import annotations

import isa_builds
import pytest
import torch

from aiolm.kernels import cpu as cpu_kernels
from aiolm.kernels import cpu_lora
from aiolm.kernels.lora_reference import lora_reference

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ compiler for the CPU kernels")


def _per_row(y, x, a, b, ids, starts) -> torch.Tensor:
    """y + each row's own adapter update, one row and one slice at a time, in float64."""
    out = y.double().clone()
    rank = b.shape[2]
    for t in range(x.shape[0]):
        s = int(ids[t])
        if s < 0:
            continue
        for i in range(len(starts) - 1):
            c0, c1 = starts[i], starts[i + 1]
            h = a[s, i * rank : (i + 1) * rank].double() @ x[t].double()
            out[t, c0:c1] += b[s, c0:c1].double() @ h
    return out


def _problem(tokens, k, starts, rank, slots, seed, none_every=3):
    g = torch.Generator().manual_seed(seed)
    n, slices = starts[-1], len(starts) - 1
    x = torch.randn(tokens, k, generator=g)
    y = torch.randn(tokens, n, generator=g)
    a = torch.randn(slots, slices * rank, k, generator=g) / k**0.5
    b = torch.randn(slots, n, rank, generator=g) / rank**0.5
    ids = torch.randint(0, slots, (tokens,), generator=g)
    ids[::none_every] = -1
    return y, x, a, b, ids


def _every_path(y, x, a, b, ids, starts) -> list[torch.Tensor]:
    outs = []
    for isa in range(torch.ops.aiolm.lora_best_isa() + 1):
        got = y.clone()
        torch.ops.aiolm.lora_apply_(got, x, a, b, ids, list(starts), isa)
        outs.append(got)
    return outs


def _check(got, want, y, ids) -> None:
    scale = float((want - y.double()).abs().max()) or 1.0
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * scale)
    none = ids[: y.shape[0]] < 0
    assert torch.equal(got[none], y[none]), "a row without an adapter was written"


# tokens: a decode step, a few (the dot-product expand), one over every path's tiles and a
# prefill; K and the slices off every vector width; ranks 8, 16 and 64 (and an odd one);
# one slice (o_proj, down_proj) and three uneven ones (a fused q/k/v)
@pytest.mark.parametrize("tokens", [1, 2, 7, 45])
@pytest.mark.parametrize("rank", [8, 16, 64, 5])
@pytest.mark.parametrize("k,starts", [(64, [0, 96]), (37, [0, 48, 64, 81])])
def test_matches_a_per_row_loop_on_every_path(tokens, rank, k, starts):
    y, x, a, b, ids = _problem(tokens, k, starts, rank, slots=4, seed=tokens * 100 + rank)
    want = _per_row(y, x, a, b, ids, starts)
    for got in _every_path(y, x, a, b, ids, starts):
        _check(got, want, y, ids)


def test_many_rows_of_one_slot_and_a_lone_row_of_another():
    """A prefill of one adapter beside one decode row of another: the work is split unevenly
    over the slots, and the lone row's items must still land."""
    starts = [0, 576]
    y, x, a, b, ids = _problem(300, 576, starts, 16, slots=3, seed=1, none_every=1000)
    ids[:] = 0
    ids[150] = 2
    want = _per_row(y, x, a, b, ids, starts)
    for got in _every_path(y, x, a, b, ids, starts):
        _check(got, want, y, ids)


def test_unused_slots_are_never_read_and_rows_without_an_adapter_never_written():
    starts = [0, 40, 72]
    y, x, a, b, ids = _problem(12, 24, starts, 8, slots=5, seed=2, none_every=2)
    ids[ids >= 3] = 1
    a[3:] = float("nan")
    b[3:] = float("nan")
    want = _per_row(y, x, a, b, ids, starts)
    for got in _every_path(y, x, a, b, ids, starts):
        assert not got.isnan().any()
        _check(got, want, y, ids)


def test_no_adapter_in_the_batch_leaves_y_alone():
    starts = [0, 32]
    y, x, a, b, ids = _problem(6, 16, starts, 8, slots=2, seed=3)
    ids[:] = -1
    for got in _every_path(y, x, a, b, ids, starts):
        assert torch.equal(got, y)


def test_a_static_slot_buffer_longer_than_the_batch_and_int32_ids():
    """The CUDA-graph style: slot_ids is a fixed buffer; entries past the batch are not read."""
    starts = [0, 48]
    y, x, a, b, ids = _problem(5, 32, starts, 16, slots=3, seed=4)
    buffer = torch.full((64,), 7, dtype=torch.int32)  # 7: out of range, so a read would raise
    buffer[:5] = ids.int()
    want = _per_row(y, x, a, b, ids, starts)
    for got in _every_path(y, x, a, b, buffer, starts):
        _check(got, want, y, ids)


def test_strided_views_of_y_and_x():
    """A layer may hand rows of a wider buffer (a column slice of a fused output)."""
    starts = [0, 20, 50]
    _, x, a, b, ids = _problem(9, 40, starts, 8, slots=2, seed=5)
    wide_y = torch.randn(9, 70)
    wide_x = torch.zeros(9, 60)
    wide_x[:, 10:50] = x
    y = wide_y[:, 13:63]
    want = _per_row(y, x, a, b, ids, starts)
    before = wide_y.clone()
    torch.ops.aiolm.lora_apply_(y, wide_x[:, 10:50], a, b, ids, starts)
    _check(y, want, before[:, 13:63], ids)
    assert torch.equal(wide_y[:, :13], before[:, :13]) and torch.equal(wide_y[:, 63:], before[:, 63:])


def test_the_result_does_not_depend_on_the_thread_count():
    starts = [0, 256, 320, 384]
    y, x, a, b, ids = _problem(64, 256, starts, 16, slots=4, seed=6)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            got = y.clone()
            torch.ops.aiolm.lora_apply_(got, x, a, b, ids, starts)
            outs.append(got)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_the_python_entry_point_and_its_torch_fallback_agree():
    starts = [0, 24, 40]
    y, x, a, b, ids = _problem(8, 32, starts, 8, slots=3, seed=7)
    native, ref = y.clone(), y.clone()
    cpu_lora.lora_apply(native, x, a, b, ids, starts)
    lora_reference(ref, x, a, b, ids, starts)
    torch.testing.assert_close(native, ref, rtol=0, atol=1e-5 * float((ref - y).abs().max()))
    # bfloat16 is not the op's: the entry point falls back to the reference, in place
    y16 = y.bfloat16()
    got16, want16 = y16.clone(), y16.clone()
    cpu_lora.lora_apply(got16, x.bfloat16(), a.bfloat16(), b.bfloat16(), ids, starts)
    lora_reference(want16, x.bfloat16(), a.bfloat16(), b.bfloat16(), ids, starts)
    assert torch.equal(got16, want16)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda p: {**p, "ids": torch.tensor([0, 3, -1, 1])}, "slot id 3 of row 1 outside"),
        (lambda p: {**p, "ids": torch.tensor([0, -2, -1, 1])}, "slot id -2"),
        (lambda p: {**p, "ids": torch.tensor([0, 1])}, "at least T = 4"),
        (lambda p: {**p, "starts": [0, 10, 40]}, "slice_starts must be L \\+ 1 column offsets"),
        (lambda p: {**p, "starts": [0, 20, 10, 32]}, "slice_starts must increase"),
        (lambda p: {**p, "starts": [0, 10, 20, 32]}, "lora_a has 16 rows per slot"),
        (lambda p: {**p, "a": p["a"][:, :, :8]}, "lora_a must be \\[S, L\\*R, K\\]"),
        (lambda p: {**p, "b": p["b"][:2]}, "lora_b must be \\[S, N, R\\]"),
        (lambda p: {**p, "x": p["x"].double()}, "must be float32 CPU tensors"),
        (lambda p: {**p, "isa": 9}, "isa 9 is not built here"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_written(change, message):
    starts = [0, 16, 32]
    y, x, a, b, _ = _problem(4, 12, starts, 8, slots=3, seed=8)
    p = change(
        {"y": y.clone(), "x": x, "a": a, "b": b, "ids": torch.tensor([0, 1, -1, 2]), "starts": starts, "isa": -1}
    )
    with pytest.raises(RuntimeError, match=message):
        torch.ops.aiolm.lora_apply_(p["y"], p["x"], p["a"], p["b"], p["ids"], p["starts"], p["isa"])
    assert torch.equal(p["y"], y)


@pytest.mark.parametrize("isa", sorted(isa_builds.ISA_BUILDS))
def test_builds_without_avx512_match_the_loop(isa, isa_runs):
    """The #if guards: an AVX2-only build and a baseline x86-64 build (scalar alone) give the
    same sums, as an AVX2-only or older CPU's own build would."""
    isa_builds.check_build_flags(isa)
    isa_runs.check("lora", isa)  # isa_builds.SUITES["lora"]
