"""GGUF k-quant blocks (Q4_K, Q6_K) for small-batch decode: the regrouped arrays hold gguf-py's
own dequantized values bit for bit, aiolm::gguf_linear and aiolm::gguf_int8_linear (every
ISA path) match float64 references, and a tiny Llama written with Q4_K tensors decodes
from its blocks as it does from the float32 copy.

gguf-py dequantizes k-quants but cannot quantize them, so the blocks are made from
random bytes: any 6-bit scale and min, int8 scale and 4- or 6-bit code is a valid block."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from test_gguf_int8 import ISAS, _isas  # the int8 paths this build has, as the Q4_0/Q4_1/Q8_0 tests run them

from aiolm.kernels import cpu as cpu_kernels
from aiolm.quant import gguf_blocks
from kquant_blocks import random_q4_k, random_q6_k

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ compiler for the CPU kernels")

Q4_K = gguf.GGMLQuantizationType.Q4_K
Q6_K = gguf.GGMLQuantizationType.Q6_K


RANDOM = {"Q4_K": random_q4_k, "Q6_K": random_q6_k}


def _dequantized(blocks: np.ndarray, shape: tuple[int, int], kind: str = "Q4_K") -> np.ndarray:
    t = getattr(gguf.GGMLQuantizationType, kind)
    return np.asarray(gguf.quants.dequantize(blocks, t), dtype=np.float32).reshape(shape)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_regrouped_arrays_dequantize_to_gguf_values(qtype):
    """GGUFWeight.dequantize, the reference the k-quant checks below lean on, on the types
    gguf-py can quantize."""
    w = np.random.default_rng(0).standard_normal((43, 96)).astype(np.float32)
    t = getattr(gguf.GGMLQuantizationType, qtype)
    blocks = gguf.quants.quantize(w, t)
    want = np.asarray(gguf.quants.dequantize(blocks, t), dtype=np.float32).reshape(w.shape)
    assert np.array_equal(gguf_blocks.GGUFWeight.from_blocks(blocks, qtype).dequantize().numpy(), want)


def test_q4_k_regroups_to_gguf_values_bit_for_bit():
    rng = np.random.default_rng(0)
    blocks = random_q4_k(43, 768, rng, (1e-6, 1.0))  # a padded group of 8; 3 super-blocks a row
    blocks[5, 4:16] = 255  # every scale and min at 63
    blocks[6, 4:16] = 0  # every scale and min 0: the sub-blocks are 0
    g = gguf_blocks.GGUFWeight.from_blocks(blocks, "Q4_K")
    # the file's codes: per group a byte a block and row, then a float32 a super-block and row
    assert g.qtype == 12 and g.scale.dtype == g.mins.dtype == torch.uint8
    assert g.qs.shape == (6, 24 * 8 * 16) and g.scale.shape == g.mins.shape == (6, 24 * 8 + 3 * 8 * 4)
    want = _dequantized(blocks, (43, 768))
    got = g.dequantize().numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))  # exact, signs of zeros included


def test_q6_k_regroups_to_gguf_values_bit_for_bit():
    rng = np.random.default_rng(1)
    blocks = random_q6_k(43, 768, rng, (1e-6, 1.0))
    blocks[5, 192:208] = 0x80  # every scale -128
    blocks[5, :192] = 0  # every code -32: the largest product of a scale and a code
    g = gguf_blocks.GGUFWeight.from_blocks(blocks, "Q6_K")
    assert g.qtype == 14 and g.qs.dtype == torch.int8 and g.scale.dtype == torch.float32
    assert g.qs.shape == (6, 24 * 8 * 32) and g.scale.shape == (6, 24 * 8 * 2) and g.mins.numel() == 0
    assert int(g.qs.min()) == -32 and int(g.qs.max()) == 31
    want = _dequantized(blocks, (43, 768), "Q6_K")
    assert np.array_equal(g.dequantize().numpy().view(np.uint32), want.view(np.uint32))


def _min_part(blocks: np.ndarray, shape: tuple[int, int], kind: str) -> torch.Tensor:
    """|dmin * m| per weight: the size of the min term each weight's value carries (Q4_K)."""
    if kind != "Q4_K":
        return torch.zeros(shape, dtype=torch.float64)
    g = gguf_blocks.GGUFWeight.from_blocks(blocks, kind)
    groups, nb = g.mins.shape[0], shape[1] // 32
    mins = gguf_blocks.uncoded(g.mins, nb)
    m = mins.view(groups, nb, 8).transpose(1, 2).reshape(groups * 8, nb)[: shape[0]]
    return m.double().abs().repeat_interleave(32, dim=1)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 20])
