"""aiolm::gguf_moe (GGUFExperts: a layer's experts as a GGUF file's blocks) against a per-expert
loop in float64 over gguf-py's dequantized weights, and a GGUF MoE model decoding through it.

Tolerances, relative to the largest output magnitude: the float path 5e-6 against the float64
loop (the blocks hold the weights exactly, only the order of the float32 sums differs); the int8
path 3e-3 against the same loop with x and each pair's activation rounded to int8 per block of 32
as the kernel rounds them (its float32 activation can round to a neighbouring code where the
float64 one sits at a rounding boundary: one step, 1/254 of the block's largest value).
"""

from __future__ import annotations

import gguf
import isa_builds
import numpy as np
import pytest
import torch
from test_gguf_int8 import ISAS, _isas  # the int8 paths this build has

from aiolm.kernels import cpu as cpu_kernels
from aiolm.quant import gguf_blocks
from aiolm.quant.gguf_blocks import GGUFExperts
from kquant_blocks import random_q4_k, random_q6_k

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ compiler for the CPU kernels")

TOL = {False: 5e-6, True: 3e-3}  # by "int8 activations"
# (gate, up, down): one type throughout, and mixes as a Q4_K_M file has them
TYPES = [
    ("Q8_0", "Q8_0", "Q8_0"),
    ("Q4_0", "Q4_0", "Q4_0"),
    ("Q4_1", "Q4_1", "Q4_1"),
    ("Q4_K", "Q4_K", "Q6_K"),
    ("Q4_K", "Q4_K", "Q8_0"),
    ("Q4_K", "Q4_K", "Q5_0"),  # a down projection whose rows are not whole super-blocks
    ("Q6_K", "Q4_1", "Q4_0"),
]


@pytest.fixture(autouse=True)
def _q5_0_at_its_bits(monkeypatch):
    """Q5_0 experts as int8 on VNNI keeps them (gguf_blocks.KEEP_Q5_0), so that the kernels'
    Q5_0 paths run here; widened, they are Q8_0's."""
    monkeypatch.setattr(gguf_blocks, "KEEP_Q5_0", True)


def _blocks(ttype: str, rows: int, cols: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Raw GGUF rows (uint8 [rows, bytes]) of ``ttype`` and the float64 weights gguf-py reads from them."""
    t = getattr(gguf.GGMLQuantizationType, ttype)
    if ttype == "Q4_K":
        raw = random_q4_k(rows, cols, rng, (2e-3, 1e-2))
    elif ttype == "Q6_K":
        raw = random_q6_k(rows, cols, rng, (1e-3, 4e-3))
    else:
        w = (rng.standard_normal((rows, cols)) / cols**0.5).astype(np.float32)
        if ttype == "Q4_1":
            w[::5] += 0.05  # blocks whose minimum is far from 0
        raw = gguf.quants.quantize(w, t)
    deq = np.asarray(gguf.quants.dequantize(raw, t), dtype=np.float64).reshape(rows, cols)
    return raw, deq


def _experts(types, experts: int, hidden: int, inter: int, seed: int):
    """GGUFExperts of random blocks, and the float64 weights [E, 2I, H], [E, H, I] they hold."""
    rng = np.random.default_rng(seed)
    (g, gd), (u, ud), (d, dd) = (
        _blocks(types[0], experts * inter, hidden, rng),
        _blocks(types[1], experts * inter, hidden, rng),
        _blocks(types[2], experts * hidden, inter, rng),
    )
    w13 = torch.from_numpy(np.concatenate([gd.reshape(experts, inter, hidden), ud.reshape(experts, inter, hidden)], 1))
    w2 = torch.from_numpy(dd.reshape(experts, hidden, inter))
    return GGUFExperts.from_blocks(g, u, d, types, experts), w13, w2, (g, u, d)


def _reference(x, w13, w2, weights, ids) -> torch.Tensor:
    """sum_j w[t, j] * w2[e] @ (silu(gate_e x_t) * up_e x_t) in float64, one routed expert at a time."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape[0], w13.shape[2], dtype=torch.float64)
    for e in range(w13.shape[0]):
        tok, slot = (ids.long() == e).nonzero(as_tuple=True)
        if tok.numel():
            gate_up = x[tok].double() @ w13[e].t()
            act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            out.index_add_(0, tok, (act @ w2[e].t()) * weights[tok, slot, None].double())
    return out


def _int8_reference(x, w13, w2, weights, ids) -> torch.Tensor:
    """The int8 path's arithmetic in float64: x rounded to int8 per block of 32 (the kernels' own
    codes, gguf_int8_quantize), and each pair's activation (routing weight folded in) rounded the
    same way before the down projection."""

    def rounded(v: torch.Tensor) -> torch.Tensor:
        q, d = torch.ops.aiolm.gguf_int8_quantize(v.float(), 0)
        return (q.double().view(*d.shape, 32) * d.double().unsqueeze(-1)).view(v.shape)

    inter = w2.shape[2]
    xq = rounded(x)
    out = torch.zeros(x.shape[0], w13.shape[2], dtype=torch.float64)
    for e in range(w13.shape[0]):
        tok, slot = (ids.long() == e).nonzero(as_tuple=True)
        if tok.numel():
            gate_up = xq[tok] @ w13[e].t()
            act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:] * weights[tok, slot, None].double()
            out.index_add_(0, tok, rounded(act) @ w2[e].t())
    return out


