"""TritonOps, the CUDA platform's ops, against TorchOps, the reference they stand in for.

Each op gives the reference's result (same dtype and shape, values within the kernels'
float32-arithmetic rounding), sends what the kernels take to a kernel (counted by a spy
on the kernel entry points) and the rest to the reference.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from aiolm.kernels.ops import TorchOps

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}
KERNELS = [
    ("norm", "rms_norm"),
    ("norm", "add_rms_norm_"),
    ("rope", "rotary_"),
    ("activation", "silu_and_mul"),
    ("activation", "gelu_tanh_and_mul"),
]


@pytest.fixture
def spy(monkeypatch):
    """Counts the calls TritonOps makes into each kernel module's entry point."""
    import importlib

    calls: Counter[str] = Counter()
    for mod_name, fn_name in KERNELS:
        mod = importlib.import_module(f"aiolm.kernels.triton.{mod_name}")
        real = getattr(mod, fn_name)

        def counted(*a, _real=real, _name=fn_name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(mod, fn_name, counted)
    return calls


@pytest.fixture
def triton_ops():
    from aiolm.kernels.triton.ops import TritonOps

    return TritonOps()


def _rand(*shape, dtype, seed=0, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = TOL[want.dtype]
    torch.testing.assert_close(got.cpu(), want.cpu(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_match_the_reference(dtype, triton_ops, spy, device):
    x, r = _rand(5, 72, dtype=dtype, device=device), _rand(5, 72, dtype=dtype, seed=1, device=device)
    w = _rand(72, dtype=dtype, seed=2, device=device)
    _close(triton_ops.rms_norm(x, w, 1e-6), TorchOps().rms_norm(x, w, 1e-6))
    # a per-head norm (QK-norm) of a strided [T, H, D] view of a fused qkv row
    qkv = _rand(3, 4 * 32 + 64, dtype=dtype, seed=3, device=device)
    q = qkv[:, :128].view(3, 4, 32)
    wq = _rand(32, dtype=dtype, seed=4, device=device)
    _close(triton_ops.rms_norm(q, wq, 1e-6), TorchOps().rms_norm(q, wq, 1e-6))
    want_h, want_res = TorchOps().add_rms_norm(x, r, w, 1e-6)
    got_h, got_res = triton_ops.add_rms_norm(x.clone(), r.clone(), w, 1e-6)
    _close(got_res, want_res)
    _close(got_h, want_h)
    assert spy["rms_norm"] == 2 and spy["add_rms_norm_"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_the_reference(dtype, triton_ops, spy, device):
    from aiolm.model.layers.rotary import RotaryEmbedding

    emb = RotaryEmbedding(32, 64, 10000.0, None, TorchOps()).to(dtype)  # as a model built in ``dtype`` holds it
    pos = torch.tensor([0, 1, 15, 16, 63], device=device)
    qkv = _rand(5, (3 + 2 * 1) * 32, dtype=dtype, device=device)
    want_q, want_k = TorchOps().rotary(
        pos, qkv[:, :96].view(5, 3, 32), qkv[:, 96:128].view(5, 1, 32), emb.cos.to(device), emb.sin.to(device)
    )
    v_before = qkv[:, 128:].clone()
    got_q, got_k = triton_ops.rotary(
        pos, qkv[:, :96].view(5, 3, 32), qkv[:, 96:128].view(5, 1, 32), emb.cos.to(device), emb.sin.to(device)
    )
    # the reference rounds cos/sin and each product to ``dtype``; the kernel rounds once
    _close(got_q, want_q)
    _close(got_k, want_k)
    assert torch.equal(qkv[:, 128:], v_before)
    assert spy["rotary_"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_activations_match_the_reference(dtype, triton_ops, spy, device):
    x = _rand(2, 3, 2 * 40, dtype=dtype, device=device) * 3  # [.., 2N] with more than one leading dim
    _close(triton_ops.silu_and_mul(x), TorchOps().silu_and_mul(x))
    _close(triton_ops.gelu_and_mul(x, "tanh"), TorchOps().gelu_and_mul(x, "tanh"))
    assert spy["silu_and_mul"] == 1 and spy["gelu_tanh_and_mul"] == 1


def test_what_the_kernels_do_not_take_goes_to_the_reference(triton_ops, spy, device):
    x = _rand(4, 64, dtype=torch.bfloat16, device=device)
    w32 = _rand(64, dtype=torch.float32, seed=1, device=device)
    # a float32 weight on bfloat16 rows: the reference promotes to float32, so must the op
    got = triton_ops.rms_norm(x, w32, 1e-5)
    assert got.dtype == torch.float32 and torch.equal(got, TorchOps().rms_norm(x, w32, 1e-5))
    r32 = _rand(4, 64, dtype=torch.float32, seed=2, device=device)
    h, res = triton_ops.add_rms_norm(x, r32, w32, 1e-5)  # the reference's add, then a float32 norm
    want_h, want_res = TorchOps().add_rms_norm(x, r32, w32, 1e-5)
    assert torch.equal(res, want_res)
    _close(h, want_h)
    g = _rand(3, 16, dtype=torch.float32, device=device)
    assert torch.equal(triton_ops.gelu_and_mul(g, "none"), TorchOps().gelu_and_mul(g, "none"))  # exact gelu
    f64 = _rand(2, 8, dtype=torch.float64, device=device)  # no kernel for float64
    assert torch.equal(triton_ops.silu_and_mul(f64), TorchOps().silu_and_mul(f64))
    assert spy == {"rms_norm": 1}  # only the float32 norm of the promoted sum reached a kernel


def test_the_cuda_platform_installs_them(monkeypatch):
    """CudaPlatform.ops(): TritonOps where triton is installed, the reference where not
    (torch.cuda.is_available is faked where there is no GPU: the platform refuses to exist without one)."""
    from aiolm.kernels import triton as triton_kernels
    from aiolm.kernels.triton.ops import TritonOps
    from aiolm.platforms.cuda import CudaPlatform

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert type(CudaPlatform().ops()) is TritonOps
    monkeypatch.setattr(triton_kernels, "available", lambda: False)
    assert type(CudaPlatform().ops()) is TorchOps


def test_a_gemma3_forward_matches_the_reference(spy, device):
    """A tiny random Gemma 3 (QK-norm on [T, H, D] views, four norms per layer, GeLU-tanh,
    a sliding and a global layer): the same logits through TritonOps as through TorchOps,
    for a flat batch of two prefills and then a decode step."""
    from aiolm.attention.torch_backend import TorchAttention
    from aiolm.checkpoint.gemma3 import Gemma3Config
    from aiolm.distributed.parallel_state import get_tp_group
    from aiolm.kernels.triton.ops import TritonOps
    from aiolm.model.layers.context import BuildContext
    from aiolm.model.registry import build_from_config, finish
    from aiolm.quant import quant_config
    from paged import PagedHarness

    cfg = Gemma3Config(
        architecture="gemma3",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        attention_bias=False,
        qk_norm=True,
        sliding_windows=(8, None),
        local_layers=(True, False),
        query_pre_attn_scalar=32.0,
        final_logit_softcapping=3.0,
    )

    def build(ops: TorchOps) -> torch.nn.Module:
        """The same random weights each time, on ``ops``."""
        ctx = BuildContext(
            ops=ops,
            attention_backend=TorchAttention,
            quant=quant_config("dense"),
            tp_group=get_tp_group(),
            device=torch.device(device),
        )
        model = build_from_config(cfg, ctx)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(
                    (1 + 0.3 * torch.randn(p.shape, generator=g))
                    if "norm" in name
                    else 0.15 * torch.randn(p.shape, generator=g)
                )
        return finish(model, ctx)

    prompts = {0: list(range(3, 15)), 1: list(range(40, 45))}

    def run(model: torch.nn.Module) -> list[torch.Tensor]:
        h = PagedHarness(model, num_blocks=8, block_size=16, device=device)
        first = h.step(prompts)
        second = h.step({0: [7], 1: [9]})
        return [first[0], first[1], second[0], second[1]]

    want = run(build(TorchOps()))
    got = run(build(TritonOps()))
    for g_, w in zip(got, want):
        torch.testing.assert_close(g_, w, atol=1e-4, rtol=1e-4)
    # per step: 2 layers x (4 decoder norms + q and k norms) + the final norm, one GeLU per layer
    assert spy["gelu_tanh_and_mul"] == 2 * 2 and spy["rotary_"] == 2 * 2
    assert spy["rms_norm"] + spy["add_rms_norm_"] == 2 * (2 * 6 + 1)