def test_float_kernel_matches_dequantized_matmul(kind, rows):
    rng = np.random.default_rng(rows)
    blocks = RANDOM[kind](43, 512, rng, (1e-5, 1e-1))
    deq = torch.from_numpy(_dequantized(blocks, (43, 512), kind)).double()
    x = torch.from_numpy(rng.standard_normal((rows, 512)).astype(np.float32))
    got = gguf_blocks.GGUFWeight.from_blocks(blocks, kind).linear(x).double()
    want = x.double() @ deq.t()
    # Float rounding is relative to the terms summed: d * q * x and the min's m * x.
    terms = x.double().abs() @ (deq.abs() + 2 * _min_part(blocks, (43, 512), kind)).t()
    assert ((got - want).abs() / terms).max() < 1e-6


@pytest.mark.parametrize("isa", _isas(), ids=lambda i: ISAS[i])
@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
# 3 rows on: VNNI's two-group tiles (Q6_K in runs of up to 4 rows: 11 is 4, 4 and 3; 17 is
# tiles of 8 and 9); 70: two passes over W (Q6_K: the halves too)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 11, 13, 17, 70])
def test_int8_kernel_matches_dequantized_weights_times_dequantized_x(isa, kind, rows):
    """As tests/kernels/test_gguf_int8.py: tight against the same int8 x dequantized. 35 rows:
    5 groups of 8, the last padded, so VNNI's last pair of groups has one."""
    rng = np.random.default_rng(rows + 100)
    blocks = RANDOM[kind](35, 512, rng, (1e-5, 1e-1))
    if kind == "Q6_K":
        blocks[6, :192] = 0  # codes of -32 ...
        blocks[6, 192:208] = 0x80  # ... and scales of -128
    deq = torch.from_numpy(_dequantized(blocks, (35, 512), kind)).double()
    x = torch.from_numpy(rng.standard_normal((rows, 512)).astype(np.float32))
    x[0, :32] *= 1e-4
    x[-1, 32:64] = 0
    x[-1, 64:80] = -3.0  # a half-block of one value: its own sum of codes
    got = gguf_blocks.GGUFWeight.from_blocks(blocks, kind).linear_int8(x, isa=isa).double()
    q, d = torch.ops.aiolm.gguf_int8_quantize(x, isa)
    xq = (q.double().view(rows, 16, 32) * d.double().unsqueeze(-1)).view(rows, 512)
    want = xq @ deq.t()
    terms = xq.abs() @ (deq.abs() + 2 * _min_part(blocks, (35, 512), kind)).t()
    assert ((got - want).abs() / terms).max() < 2e-6
    half_step = (d.double() / 2).repeat_interleave(32, dim=1)
    exact = x.double() @ deq.t()
    assert ((got - exact).abs() <= half_step @ deq.abs().t() + 2e-6 * terms).all()


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 13])
def test_q4_k_codes_compute_what_their_float32_values_do(rows):
    """A file's Q4_K keeps its scale and min codes (a byte a block, a float32 factor a
    super-block) and every kernel multiplies by factor * code where it reads a scale: the
    vector paths, float and int8, give bit for bit what they give from the float32 values
    (Q4_1F); int8's scalar path, where the compiler may fuse a multiply and an add in one
    build and not the other, within its rounding."""
    rng = np.random.default_rng(rows + 7)
    blocks = random_q4_k(43, 768, rng, (1e-5, 1e-1))  # 3 super-blocks a row, a padded group
    blocks[3, 4:16] = 255  # codes of 63
    g = gguf_blocks.GGUFWeight.from_blocks(blocks, "Q4_K")
    scale, mins = gguf_blocks.uncoded(g.scale, 24), gguf_blocks.uncoded(g.mins, 24)
    assert scale.dtype == mins.dtype == torch.float32 and scale.shape == mins.shape == (6, 24 * 8)
    plain = gguf_blocks.GGUFWeight(g.qs, scale, mins, gguf_blocks.Q4_1F, g.n)
    x = torch.from_numpy(rng.standard_normal((rows, 768)).astype(np.float32))
    assert torch.equal(g.linear(x).view(torch.int32), plain.linear(x).view(torch.int32))
    for isa in _isas():
        got, want = g.linear_int8(x, isa=isa), plain.linear_int8(x, isa=isa)
        if isa == 0:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        else:
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), ISAS[isa]
    assert torch.equal(g.dequantize(), plain.dequantize())


