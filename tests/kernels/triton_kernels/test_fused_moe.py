"""The fused MoE kernels against a per-expert torch loop, and the sorting that feeds them.

Under the interpreter (CPU) and compiled on a GPU alike (``device`` from the conftest).
Tolerances: float32 1e-4 relative to the output's largest value (both sides accumulate in
float32, only the summation order differs); float16 3e-3 and bfloat16 2e-2, because the
kernel rounds the activated intermediate to x's dtype before the down projection (as an
engine does) while the reference keeps it in float32: about one rounding step of the dtype.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def reference_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """float32, one expert at a time: gather its tokens, run its gated MLP, add weighted rows."""
    x, w13, w2 = x.float().cpu(), w13.float().cpu(), w2.float().cpu()
    ids, weights = topk_ids.long().cpu(), topk_weights.float().cpu()
    inter = w13.shape[1] // 2
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        rows, slots = (ids == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        h = x[rows] @ w13[e].T
        act = F.silu(h[:, :inter]) * h[:, inter:]
        out.index_add_(0, rows, weights[rows, slots, None] * (act @ w2[e].T))
    return out


def make_moe(t: int, h: int, inter: int, e: int, k: int, dtype: torch.dtype, seed: int = 0):
    """Random x and weights (scaled so outputs are O(1)), and a router's choice: the top k of
    random logits per token (distinct experts), softmax weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * inter, h, generator=g) / math.sqrt(h)
    w2 = torch.randn(e, h, inter, generator=g) / math.sqrt(inter)
    logits = torch.randn(t, e, generator=g)
    topk_weights, topk_ids = logits.softmax(-1).topk(k, dim=-1)
    return x.to(dtype), w13.to(dtype), w2.to(dtype), topk_weights, topk_ids.to(torch.int32)


def assert_moe_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype
    tol = TOL[dtype]
    scale = max(want.abs().max().item(), 1e-6)
    torch.testing.assert_close(got.float().cpu(), want, atol=tol * scale, rtol=tol)


def run(device, x, w13, w2, topk_weights, topk_ids, **kw) -> torch.Tensor:
    from aiolm.kernels.triton.moe import fused_moe_tiled

    on = [a.to(device) for a in (x, w13, w2, topk_weights, topk_ids)]
    return fused_moe_tiled(*on, **kw)


# (T, H, I, E, k, block_m, dtype, ids dtype): H and I mostly not multiples of the tiles
CASES = [
    pytest.param(1, 48, 32, 4, 1, 16, torch.float32, torch.int32, id="decode-k1"),
    pytest.param(1, 40, 24, 8, 8, 16, torch.float32, torch.int64, id="decode-k8-every-expert"),
    pytest.param(40, 40, 24, 4, 2, 16, torch.float32, torch.int32, id="T>block_m-k2-ragged"),
    pytest.param(20, 72, 40, 6, 4, 32, torch.float32, torch.int64, id="k4-bm32-two-n-tiles"),
    pytest.param(9, 33, 17, 16, 8, 64, torch.float32, torch.int32, id="k8-bm64-odd-dims"),
    pytest.param(70, 24, 16, 2, 1, 64, torch.float32, torch.int32, id="T>bm64-two-blocks-per-expert"),
    pytest.param(24, 40, 24, 4, 2, 16, torch.bfloat16, torch.int32, id="bf16-k2"),
    pytest.param(12, 40, 24, 8, 4, 32, torch.bfloat16, torch.int64, id="bf16-k4-bm32"),
    pytest.param(24, 40, 24, 4, 2, 16, torch.float16, torch.int32, id="fp16-k2"),
    pytest.param(5, 56, 40, 8, 8, 16, torch.float16, torch.int64, id="fp16-k8"),
]


