"""The Triton GEMMs over quantized weights (aiolm/kernels/triton/quant_gemm.py) against x times
the dequantized weight, and a tiny GPTQ model run through them (the GPU's quant method,
aiolm/quant/triton_quant.py) giving transformers' tokens on the dequantized model."""

from __future__ import annotations

import pytest
import torch

from aiolm.quant.checkpoint_formats import Int4Codes

TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _codes(n: int, k: int, group: int, act_order: bool, seed: int) -> Int4Codes:
    g = torch.Generator().manual_seed(seed)
    size = k if group == -1 else group
    order = torch.randperm(k, generator=g) if act_order else torch.arange(k)
    grp = torch.empty(k, dtype=torch.int64)
    grp[order] = torch.arange(k) // size
    groups = k // size
    return Int4Codes(
        torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
        (torch.rand(n, groups, generator=g) * 0.02 + 0.005).half().float(),
        torch.randint(0, 16, (n, groups), generator=g).float(),
        grp,
    )


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    want = x.float() @ w.t()
    tol = TOL[x.dtype]
    assert got.dtype == x.dtype
    assert got.shape == want.shape
    if want.numel():
        torch.testing.assert_close(got.float().cpu(), want, atol=tol * want.abs().max().item(), rtol=tol)


@pytest.mark.parametrize(
    ("m", "n", "k", "group", "act_order", "dtype"),
    [
        (1, 64, 128, 32, False, torch.float32),  # a decode row
        (7, 96, 256, 128, False, torch.float32),  # N not a multiple of the tile
        (33, 64, 256, 64, True, torch.float32),  # activation order: x gathered by perm
        (5, 128, 128, -1, False, torch.float32),  # one group per column
        (16, 64, 256, 32, True, torch.float16),
        (70, 160, 128, 128, False, torch.float16),  # several row tiles
        (3, 64, 256, 64, False, torch.bfloat16),
        (9, 64, 128, 32, True, torch.bfloat16),
        (0, 64, 128, 32, False, torch.float32),  # an empty step
    ],
)
def test_w4a16_gemm_equals_the_dequantized_weight(m, n, k, group, act_order, dtype, device):
    from aiolm.quant.triton_quant import pack_int4

    c = _codes(n, k, group, act_order, seed=m + n + k)
    packed = pack_int4([c])
    assert packed is not None and (packed["perm"] is not None) == act_order
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    from aiolm.kernels.triton.quant_gemm import w4a16_gemm

    t = {key: v.to(device) if torch.is_tensor(v) else v for key, v in packed.items()}
    got = w4a16_gemm(x.to(device), t["qweight"], t["scale"], t["mins"], t["group_size"], t["perm"])
    _check(got, x, c.dense())


def test_w4a16_stacked_parts_and_strided_x(device):
    """q, k, v stacked into one layer; x a strided view (a slice of a wider activation)."""
    from aiolm.kernels.triton.quant_gemm import w4a16_gemm
    from aiolm.quant.triton_quant import pack_int4

    parts = [_codes(n, 128, 32, True, seed=1) for n in (64, 32, 32)]
    for p in parts[1:]:
        p.group.copy_(parts[0].group)
    packed = pack_int4(parts)
    assert packed is not None
    wide = torch.randn(6, 300)
    x = wide[:, 10:138]
    t = {key: v.to(device) if torch.is_tensor(v) else v for key, v in packed.items()}
    got = w4a16_gemm(x.to(device), t["qweight"], t["scale"], t["mins"], t["group_size"], t["perm"])
    _check(got, x, torch.cat([p.dense() for p in parts]))
    other = _codes(32, 128, 32, True, seed=9)
    assert pack_int4([parts[0], other]) is None  # inputs ordered apart: the layer stays dense