def _routing(tokens: int, experts: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weights, ids = torch.rand(tokens, experts, generator=g).topk(k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def _x(tokens: int, hidden: int, seed: int) -> torch.Tensor:
    return torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed))


def _check(got: torch.Tensor, want: torch.Tensor, int8: bool, isa: int = -1) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape
    scale = float(want.abs().max()) if want.numel() else 1.0
    path = f"int8 {ISAS[isa]}" if int8 else "float"
    torch.testing.assert_close(got.double(), want, rtol=0, atol=TOL[int8] * scale, msg=lambda m: f"{path}: {m}")


def _every_path(moe: GGUFExperts, x, weights, ids):
    """(int8, isa, output): the float path, and the int8 path on every ISA this build has."""
    yield False, -1, moe(x, weights, ids)
    for isa in _isas():
        yield True, isa, moe(x, weights, ids, int8=True, isa=isa)


def _check_every_path(moe: GGUFExperts, x, weights, ids, w13, w2) -> list[torch.Tensor]:
    """Every path against its reference; their outputs."""
    want = {False: _reference(x, w13, w2, weights, ids), True: _int8_reference(x, w13, w2, weights, ids)}
    out = []
    for int8, isa, got in _every_path(moe, x, weights, ids):
        _check(got, want[int8], int8, isa)
        out.append(got)
    return out


@pytest.mark.parametrize("types", TYPES, ids=lambda t: "-".join(t))
# a decode step, a few rows (AVX2's float tiles of 2 and 8 rows, VNNI's pair tiles past 2), and
# top-1 to top-8 over 8 or 16 experts (some with no tokens)
@pytest.mark.parametrize("tokens,experts,k", [(1, 16, 8), (1, 8, 1), (3, 8, 2), (6, 16, 5), (13, 8, 3)])
def test_matches_per_expert_loop_over_dequantized_weights(types, tokens, experts, k):
    k_quant = any(t.endswith("_K") for t in types)
    hidden, inter = (256, 256) if k_quant else (96, 64)
    moe, w13, w2, _ = _experts(types, experts, hidden, inter, tokens * 10 + k)
    weights, ids = _routing(tokens, experts, k, tokens + k)
    x = _x(tokens, hidden, k)
    _check_every_path(moe, x, weights, ids, w13, w2)


@pytest.mark.parametrize("k", [6, 7, 8])
def test_top_k_up_to_8_over_a_wider_layer(k):
    moe, w13, w2, _ = _experts(("Q8_0", "Q4_0", "Q4_1"), 12, 160, 96, k)
    weights, ids = _routing(4, 12, k, k)
    x = _x(4, 160, k)
    _check_every_path(moe, x, weights, ids, w13, w2)