def test_bad_scale_dtypes_are_refused():
    g = gguf_blocks.GGUFWeight.from_blocks(random_q4_k(8, 256, np.random.default_rng(0), (1e-3, 1e-2)), "Q4_K")
    x = torch.zeros(1, 256)
    with pytest.raises(RuntimeError, match=r"scale must be uint8 \[N/8, nblocks \* 12\] for type 12"):
        torch.ops.aiolm.gguf_linear(x, g.qs, g.scale.float(), g.mins, 12, g.n)
    with pytest.raises(RuntimeError, match=r"Q4_K needs uint8 mins \[N/8, nblocks \* 12\]"):
        torch.ops.aiolm.gguf_int8_linear(x, g.qs, g.scale, g.mins.half(), 12, g.n, -1)
    with pytest.raises(RuntimeError, match=r"scale must be uint8 \[N/8, nblocks \* 12\]"):
        torch.ops.aiolm.gguf_linear(x, g.qs, g.scale[:, :-4].contiguous(), g.mins[:, :-4].contiguous(), 12, g.n)
    # a row of 9 blocks of 32 is no whole super-block: its factors would not line up
    q9 = torch.zeros(1, 9 * 8 * 16, dtype=torch.uint8)
    s9 = torch.zeros(1, 9 * 12, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="a row of 9 blocks of 32 is not"):
        torch.ops.aiolm.gguf_linear(torch.zeros(1, 288), q9, s9, s9, 12, 8)
    with pytest.raises(RuntimeError, match="scale must be float16"):  # Q4_1 keeps the file's float16
        torch.ops.aiolm.gguf_linear(x, g.qs, g.scale, g.mins, 3, g.n)
    g6 = gguf_blocks.GGUFWeight.from_blocks(random_q6_k(8, 256, np.random.default_rng(0), (1e-3, 1e-2)), "Q6_K")
    with pytest.raises(RuntimeError, match=r"scale must be float32 \[N/8, nblocks \* 8 \* 2\]"):
        torch.ops.aiolm.gguf_int8_linear(x, g6.qs, g6.scale[:, :64].contiguous(), g6.mins, 14, g6.n, -1)


# A tiny Llama with Q4_K and Q6_K linear tensors (Q6_K where Q4_K_M files put it: the
# output, some layers' attn_v and ffn_down; here also attn_output, for a Q6_K step in
# every layer). Layer 0's v is Q6_K beside a Q4_K q and k: its QKV runs as two parts.
HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 512, 2, 4, 2, 49152


