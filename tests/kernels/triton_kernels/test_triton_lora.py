"""The batched LoRA kernels (shrink + expand) against ``lora_reference``.

Under the interpreter (CPU) and compiled on a GPU alike (``device`` from the conftest).
Tolerances are relative to the result's largest value: float32 1e-5 (both sides accumulate in
float32, only the summation order differs); float16 2e-3 and bfloat16 1.6e-2, because both
sides round the delta to the dtype before adding it to y, and a float32 delta that differs in
its last bits can round one step apart, and the sum with y one more.
"""

from __future__ import annotations

import math

import pytest
import torch

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def starts_of(widths: list[int]) -> list[int]:
    out = [0]
    for w in widths:
        out.append(out[-1] + w)
    return out


def make_lora(t: int, k: int, widths: list[int], slots: int, rank: int, dtype: torch.dtype, seed: int = 0):
    """x, a non-zero y, and S adapters for len(widths) slices, scaled so each delta is O(1)."""
    g = torch.Generator().manual_seed(seed)
    n, nslices = sum(widths), len(widths)
    x = torch.randn(t, k, generator=g)
    y = torch.randn(t, n, generator=g)
    lora_a = torch.randn(slots, nslices * rank, k, generator=g) / math.sqrt(k)
    lora_b = torch.randn(slots, n, rank, generator=g) / math.sqrt(rank)
    return x.to(dtype), y.to(dtype), lora_a.to(dtype), lora_b.to(dtype)