def test_every_token_to_one_expert_and_ids_of_minus_one():
    moe, w13, w2, _ = _experts(("Q4_K", "Q4_K", "Q6_K"), 6, 256, 256, 3)
    x = _x(15, 256, 3)
    ids = torch.full((15, 2), 4)
    ids[:, 1] = -1  # the second slot's expert is on another rank
    ids[3] = -1  # a token with no expert here: a zero row
    weights = torch.rand(15, 2)
    for got in _check_every_path(moe, x, weights, ids, w13, w2):
        assert torch.equal(got[3], torch.zeros(256))
    assert torch.equal(moe(x, weights, ids), moe(x, weights, ids.int()))


def test_a_step_reads_only_the_routed_experts_blocks():
    """Every block of the experts not routed to has a NaN scale: the output stays finite."""
    experts, hidden, inter = 8, 64, 64
    moe, w13, w2, (g, u, d) = _experts(("Q8_0", "Q8_0", "Q4_1"), experts, hidden, inter, 5)
    nan = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
    poisoned = []
    for raw, rows, size in ((g, inter, 34), (u, inter, 34), (d, hidden, 20)):
        p = raw.copy().reshape(experts, rows, -1, size)
        for e in set(range(experts)) - {2, 6}:
            p[e, :, :, 0:2] = nan
        poisoned.append(p.reshape(raw.shape))
    moe = GGUFExperts.from_blocks(*poisoned, ("Q8_0", "Q8_0", "Q4_1"), experts)
    x, weights, ids = _x(1, hidden, 5), torch.tensor([[0.7, 0.3]]), torch.tensor([[6, 2]])
    for got in _check_every_path(moe, x, weights, ids, w13, w2):
        assert torch.isfinite(got).all()


@pytest.mark.parametrize("tokens", [1, 9])
def test_threads_split_the_work_without_changing_the_sums(tokens):
    """Items of experts x 16 rows over 2 threads give the one thread's bits: each output sums
    its experts in the same order whoever computes them."""
    moe, w13, w2, _ = _experts(("Q4_K", "Q4_K", "Q6_K"), 16, 256, 256, 8)
    weights, ids = _routing(tokens, 16, 8, 8)
    x = _x(tokens, 256, 8)
    one = list(_every_path(moe, x, weights, ids))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two = list(_every_path(moe, x, weights, ids))
    finally:
        torch.set_num_threads(threads)
    for (int8, isa, a), (_, _, b) in zip(one, two):
        assert torch.equal(a, b), (int8, ISAS.get(isa))
    _check(one[0][2], _reference(x, w13, w2, weights, ids), False)


def test_empty_step_and_rejections():
    moe, *_ = _experts(("Q8_0", "Q8_0", "Q8_0"), 4, 64, 32, 6)
    empty = moe(torch.zeros(0, 64), torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.long))
    assert empty.shape == (0, 64) and empty.dtype == torch.float32
    assert torch.equal(moe(_x(2, 64, 0), torch.ones(2, 2), torch.full((2, 2), -1)), torch.zeros(2, 64))
    with pytest.raises(RuntimeError, match="expert id 4 outside"):
        moe(torch.zeros(1, 64), torch.ones(1, 1), torch.tensor([[4]]))
    with pytest.raises(RuntimeError, match="x has 32 features"):
        moe(torch.zeros(1, 32), torch.ones(1, 1), torch.tensor([[0]]))
    with pytest.raises(RuntimeError, match="isa 9 is not built here"):
        moe(torch.zeros(1, 64), torch.ones(1, 1), torch.tensor([[0]]), int8=True, isa=9)


@pytest.mark.parametrize("isa", list(isa_builds.ISA_BUILDS))
def test_other_isa_builds_match_the_references(isa, isa_runs):
    """The float path's compiled-in kernels (gguf_linear.h picks them at build time): a build
    without AVX-512 and a baseline x86-64 one (the scalar routines alone)."""
    if isa == "avx2" and not cpu_kernels.has_avx512():
        pytest.skip("this machine's own build is the AVX2 one")
    isa_builds.check_build_flags(isa)
    isa_runs.check("gguf_experts", isa)  # isa_builds.SUITES["gguf_experts"] (int8 x: gguf_int8_quantize)


