"""aiolm::apply_token_bitmask_ masks exactly what xgrammar's own CPU kernel masks."""

from __future__ import annotations

import pytest
import torch

from aiolm.kernels import cpu as cpu_kernels
from aiolm.kernels.sampling_ops import apply_token_bitmask_

xgr = pytest.importorskip("xgrammar")
pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels unavailable")


def _bitmask(rows: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    words = (vocab + 31) // 32
    bm = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=g)
    bm[:, ::3] = -1  # whole words allowed (skipped by the kernel)
    bm[:, 1::7] = 0  # whole words forbidden
    return bm


@pytest.mark.parametrize("vocab", [32, 49152, 1000, 77])
@pytest.mark.parametrize("indices", [None, [1], [0, 3, 4]])
def test_matches_xgrammar(vocab, indices):
    g = torch.Generator().manual_seed(vocab)
    bm = _bitmask(5, vocab, g)
    base = torch.randn(5, vocab + 9, generator=g)[:, :vocab]  # dense rows, padded stride
    ours, ref = base.clone(), base.clone()
    torch.ops.aiolm.apply_token_bitmask_(ours, bm, indices or [])
    xgr.apply_token_bitmask_inplace(ref, bm, vocab_size=vocab, indices=indices, backend="cpu")
    assert torch.equal(ours, ref)
    untouched = [r for r in range(5) if indices is not None and r not in indices]
    assert torch.equal(ours[untouched], base[untouched])


def test_columns_past_the_bitmask_are_left_alone_and_no_rows_means_nothing():
    g = torch.Generator().manual_seed(1)
    bm = torch.zeros(2, 1, dtype=torch.int32)  # 32 tokens, all forbidden
    x = torch.randn(2, 40, generator=g)
    y = x.clone()
    apply_token_bitmask_(y, bm, [])
    assert torch.equal(y, x)
    apply_token_bitmask_(y, bm)
    assert torch.isinf(y[:, :32]).all() and torch.equal(y[:, 32:], x[:, 32:])
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.aiolm.apply_token_bitmask_(torch.zeros(2, 32), torch.zeros(2, 1, dtype=torch.int32), [2])