def random_slots(t: int, slots: int, seed: int = 0, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """Each row on a random slot or on none (-1)."""
    g = torch.Generator().manual_seed(seed + 1000)
    return torch.randint(-1, slots, (t,), generator=g).to(dtype)


def run(device, y, x, lora_a, lora_b, slot_ids, starts) -> torch.Tensor:
    """lora_apply on copies on ``device``; the updated y, back on the CPU."""
    from aiolm.kernels.triton.lora import lora_apply

    y_dev = y.clone().to(device)
    lora_apply(y_dev, x.to(device), lora_a.to(device), lora_b.to(device), slot_ids.to(device), starts)
    return y_dev.cpu()


def reference(y, x, lora_a, lora_b, slot_ids, starts) -> torch.Tensor:
    from aiolm.kernels.lora_reference import lora_reference

    want = y.clone()
    lora_reference(want, x, lora_a, lora_b, slot_ids, starts)
    return want


def assert_lora_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = TOL[want.dtype]
    scale = max(want.float().abs().max().item(), 1e-6)
    torch.testing.assert_close(got.float(), want.float(), atol=tol * scale, rtol=0)


# (T, K, slice widths, S, R, dtype, slot ids dtype): K and N mostly not powers of two
CASES = [
    pytest.param(6, 40, [24], 3, 8, torch.float32, torch.int32, id="r8-one-slice"),
    pytest.param(7, 33, [32, 16, 16], 4, 16, torch.float32, torch.int64, id="r16-qkv-32-16-16"),
    pytest.param(5, 50, [40, 40], 2, 64, torch.float32, torch.int32, id="r64-gate-up"),
    pytest.param(4, 70, [37, 13, 13], 3, 64, torch.float32, torch.int64, id="r64-qkv-odd-widths"),
    pytest.param(6, 29, [20, 9, 11], 3, 12, torch.float32, torch.int32, id="r12-not-a-power-of-two"),
    pytest.param(5, 19, [7, 5], 2, 1, torch.float32, torch.int32, id="r1"),
    pytest.param(3, 600, [300, 44], 2, 16, torch.float32, torch.int32, id="k-blocks-and-n-blocks"),
    pytest.param(7, 33, [32, 16, 16], 4, 16, torch.float16, torch.int32, id="fp16-r16-qkv"),
    pytest.param(5, 50, [40, 24], 3, 64, torch.float16, torch.int64, id="fp16-r64-gate-up"),
    pytest.param(7, 33, [32, 16, 16], 4, 16, torch.bfloat16, torch.int32, id="bf16-r16-qkv"),
    pytest.param(6, 45, [27], 2, 8, torch.bfloat16, torch.int64, id="bf16-r8-one-slice"),
]


@pytest.mark.parametrize("t,k,widths,slots,rank,dtype,ids_dtype", CASES)
def test_matches_reference(device, t, k, widths, slots, rank, dtype, ids_dtype):
    x, y, a, b = make_lora(t, k, widths, slots, rank, dtype, seed=t + k)
    ids = random_slots(t, slots, seed=k, dtype=ids_dtype)
    starts = starts_of(widths)
    got = run(device, y, x, a, b, ids, starts)
    assert_lora_close(got, reference(y, x, a, b, ids, starts))


@pytest.mark.parametrize("t", [1, 48], ids=["decode-T1", "prefill-T48"])
def test_batch_sizes(device, t):
    """One decode row, and a batch large enough that every slot has several rows."""
    widths = [32, 16, 16]
    x, y, a, b = make_lora(t, 40, widths, 3, 16, torch.float32, seed=t)
    ids = torch.tensor([1], dtype=torch.int32) if t == 1 else random_slots(t, 3, seed=t)
    got = run(device, y, x, a, b, ids, starts_of(widths))
    assert_lora_close(got, reference(y, x, a, b, ids, starts_of(widths)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rows_without_adapter_leave_y_bit_identical(device, dtype):
    """Every slot -1: y comes back bit for bit, though the adapters are NaN."""
    widths = [24, 8]
    x, y, a, b = make_lora(5, 40, widths, 2, 8, dtype)
    a.fill_(float("nan"))
    b.fill_(float("nan"))
    got = run(device, y, x, a, b, torch.full((5,), -1, dtype=torch.int32), starts_of(widths))
    assert torch.equal(got, y)


def test_empty_slot_and_single_row_slot(device):
    """Slots 1 and 3 have no rows (their NaN weights are never read), slot 2 exactly one."""
    widths = [32, 16, 16]
    x, y, a, b = make_lora(6, 40, widths, 4, 16, torch.float32, seed=3)
    for s in (1, 3):
        a[s].fill_(float("nan"))
        b[s].fill_(float("nan"))
    ids = torch.tensor([0, 0, 2, 0, -1, 0], dtype=torch.int32)
    got = run(device, y, x, a, b, ids, starts_of(widths))
    assert not got.isnan().any()
    assert torch.equal(got[4], y[4])
    assert_lora_close(got, reference(y, x, a, b, ids, starts_of(widths)))


def test_every_row_its_own_slot(device):
    widths = [16, 24]
    x, y, a, b = make_lora(8, 36, widths, 8, 8, torch.float32, seed=4)
    ids = torch.randperm(8, generator=torch.Generator().manual_seed(4)).to(torch.int64)
    got = run(device, y, x, a, b, ids, starts_of(widths))
    assert_lora_close(got, reference(y, x, a, b, ids, starts_of(widths)))


def test_slot_buffer_longer_than_batch(device):
    """A static slot buffer of 16 for a batch of 5 (x and y views of 16-row buffers): the
    entries past T name real slots, and the rows past T must still be left alone."""
    from aiolm.kernels.triton.lora import lora_apply

    widths = [20, 12]
    x_full, y_full, a, b = make_lora(16, 30, widths, 3, 8, torch.float32, seed=5)
    ids = torch.tensor([2, -1, 0, 1, 2] + [0, 1, 2] * 3 + [1, 0], dtype=torch.int32)
    t = 5
    want = reference(y_full[:t], x_full[:t], a, b, ids, starts_of(widths))
    y_dev = y_full.clone().to(device)
    lora_apply(y_dev[:t], x_full.to(device)[:t], a.to(device), b.to(device), ids.to(device), starts_of(widths))
    got = y_dev.cpu()
    assert torch.equal(got[t:], y_full[t:])
    assert_lora_close(got[:t], want)


def test_padded_rank_equals_rank_r_product(device):
    """Adapters of rank 4 and 8 padded with zeros to R = 16 add exactly x A_r^T B_r^T per slice."""
    widths = [24, 8]
    starts = starts_of(widths)
    t, k, rank, n = 4, 36, 16, sum(widths)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(t, k, generator=g)
    y = torch.randn(t, n, generator=g)
    a = torch.zeros(2, 2 * rank, k)
    b = torch.zeros(2, n, rank)
    small = {}
    for s, r in enumerate((4, 8)):
        for i in range(2):
            a_r = torch.randn(r, k, generator=g) / math.sqrt(k)
            b_r = torch.randn(widths[i], r, generator=g) / math.sqrt(r)
            a[s, i * rank : i * rank + r] = a_r
            b[s, starts[i] : starts[i + 1], :r] = b_r
            small[s, i] = (a_r.double(), b_r.double())
    ids = torch.tensor([1, 0, -1, 1], dtype=torch.int32)
    want = y.double().clone()
    for row, s in enumerate(ids.tolist()):
        if s < 0:
            continue
        for i in range(2):
            a_r, b_r = small[s, i]
            want[row, starts[i] : starts[i + 1]] += x[row].double() @ a_r.T @ b_r.T
    got = run(device, y, x, a, b, ids, starts)
    assert_lora_close(got, want.float())


def test_accumulates_into_y(device):
    """y is added to, not overwritten: twice applied adds the delta twice."""
    from aiolm.kernels.triton.lora import lora_apply

    widths = [16, 16, 8]
    starts = starts_of(widths)
    x, y, a, b = make_lora(5, 24, widths, 2, 8, torch.float32, seed=7)
    ids = torch.tensor([0, 1, -1, 1, 0], dtype=torch.int32)
    once = reference(y, x, a, b, ids, starts)
    twice = reference(once, x, a, b, ids, starts)
    y_dev = y.clone().to(device)
    args = (x.to(device), a.to(device), b.to(device), ids.to(device), starts)
    lora_apply(y_dev, *args)
    assert_lora_close(y_dev.cpu(), once)
    lora_apply(y_dev, *args)
    assert_lora_close(y_dev.cpu(), twice)
    assert (twice - y).abs().max() > 1e-2  # the delta is far from nothing


def test_strided_operands(device):
    """y a column window of a wider output, x a transposed view, lora_b stored as [S, R, N]."""
    from aiolm.kernels.triton.lora import lora_apply

    widths = [20, 10, 10]
    starts = starts_of(widths)
    x, y, a, b = make_lora(5, 28, widths, 3, 8, torch.float32, seed=8)
    ids = torch.tensor([2, 0, -1, 1, 2], dtype=torch.int64)
    want = reference(y, x, a, b, ids, starts)
    wide = torch.zeros(5, 60)
    wide[:, 7:47] = y
    wide = wide.to(device)
    x_t = x.T.contiguous().to(device).T  # strides (1, T)
    b_t = b.transpose(1, 2).contiguous().to(device).transpose(1, 2)  # strides (N*R, 1, N)
    lora_apply(wide[:, 7:47], x_t, a.to(device), b_t, ids.to(device), starts)
    got = wide.cpu()
    assert_lora_close(got[:, 7:47], want)
    assert torch.equal(got[:, :7], torch.zeros(5, 7)) and torch.equal(got[:, 47:], torch.zeros(5, 13))


def test_empty_batch_is_a_no_op(device):
    from aiolm.kernels.triton.lora import lora_apply

    x, y, a, b = make_lora(0, 16, [8], 2, 8, torch.float32)
    lora_apply(
        y.to(device), x.to(device), a.to(device), b.to(device), torch.zeros(4, dtype=torch.int32, device=device), [0, 8]
    )


def test_rejects_bad_arguments():
    from aiolm.kernels.triton.lora import lora_apply

    x, y, a, b = make_lora(3, 16, [8, 8], 2, 4, torch.float32)
    ids = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="slice_starts"):
        lora_apply(y, x, a, b, ids, [0, 8, 15])
    with pytest.raises(ValueError, match="slice_starts"):
        lora_apply(y, x, a, b, ids, [0, 8, 8, 16])
    with pytest.raises(ValueError, match="do not fit"):
        lora_apply(y, x, a, b, ids, [0, 16])  # lora_a holds 2 slices of R
    with pytest.raises(ValueError, match="entries"):
        lora_apply(y, x, a, b, ids[:2], [0, 8, 16])
    with pytest.raises(ValueError, match="int32 or int64"):
        lora_apply(y, x, a, b, ids.float(), [0, 8, 16])
    with pytest.raises(ValueError, match="dtype"):
        lora_apply(y, x, a.half(), b, ids, [0, 8, 16])


def test_no_host_sync_and_cuda_graph_replay(device):
    """Captured once in a CUDA graph, replayed with other slot ids written into the static
    buffer, it matches the reference each time; an eager call under torch's sync debug mode
    raises on any device-to-host synchronisation."""
    if device != "cuda":
        pytest.skip("CUDA graphs and torch's sync debug mode need a GPU (here: CPU interpreter)")
    from aiolm.kernels.triton.lora import lora_apply

    widths = [32, 16, 16]
    starts = starts_of(widths)
    t, slots = 6, 4
    x, y, a, b = make_lora(t, 40, widths, slots, 16, torch.float32, seed=9)
    xs, ys, as_, bs = (v.to(device) for v in (x, y, a, b))
    ids = torch.full((16,), -1, dtype=torch.int32, device=device)

    ids[:t] = torch.tensor([0, 1, 2, 3, -1, 0], dtype=torch.int32)
    lora_apply(ys.clone(), xs, as_, bs, ids, starts)  # compiles the kernels outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        lora_apply(ys.clone(), xs, as_, bs, ids, starts)
    finally:
        torch.cuda.set_sync_debug_mode("default")

    y_static = ys.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora_apply(y_static, xs, as_, bs, ids, starts)
    for new in ([3, 3, -1, 0, 2, 1], [-1, -1, -1, -1, -1, -1], [2, 0, 1, 1, 3, -1]):
        ids[:t] = torch.tensor(new, dtype=torch.int32)
        y_static.copy_(ys)
        graph.replay()
        torch.cuda.synchronize()
        want = reference(y, x, a, b, torch.tensor(new, dtype=torch.int32), starts)
        assert_lora_close(y_static.cpu(), want)
