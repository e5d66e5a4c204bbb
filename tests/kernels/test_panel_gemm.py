"""aiolm::panel_linear (the float32 CPU GEMM) against a float64 matmul, and the layers using it."""

from __future__ import annotations

import isa_builds
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


@pytest.mark.parametrize("rows", [1, 5, 13, 129, 301])
@pytest.mark.parametrize("out_features", [64, 40, 5])
def test_bias_and_gelu_are_applied_to_each_tile_as_it_is_written(rows, out_features):
    """The bias gives the bits of adding it after the product; the exact GELU (one erf
    approximation for every ISA and part tile) is within float32 rounding of float64's."""
    g = torch.Generator().manual_seed(rows + out_features)
    w, b = torch.randn(out_features, 72, generator=g) / 4, torch.randn(out_features, generator=g)
    x = torch.randn(rows, 72, generator=g)
    plain = torch.ops.aiolm.panel_linear(x, to_panels(w), out_features)
    biased = torch.ops.aiolm.panel_linear(x, to_panels(w), out_features, b)
    assert torch.equal(biased, plain + b)
    got = torch.ops.aiolm.panel_linear(x, to_panels(w), out_features, b, "gelu")
    want = torch.nn.functional.gelu(biased.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_gelu_keeps_its_negative_tail():
    """1 + erf(z) is never formed as 1 plus a number near -1: below zero the GELU keeps
    most of its relative precision, where torch's float32 GELU loses it."""
    x = torch.linspace(-9, 9, 4001).unsqueeze(1)
    got = torch.ops.aiolm.panel_linear(x, to_panels(torch.ones(1, 1)), 1, None, "gelu").squeeze(1).double()
    xd = x.squeeze(1).double()
    want = xd * torch.special.erfc(-xd / 2**0.5) / 2  # erfc: no cancellation in the reference either
    assert float((got - want).abs().max()) < 1e-6
    rel = (got - want).abs() / want.abs()
    assert float(rel[xd > -2].max()) < 1e-5
    assert float(rel[(xd > -4) & (xd <= -2)].max()) < 1e-3  # torch's float32 GELU: 3e-3
    assert float(rel[xd <= -4].max()) < 2e-2  # torch's: 1.0 (it gives 0)
    with pytest.raises(RuntimeError, match="act must be 'none' or 'gelu'"):
        torch.ops.aiolm.panel_linear(x, to_panels(torch.ones(1, 1)), 1, None, "tanh")


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


@pytest.mark.parametrize(
    "matmul_dtype,hand_over", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)]
)
@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh", "quick_gelu"])
def test_a_linear_layer_applies_its_activation_in_the_kernel_where_it_can(matmul_dtype, hand_over, act):
    """ColumnParallelLinear(x, activation=...) equals the activation applied after it, on
    every packed layout: inside the kernel where that kernel has the activation (exact GELU
    in the float32 panels; GELU, either form, in oneDNN's bfloat16 matmul when its y is
    handed over in bfloat16), after it otherwise."""
    from aiolm.attention.torch_backend import TorchAttention
    from aiolm.distributed.parallel_state import TPGroup
    from aiolm.kernels.cpu_ops import CpuKernelOps
    from aiolm.model.layers.activation import ACTIVATIONS
    from aiolm.model.layers.context import BuildContext
    from aiolm.model.layers.linear import ColumnParallelLinear
    from aiolm.platforms.cpu import bfloat16_matmuls
    from aiolm.quant import quant_config

    if matmul_dtype == torch.bfloat16 and not bfloat16_matmuls():
        pytest.skip("this CPU has no bfloat16 matmuls")
    quant = quant_config("cpu_packed", matmul_dtype=matmul_dtype, hand_over_bf16=hand_over)
    ctx = BuildContext(ops=CpuKernelOps(), attention_backend=TorchAttention, quant=quant, tp_group=TPGroup())
    layer = ColumnParallelLinear(ctx, 96, [160], bias=True)
    g = torch.Generator().manual_seed(7)
    w = torch.randn(160, 96, generator=g) / 8
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(torch.randn(160, generator=g) * 20)  # large, as Qwen2's k bias
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(37, 96, generator=g)
    fused = {"gelu"} if matmul_dtype == torch.float32 else {"gelu", "gelu_pytorch_tanh"} if hand_over else set()
    assert layer.quant_method.fuses(layer, act) == (act in fused)
    got, plain = layer(x, activation=act), layer(x)
    assert got.dtype == plain.dtype == (torch.bfloat16 if hand_over else torch.float32)
    if matmul_dtype == torch.float32:
        torch.testing.assert_close(got, ACTIVATIONS[act](plain), rtol=1e-5, atol=1e-5)
        return
    # bfloat16: against the product of the bfloat16-rounded operands, in float64
    exact = x.bfloat16().double() @ w.bfloat16().double().t() + layer.bias.double()
    if not hand_over:  # y rounded to bfloat16, the bias added after it in float32: no bias-sized steps
        assert float((plain.double() - exact).abs().max()) < 0.05  # bfloat16's step at 20-32: 0.125
    torch.testing.assert_close(got.double(), ACTIVATIONS[act](exact).to(got.dtype).double(), rtol=2e-2, atol=0.13)


@pytest.mark.slow
@pytest.mark.parametrize("isa", list(isa_builds.ISA_BUILDS))
def test_other_isa_builds_match_the_references(isa, isa_runs):
    """The panel GEMM's AVX2 and scalar paths with their bias and GELU epilogue, and the
    fused add + LayerNorm, on builds this CPU's own does not reach."""
    isa_builds.check_build_flags(isa)
    isa_runs.check("panel", isa)  # isa_builds.SUITES["panel"]