@pytest.mark.parametrize(
    "kind,stacked",
    [("qwen3_moe", True), ("mixtral", True), ("mixtral", False)],
    ids=["qwen3_moe", "mixtral", "mixtral-per-expert"],
)
def test_gguf_moe_model_decodes_from_its_blocks(kind, stacked, tmp_path, monkeypatch):
    """A Q8_0 MoE file's sparse layers keep their experts' blocks, its small steps run from them
    (the larger ones on the float32 experts), and the greedy tokens are transformers' on the
    values the file holds. The modules' path: the fused decode call, which runs the same blocks
    for the decode steps, gives its bits (tests/model/test_moe_gguf.py)."""
    from transformers import AutoModelForCausalLM

    from aiolm.checkpoint.source import resolve_model
    from aiolm.kernels.cpu_moe import CpuExperts
    from aiolm.model.layers.fused_moe import FusedMoE
    from aiolm.model.registry import build_model
    from aiolm.quant import gguf_blocks
    from aiolm.quant.gguf_blocks import MAX_ROWS
    from gguf_moe_writer import VOCAB, tiny_moe_model, write_moe_gguf
    from paged import PagedHarness, hf_greedy

    path = tmp_path / f"{kind}.gguf"
    write_moe_gguf(tiny_moe_model(kind), path, "Q8_0", stacked=stacked)
    with monkeypatch.context() as mp:  # the conversion goes to a private cache; the kernels stay the suite's
        mp.setenv("AIOLM_CACHE_DIR", str(tmp_path / "cache"))
        source = resolve_model(path)
    hf = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32).eval()
    model = build_model(source, torch.float32)
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert layers and all(isinstance(m.gguf_experts, GGUFExperts) for m in layers)
    assert all(m.gguf_experts.types == (8, 8, 8) for m in layers)  # Q8_0 throughout
    model.fused_stack = None
    for layer in model.layers:
        layer.fused = None

    rows = {"blocks": [], "float32": []}  # per call: tokens, and routed rows an expert gets on average
    blocks_call, float_call = GGUFExperts.__call__, CpuExperts.__call__
    experts = layers[0].local_experts

    def on_blocks(self, x, weights, ids, *args, **kwargs):
        rows["blocks"].append((x.shape[0], -(-ids.numel() // experts)))
        return blocks_call(self, x, weights, ids, *args, **kwargs)

    def on_float(self, x, weights, ids, *args, **kwargs):
        rows["float32"].append((x.shape[0], -(-ids.numel() // experts)))
        return float_call(self, x, weights, ids, *args, **kwargs)

    monkeypatch.setattr(GGUFExperts, "__call__", on_blocks)
    monkeypatch.setattr(CpuExperts, "__call__", on_float)
    g = torch.Generator().manual_seed(3)
    # The first prefill step has more tokens than MAX_ROWS but routes no more than that to an
    # expert on average (top-2 of 4 or 8): the blocks; the second routes more: float32.
    lens = (MAX_ROWS + 8, MAX_ROWS // 2 + 5, 8 * MAX_ROWS)  # all longer than the split
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lens]
    expected = [hf_greedy(hf, p, NEW) for p in prompts]
    assert len({t for e in expected for t in e}) > 5
    assert PagedHarness(model, block_size=4).greedy(prompts, NEW, split=MAX_ROWS // 2 + 1) == expected
    decode_steps = NEW - 1
    decodes = [t for t, _ in rows["blocks"]].count(len(prompts))
    assert decodes == decode_steps * len(layers)  # every decode step, every layer
    assert rows["float32"] and min(e for _, e in rows["float32"]) > MAX_ROWS
    assert max(e for _, e in rows["blocks"]) <= MAX_ROWS < max(t for t, _ in rows["blocks"])

    # with AIOLM_GGUF_INT8=1 a decode step takes the blocks' int8 path
    monkeypatch.setattr(gguf_blocks, "INT8", True)
    layer = layers[0]
    x, weights, ids = _x(2, layer.hidden, 0), torch.tensor([[0.6, 0.4], [0.5, 0.5]]), torch.tensor([[0, 3], [1, 0]])
    got = layer.quant_method.apply(layer, x, weights, ids)
    assert torch.equal(got, layer.gguf_experts(x, weights, ids, int8=True))
    assert not torch.equal(got, layer.gguf_experts(x, weights, ids))


NEW = 8