@pytest.mark.parametrize("t,h,inter,e,k,block_m,dtype,ids_dtype", CASES)
def test_fused_moe_matches_reference(device, t, h, inter, e, k, block_m, dtype, ids_dtype):
    x, w13, w2, tw, ti = make_moe(t, h, inter, e, k, dtype)
    got = run(device, x, w13, w2, tw, ti.to(ids_dtype), block_m=block_m)
    assert got.shape == (t, h)
    assert_moe_close(got, reference_moe(x, w13, w2, tw, ti), dtype)


@pytest.mark.parametrize("block_n,block_k", [(16, 16), (32, 16)])
def test_small_tiles_many_n_tiles_and_k_steps(device, block_n, block_k):
    """Tiles smaller than H and I: several output tiles per block and several K steps, each
    with a last K step of one column (H = 49, I = 33), in both kernels."""
    x, w13, w2, tw, ti = make_moe(18, 49, 33, 4, 2, torch.float32, seed=1)
    got = run(device, x, w13, w2, tw, ti, block_m=16, block_n=block_n, block_k=block_k)
    assert_moe_close(got, reference_moe(x, w13, w2, tw, ti), torch.float32)


def test_experts_without_tokens(device):
    """Only experts 1 and 5 of 8 are chosen: the others get no block and add nothing."""
    x, w13, w2, tw, _ = make_moe(6, 40, 24, 8, 2, torch.float32, seed=2)
    ti = torch.tensor([[1, 5], [5, 1]] * 3, dtype=torch.int32)
    got = run(device, x, w13, w2, tw, ti, block_m=16)
    assert_moe_close(got, reference_moe(x, w13, w2, tw, ti), torch.float32)


@pytest.mark.parametrize("block_m", [16, 32])
def test_one_expert_takes_every_token(device, block_m):
    """All 70 tokens on expert 3: its run spans several blocks, the last one part padding."""
    x, w13, w2, tw, _ = make_moe(70, 24, 16, 4, 1, torch.float32, seed=3)
    ti = torch.full((70, 1), 3, dtype=torch.int32)
    got = run(device, x, w13, w2, tw, ti, block_m=block_m)
    assert_moe_close(got, reference_moe(x, w13, w2, tw, ti), torch.float32)


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_remote_experts_contribute_nothing(device, ids_dtype):
    """-1 (an expert on another rank) adds nothing: the same as a routing weight of zero."""
    x, w13, w2, tw, ti = make_moe(10, 40, 24, 4, 2, torch.float32, seed=4)
    remote = torch.zeros_like(ti, dtype=torch.bool)
    remote[::3, 0] = True
    remote[1, :] = True  # a token with every expert remote gives zeros
    got = run(device, x, w13, w2, tw, torch.where(remote, -1, ti).to(ids_dtype), block_m=16)
    zero_weight = run(device, x, w13, w2, torch.where(remote, 0.0, tw), ti, block_m=16)
    assert_moe_close(got, zero_weight.cpu(), torch.float32)
    assert torch.equal(got[1].cpu(), torch.zeros(40))
    all_remote = run(device, x, w13, w2, tw, torch.full_like(ti, -1), block_m=16)
    assert torch.equal(all_remote.cpu(), torch.zeros(10, 40))


def test_public_entry_default_block_m(device):
    """fused_moe with the default tiles (block_m chosen from T) on a prefill-sized batch."""
    from aiolm.kernels.triton.moe import default_block_m, fused_moe

    assert [default_block_m(t, 2, 8) for t in (1, 64, 65, 256, 257)] == [16, 16, 32, 32, 64]
    x, w13, w2, tw, ti = make_moe(40, 72, 40, 2, 2, torch.float32, seed=5)
    got = fused_moe(x.to(device), w13.to(device), w2.to(device), tw.to(device), ti.to(device))
    assert_moe_close(got, reference_moe(x, w13, w2, tw, ti), torch.float32)


