"""aiolm::argmax_rows gives torch.argmax's indices, edge cases included."""

from __future__ import annotations

import pytest
import torch

from aiolm.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ compiler for the CPU kernels")


@pytest.mark.parametrize("n", [1, 15, 16, 17, 49152])
def test_matches_torch_argmax(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(37, n, generator=g)
    x[1] = 0.0  # all equal: the first
    x[2, n // 2 :] = float("inf")  # the first +inf
    x[3] = float("-inf")  # all -inf: index 0
    x[4, n - 1] = float("nan")  # a NaN wins
    x[5, :] = float("nan")
    x[6] = x[6].round()  # ties between the largest rounded values
    x[7, n // 3] = 1e30  # the maximum in the scalar tail or the vector body
    x[8, 0] = -0.0
    x[8, 1:] = -1.0
    assert torch.equal(torch.ops.aiolm.argmax_rows(x), x.argmax(dim=-1))
    strided = torch.randn(5, 2 * n, generator=g)[:, ::2]  # rows not dense: refused
    with pytest.raises(RuntimeError, match="dense rows"):
        torch.ops.aiolm.argmax_rows(strided)
