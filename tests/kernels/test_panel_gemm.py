"""aiolm::panel_linear (the float32 CPU GEMM) against a float64 matmul, and the layers using it."""

from __future__ import annotations

import pytest
import torch

from aiolm.kernels import cpu as cpu_kernels
from aiolm.quant.cpu_packed import pack_weight, to_panels

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ compiler for the CPU kernels")


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().t()).float()


# rows: every micro-kernel height (1-6 with AVX2, 1-12 with AVX-512), partial tiles, and both
# sides of the 128-row packing switch; outputs: whole panels and pairs of panels (64), an odd
# panel after whole pairs (48), a partial last panel alone (40) or in a pair (24), fewer
# columns than one panel (5)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 9, 11, 12, 13, 64, 128, 129, 301])
@pytest.mark.parametrize("out_features", [64, 48, 40, 24, 5])
def test_matches_float64_matmul(rows, out_features):
    g = torch.Generator().manual_seed(rows * 100 + out_features)
    w = torch.randn(out_features, 72, generator=g)
    x = torch.randn(rows, 72, generator=g)
    got = torch.ops.aiolm.panel_linear(x, to_panels(w), out_features)
    want = _reference(x, w)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_packed_weight_keeps_leading_dims_adds_bias_and_reads_strided_input():
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(20, 32, generator=g), torch.randn(20, generator=g)
    packed = pack_weight(w)
    assert packed is not None and packed.panels
    x = torch.randn(2, 3, 64, generator=g)[..., ::2]  # not contiguous
    got = packed(x, b)
    assert got.shape == (2, 3, 20)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_rejects_mismatched_shapes():
    p = to_panels(torch.randn(20, 32))
    with pytest.raises(RuntimeError, match="x has 16 features, W has 32"):
        torch.ops.aiolm.panel_linear(torch.zeros(1, 16), p, 20)
    with pytest.raises(RuntimeError, match="2 panels cannot hold 40 columns"):
        torch.ops.aiolm.panel_linear(torch.zeros(1, 32), p, 40)
    with pytest.raises(RuntimeError, match="float32 only"):
        torch.ops.aiolm.panel_linear(torch.zeros(1, 32, dtype=torch.float64), p, 20)
    assert torch.ops.aiolm.panel_linear(torch.zeros(0, 32), p, 20).shape == (0, 20)


def test_each_shape_is_probed_once_and_every_weight_still_multiplies_right():
    """The probe against F.linear runs once per shape and layout in a process (a model's
    linears share a few shapes); every weight of a probed shape is still packed and right."""
    from aiolm.quant import cpu_packed

    g = torch.Generator().manual_seed(3)
    shapes = [(40, 24), (40, 24), (40, 24), (33, 24), (33, 24)]
    before = set(cpu_packed._PROBED)
    x = torch.randn(5, 24, generator=g)
    for n, k in shapes:
        w = torch.randn(n, k, generator=g)
        packed = pack_weight(w)
        assert packed is not None and packed.panels
        torch.testing.assert_close(packed(x), torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-5)
    new = {key[0] for key in set(cpu_packed._PROBED) - before}
    assert new <= {(40, 24), (33, 24)}
    assert cpu_packed._PROBED[((40, 24), torch.float32, True, torch.float32)]