def _write_k_quant_llama(path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from make_model import copy_gguf_tokenizer

    rng = np.random.default_rng(7)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    copy_gguf_tokenizer(w)
    kv = KV_HEADS * HIDDEN // HEADS

    def q4k(name: str, rows: int, cols: int) -> None:
        # weights of std about 0.02, as a trained model's
        w.add_tensor(name, random_q4_k(rows, cols, rng, (5e-5, 1.5e-4)), raw_dtype=Q4_K)

    def q6k(name: str, rows: int, cols: int) -> None:
        w.add_tensor(name, random_q6_k(rows, cols, rng, (1e-5, 2e-5)), raw_dtype=Q6_K)

    q4k("token_embd.weight", VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(HIDDEN, np.float32))
        q4k(p + "attn_q.weight", HIDDEN, HIDDEN)
        q4k(p + "attn_k.weight", kv, HIDDEN)
        (q6k if i == 0 else q4k)(p + "attn_v.weight", kv, HIDDEN)
        q6k(p + "attn_output.weight", HIDDEN, HIDDEN)
        w.add_tensor(p + "ffn_norm.weight", np.ones(HIDDEN, np.float32))
        q4k(p + "ffn_gate.weight", INTER, HIDDEN)
        q4k(p + "ffn_up.weight", INTER, HIDDEN)
        q6k(p + "ffn_down.weight", HIDDEN, INTER)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    q6k("output.weight", VOCAB, HIDDEN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _decode(model, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the logits of each one-row decode step."""
    from paged import PagedHarness

    h = PagedHarness(model)
    logits = h.step({0: prompt})[0]
    tokens, steps = [], []
    for _ in range(n):
        tokens.append(int(logits.argmax()))
        logits = h.step({0: tokens[-1:]})[0]
        steps.append(logits)
    return tokens, steps


def test_k_quant_llama_decodes_from_its_blocks_like_the_float32_path(tmp_path, monkeypatch):
    from aiolm.checkpoint.source import resolve_model
    from aiolm.model.registry import build_model

    path = tmp_path / "tiny-Q4_K_M.gguf"
    _write_k_quant_llama(path)
    cache = tmp_path / "aiolm-cache"  # the conversion goes here; the compiled kernels are the suite's
    cache.mkdir()
    (cache / "kernels").symlink_to(cpu_kernels.cache_dir(), target_is_directory=True)
    monkeypatch.setenv("AIOLM_CACHE_DIR", str(cache))
    monkeypatch.setattr(gguf_blocks, "INT8", False)
    model = build_model(resolve_model(path), torch.float32)
    layers = [m for m in model.modules() if isinstance(getattr(m, "gguf", None), gguf_blocks.GGUFLinear)]
    assert len(layers) == 4 * LAYERS + 1  # every linear layer and the LM head
    qkv0 = model.layers[0].self_attn.qkv_proj.gguf.blocks
    assert isinstance(qkv0, gguf_blocks.GGUFParts) and [p.qtype for p in qkv0.parts] == [12, 14]
    assert [p.n for p in qkv0.parts] == [HIDDEN + KV_HEADS * HIDDEN // HEADS, KV_HEADS * HIDDEN // HEADS]
    assert {m.gguf.blocks.qtype for m in layers if m is not model.layers[0].self_attn.qkv_proj} == {12, 14}
    # decode steps: one C++ call for all the layers, layer 0's QKV as its two parts' matmuls
    assert all(isinstance(layer.fused, gguf_blocks.FusedDecodeLayer) for layer in model.layers)
    assert isinstance(model.fused_stack, gguf_blocks.FusedDecodeStack)
    assert model.layers[0].fused.ints[False][:6] == [
        12,
        HIDDEN + KV_HEADS * HIDDEN // HEADS,
        14,
        KV_HEADS * HIDDEN // HEADS,
        0,
        0,
    ]

    prompt = [int(t) for t in np.random.default_rng(1).integers(100, VOCAB, 12)]
    blocks_tokens, blocks_logits = _decode(model, prompt, 6)
    monkeypatch.setattr(gguf_blocks, "INT8", True)  # int8 x, through the fused layers
    int8_tokens, int8_logits = _decode(model, prompt, 6)
    monkeypatch.setattr(gguf_blocks, "INT8", False)
    model.fused_stack = None
    for layer in model.layers:
        layer.fused = None
    modules_tokens, modules_logits = _decode(model, prompt, 6)  # the same kernels, called module by module
    for m in layers:
        m.gguf = None  # the blocks taken away: the method it had beside them
    f32_tokens, f32_logits = _decode(model, prompt, 6)

    assert all(torch.equal(a, b) for a, b in zip(blocks_logits, modules_logits))  # decode_layer: the same bits

    assert blocks_tokens == f32_tokens
    for a, b in zip(blocks_logits, f32_logits):  # the same weights: only the order of the sums differs
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))
    # int8 x rounds each activation by up to half a step of 1/254 of its block's largest value
    a, b = int8_logits[0], f32_logits[0]
    assert torch.isfinite(a).all() and float((a - b).abs().max()) < 0.05 * float(b.abs().max())
    rel = [float((x - y).abs().max() / y.abs().max()) for x, y in ((blocks_logits[0], b), (a, b))]
    print(
        f"\nQ4_K/Q6_K tiny llama: block tokens {blocks_tokens}, int8 {int8_tokens}, float32 {f32_tokens}; "
        f"first step's largest logit difference / largest logit: blocks {rel[0]:.1e}, int8 {rel[1]:.1e}"
    )