def _fp8(n: int, k: int, kind: str, seed: int):
    """(bytes [N, K], scale rows [KG, N], scale_k, the float32 weight they hold)."""
    g = torch.Generator().manual_seed(seed)
    w8 = (torch.randn(n, k, generator=g) * 50).to(torch.float8_e4m3fn)
    if kind == "tensor":
        s, scale_k = torch.full((1, n), 0.003), k
    elif kind == "channel":
        s, scale_k = torch.rand(1, n, generator=g) * 0.01, k
    else:  # blocks of 32 (rows) x 64 (inputs)
        blocks = torch.rand(-(-n // 32), -(-k // 64), generator=g) * 0.01
        s, scale_k = blocks.repeat_interleave(32, 0)[:n].t().contiguous(), 64
    full = s.t().repeat_interleave(scale_k, 1)[:, :k]
    return w8.view(torch.uint8), s, scale_k, w8.float() * full


@pytest.mark.parametrize(
    ("m", "n", "k", "kind", "dtype"),
    [
        (1, 64, 128, "tensor", torch.float32),
        (12, 96, 256, "channel", torch.float32),
        (40, 64, 256, "block", torch.float32),
        (3, 64, 192, "block", torch.float16),
        (17, 128, 128, "channel", torch.bfloat16),
        (2, 64, 128, "tensor", torch.float16),
    ],
)
def test_fp8_gemm_equals_the_dequantized_weight(m, n, k, kind, dtype, device):
    from aiolm.kernels.triton.quant_gemm import fp8_gemm

    w, s, scale_k, dense = _fp8(n, k, kind, seed=m + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).to(dtype)
    got = fp8_gemm(x.to(device), w.to(device), s.to(device), scale_k)
    _check(got, x, dense)


def test_gemms_refuse_operands_that_do_not_fit(device):
    from aiolm.kernels.triton.quant_gemm import fp8_gemm, w4a16_gemm

    x = torch.randn(2, 128, device=device)
    q = torch.zeros(16, 64, dtype=torch.int32, device=device)
    s = torch.zeros(4, 64, device=device)
    with pytest.raises(ValueError, match="group_size 48"):
        w4a16_gemm(x, q, s, s, 48)
    with pytest.raises(ValueError, match="qweight"):
        w4a16_gemm(x[:, :64], q, s, s, 32)
    with pytest.raises(ValueError, match="scale_k 16"):
        fp8_gemm(x, torch.zeros(64, 128, dtype=torch.uint8, device=device), s, 16)


@pytest.mark.parametrize("fmt", ["gptq", "fp8"])
def test_tiny_quantized_model_through_the_triton_gemms(fmt, tmp_path, real_source, device):
    """The GPU's quant method on a tiny Llama: every decoder linear drops its dense weight for
    the packed one, and greedy tokens equal transformers' on the dequantized model."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from aiolm.checkpoint.source import resolve_model
    from aiolm.model.loader import iter_weights
    from aiolm.model.registry import build_context, build_from_config, finish
    from aiolm.platforms import get_platform
    from aiolm.quant import quant_config
    from lora_models import tiny_base
    from paged import PagedHarness, hf_greedy
    from quantized_checkpoints import write_quantized

    base = tiny_base("llama", tmp_path / "base", real_source.path, hidden_size=128, intermediate_size=256)
    out, ref = tmp_path / "q", tmp_path / "ref"
    write_quantized(base, out, ref, fmt, group_size=32, act_order=fmt == "gptq")
    source = resolve_model(out)
    quant = quant_config("triton_quant", path=out, quant=source.config.quantization, experts="torch")
    ctx = build_context(get_platform(device), torch.float32, "torch", source.config, source.origin, device)
    ctx = dataclasses.replace(ctx, quant=quant)
    model = build_from_config(source.config, ctx)
    model.load_weights(iter_weights(source, lazy=True))
    model = finish(model, ctx)
    assert quant.packed_layers == 4 * len(model.layers)
    assert all(layer.mlp.down_proj.weight.numel() == 0 for layer in model.layers)
    hf = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 40000, (n,), generator=g).tolist() for n in (5, 11)]
    expected = [hf_greedy(hf, p, 8) for p in prompts]
    assert PagedHarness(model, device=device).greedy(prompts, 8) == expected