def test_rejects_bad_shapes_and_tiles():
    from aiolm.kernels.triton.moe import fused_moe, fused_moe_tiled

    x, w13, w2, tw, ti = make_moe(2, 40, 24, 4, 2, torch.float32)
    with pytest.raises(ValueError, match="block_m"):
        fused_moe(x, w13, w2, tw, ti, block_m=8)
    with pytest.raises(ValueError, match="block_k"):
        fused_moe_tiled(x, w13, w2, tw, ti, block_k=24)
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe(x, w13, w2[:, :, :10], tw, ti)
    with pytest.raises(ValueError, match="dtype"):
        fused_moe(x, w13.half(), w2, tw, ti)
    assert fused_moe(x[:0], w13, w2, tw[:0], ti[:0]).shape == (0, 40)


# --- moe_align_block_size ------------------------------------------------------------------


def check_alignment(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    """The invariants the kernels rely on, checked one by one against the plain definition."""
    from aiolm.kernels.triton.moe import moe_align_block_size

    sorted_ids, expert_ids, num_padded = moe_align_block_size(topk_ids, num_experts, block_m)
    assert sorted_ids.dtype == expert_ids.dtype == num_padded.dtype == torch.int32
    sorted_ids, expert_ids, np_ = sorted_ids.cpu(), expert_ids.cpu(), int(num_padded.item())
    flat = topk_ids.reshape(-1).long().cpu()
    n = flat.numel()
    sentinel = n
    assert sorted_ids.numel() % block_m == 0 and expert_ids.numel() == sorted_ids.numel() // block_m
    # the size depends on shapes only (no host read of the routing): here, its bound
    assert sorted_ids.numel() >= n + min(num_experts, n) * (block_m - 1)

    counts = [int((flat == e).sum()) for e in range(num_experts)]
    assert np_ == sum(math.ceil(c / block_m) * block_m for c in counts)
    # past num_padded: sentinels only, and no expert
    assert torch.all(sorted_ids[np_:] == sentinel)
    assert torch.all(expert_ids[np_ // block_m :] == -1)

    # every valid pair once, no invalid one
    real = sorted_ids[sorted_ids != sentinel]
    valid = ((flat >= 0) & (flat < num_experts)).nonzero().flatten()
    assert sorted(real.tolist()) == valid.tolist()

    # block by block: expert ids ascend, each expert's pairs sit in its blocks, padding at the run's end
    blocks = sorted_ids[:np_].view(-1, block_m)
    experts = expert_ids[: np_ // block_m].tolist()
    assert experts == sorted(experts)
    for e in range(num_experts):
        mine = [b for b, be in enumerate(experts) if be == e]
        assert len(mine) == math.ceil(counts[e] / block_m)
        run = blocks[mine].flatten() if mine else torch.empty(0, dtype=torch.int32)
        assert run[: counts[e]].tolist() == (flat == e).nonzero().flatten().tolist()
        assert torch.all(run[counts[e] :] == sentinel)


@pytest.mark.parametrize(
    "t,k,e,block_m",
    [(1, 1, 4, 16), (1, 8, 8, 16), (37, 2, 8, 16), (37, 4, 6, 32), (100, 8, 16, 64), (3, 2, 64, 64)],
)
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_align_invariants(device, t, k, e, block_m, ids_dtype):
    g = torch.Generator().manual_seed(t * 31 + e)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    ids[torch.rand(t, k, generator=g) < 0.2] = -1  # some on another rank
    check_alignment(ids.to(ids_dtype).to(device), e, block_m)


def test_align_drops_out_of_range_and_pads_to_the_bound(device):
    """ids >= E are dropped like -1; with every expert holding block_m + 1 pairs the padding
    reaches its bound and the buffers are exactly full."""
    from aiolm.kernels.triton.moe import moe_align_block_size

    check_alignment(torch.tensor([[0, 4], [7, -1], [3, 2]], device=device), 4, 16)
    e, block_m = 3, 16
    ids = torch.arange(e).repeat_interleave(block_m + 1).view(-1, 1).to(device)
    sorted_ids, _, num_padded = moe_align_block_size(ids, e, block_m)
    assert int(num_padded.item()) == e * 2 * block_m
    check_alignment(ids, e, block_m)
