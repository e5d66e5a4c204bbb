"""aiolm::write_kv_, the CPU backend's one call that stores a step's K and V in their
cache slots, against the torch reference (index_copy_ per half)."""

from __future__ import annotations

import pytest
import torch

from aiolm.attention.torch_backend import kv_cache_shape, write_kv
from aiolm.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ compiler for the CPU kernels")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_writes_what_index_copy_writes_from_views_of_the_qkv_projection(dtype):
    g = torch.Generator().manual_seed(0)
    blocks, bs, hk, d, tokens = 6, 4, 3, 64, 7
    qkv = torch.randn(tokens, (2 + 2 * hk) * d, generator=g) * 3  # q of 2 heads, then k, then v
    qkv[1] *= 3e4  # past float16's range: inf, as Tensor.to gives
    qkv[2] *= 1e-6  # float16's subnormals
    qkv[3, ::7] = float("nan")
    k = qkv[:, 2 * d : (2 + hk) * d].reshape(tokens, hk, d)  # views with the projection's row stride
    v = qkv[:, (2 + hk) * d :].reshape(tokens, hk, d)
    slots = torch.randperm(blocks * bs, generator=g)[:tokens]
    ref = torch.randn(kv_cache_shape(blocks, bs, hk, d), generator=g).to(dtype)
    got = ref.clone()
    write_kv(ref, k, v, slots)
    torch.ops.aiolm.write_kv_(got, k, v, slots)
    # float16: rounded to nearest even, as Tensor.to rounds (NaN where NaN: no equal compares them)
    assert torch.equal(got.nan_to_num(0.5), ref.nan_to_num(0.5)) and torch.equal(got.isnan(), ref.isnan())


def test_padding_rows_are_skipped_and_bad_slots_rejected():
    cache = torch.zeros(kv_cache_shape(2, 4, 1, 8))
    k, v = torch.ones(3, 1, 8), torch.full((3, 1, 8), 2.0)
    torch.ops.aiolm.write_kv_(cache, k, v, torch.tensor([5, -1, 0]))
    assert cache[0].view(8, 8)[[0, 5]].eq(1).all() and cache[1].view(8, 8)[[0, 5]].eq(2).all()
    assert cache.ne(0).sum() == 4 * 8  # two slots of K and V, nothing for the padding row
    with pytest.raises(RuntimeError, match="slot 8 is past the cache's 8 slots"):
        torch.ops.aiolm.write_kv_(cache, k, v, torch.tensor([0, 1, 8]))
    with pytest.raises(RuntimeError, match="slot_mapping must be int64"):
        torch.ops.aiolm.write_kv_(cache, k, v, torch.tensor([0, 1, 2], dtype=torch.int32))
