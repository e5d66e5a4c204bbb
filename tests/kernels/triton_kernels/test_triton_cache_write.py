"""The KV-cache write kernel against index_copy_, padding slots (-1) skipped."""

from __future__ import annotations

import pytest
import torch
from triton_cases import assert_same_rounding


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kv_heads,head_dim,block_size", [(1, 64, 16), (3, 128, 32), (2, 256, 16), (3, 80, 16)])
def test_write_matches_index_copy(dtype, kv_heads, head_dim, block_size, device):
    """k and v are strided views of one fused qkv row, as the model hands them over;
    the slots cover a page's first and last offset and one -1 padding row."""
    from aiolm.kernels.triton.cache import write_kv

    g = torch.Generator().manual_seed(kv_heads * head_dim)
    heads = 2 * kv_heads
    num_blocks = 6
    slots = torch.tensor(
        [0 * block_size + 0, 3 * block_size + block_size - 1, -1, 5 * block_size + 7, 1 * block_size + 1]
    )
    t = slots.numel()
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g, dtype=torch.float32)
    _, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    k = k.view(t, kv_heads, head_dim)
    v = v.view(t, kv_heads, head_dim)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    want = cache.clone()
    real = slots >= 0
    flat = want.view(2, num_blocks * block_size, kv_heads, head_dim)
    flat[0].index_copy_(0, slots[real], k[real].to(dtype))
    flat[1].index_copy_(0, slots[real], v[real].to(dtype))

    got = cache.to(device)
    write_kv(got, k.to(device), v.to(device), slots.to(device=device, dtype=torch.int32))
    assert_same_rounding(got.cpu(), want)


def test_all_padding_writes_nothing(device):
    from aiolm.kernels.triton.cache import write_kv

    cache = torch.randn(2, 3, 16, 2, 64).to(device)
    before = cache.clone()
    k = torch.randn(4, 2, 64, device=device)
    write_kv(cache, k, k, torch.full((4,), -1, dtype=torch.int64, device=device))
    assert torch.equal(cache, before)


def test_kernels_were_built_for_the_device(device):
    """triton picks interpreter or compiler when @triton.jit runs, at the kernel module's
    import; conftest.py sets TRITON_INTERPRET before that, and this checks it took."""
    from triton.runtime.interpreter import InterpretedFunction

    from aiolm.kernels.triton import attention, cache

    for kernel in (cache._write_kv_kernel, attention._attention_kernel, attention._reduce_kernel):
        assert isinstance(kernel, InterpretedFunction) == (device == "cpu")


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_fp8_write_rounds_saturates_and_scales_as_torch(scale, device):
    """An fp8 cache gets k / scale rounded to nearest e4m3, values past 448 saturated (a plain
    cast would store NaN), the same bytes as the torch backend writes; -1 slots skipped."""
    from aiolm.attention.torch_backend import write_kv as torch_write_kv
    from aiolm.kernels.triton.cache import write_kv

    g = torch.Generator().manual_seed(3)
    slots = torch.tensor([0, 17, -1, 40])
    k = torch.randn(4, 2, 64, generator=g) * 300  # some past 448 * scale
    v = torch.randn(4, 2, 64, generator=g)
    want = torch.zeros(2, 4, 16, 2, 64, dtype=torch.float8_e4m3fn)
    real = slots >= 0
    torch_write_kv(want, k[real], v[real], slots[real], scale, scale)
    got = torch.zeros_like(want).to(device)
    write_kv(got, k.to(device), v.to(device), slots.to(device=device, dtype=torch.int32), scale, scale)
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
    assert not want.float().isnan().any()
    assert want.float().abs().max() == 448
