"""Quantized Hugging Face checkpoints (GPTQ, AWQ, compressed-tensors W4A16 and fp8, fp8 with
block scales), written by the tests' own quantizer (tests/quantized_checkpoints.py), load as
the values they hold: each layer's weight equals the quantizer's s * (q - z) exactly, the
logits equal transformers' on the float32 model of those values, and greedy tokens agree.
On the CPU the 4-bit layers also keep their codes as blocks for small steps, which the
greedy decode steps here take."""

from __future__ import annotations

import json

import pytest
import torch

from aiolm.checkpoint.quantization import WeightQuant, read_quantization
from aiolm.checkpoint.source import resolve_model
from aiolm.errors import ModelLoadError
from aiolm.model.loader import iter_weights
from aiolm.model.registry import build_model
from aiolm.quant.checkpoint_formats import Int4Codes
from aiolm.quant.gguf_blocks import MAX_ROWS, FusedDecodeLayer, GGUFLinear, GGUFWeight
from aiolm.quant.int4_blocks import PermutedBlocks, codes_as_blocks
from lora_models import tiny_base
from paged import PagedHarness, hf_greedy
from quantized_checkpoints import AWQ_ORDER, gptq_tensors, pack_cols, quantize4, write_quantized

NEW = 24
# (format, group size, symmetric, activation order): every layout and option the readers take
CASES = [
    ("gptq", 32, True, False),
    ("gptq", 128, True, True),  # desc_act: g_idx scatters the groups
    ("gptq_v2", 64, False, False),  # zero points stored as they are, asymmetric
    ("awq", 64, False, False),
    ("awq", 128, False, False),
    ("ct4", 32, True, True),  # actorder: group, bfloat16 scales
    ("ct4", 64, False, False),  # asymmetric: packed zero points
    ("ct4", -1, True, False),  # channel strategy: one group per row
    ("fp8", None, True, False),  # 32 x 32 blocks of scales
    ("ct_fp8", None, True, False),  # float-quantized, per-channel scales
]


def case_id(case) -> str:
    fmt, gs, sym, act = case
    return f"{fmt}" + (f"-g{gs}" if gs else "") + ("" if sym else "-asym") + ("-actorder" if act else "")


@pytest.fixture(scope="module")
def bases(tmp_path_factory, real_source):
    root = tmp_path_factory.mktemp("quant_bases")
    small = dict(hidden_size=128, intermediate_size=256)  # every K a multiple of 128
    return {
        "llama": tiny_base("llama", root / "llama", real_source.path, **small),
        "qwen3": tiny_base("qwen3", root / "qwen3", real_source.path, head_dim=32, **small),
    }


def written(bases, tmp_path, kind: str, case):
    fmt, gs, sym, act = case
    out, ref = tmp_path / "q", tmp_path / "ref"
    codes = write_quantized(bases[kind], out, ref, fmt, group_size=gs or 32, sym=sym, act_order=act)
    return out, ref, codes


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_loaded_weights_are_the_quantizers_values(bases, tmp_path, case):
    """Every quantized layer's weight as the loader gives it equals, bit for bit, the float32
    values the quantizer wrote; the dense tensors pass through untouched."""
    from safetensors.torch import load_file

    out, ref, _ = written(bases, tmp_path, "llama", case)
    expected = load_file(ref / "model.safetensors")
    got = {name: w[...] for name, w in iter_weights(resolve_model(out), lazy=True)}
    assert sorted(got) == sorted(expected)
    for name, w in expected.items():
        assert torch.equal(got[name], w), name


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_logits_and_greedy_tokens_equal_the_dequantized_model(bases, tmp_path, kind, case):
    """Prompt logits within 1e-5 of the largest logit of transformers' on the float32 model
    of the checkpoint's values; 24 greedy tokens the same for prompts decoded together (the
    decode steps' few rows read the 4-bit codes as blocks)."""
    from transformers import AutoModelForCausalLM

    out, ref, codes = written(bases, tmp_path, kind, case)
    hf = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    model = build_model(resolve_model(out), torch.float32)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 40000, (n,), generator=g).tolist() for n in (7, 19, 12)]
    with torch.no_grad():
        want = hf(torch.tensor([prompts[1]])).logits[0]
    got = PagedHarness(model, block_size=4).step({0: prompts[1]}, every=True)[0]
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    expected = [hf_greedy(hf, p, NEW) for p in prompts]
    assert len({t for e in expected for t in e}) > 8  # the tokens wander: a wrong weight would show
    assert PagedHarness(model, block_size=4).greedy(prompts, NEW, split=4) == expected
    linears = [m for m in model.modules() if hasattr(m, "gguf")]
    if codes:  # 4-bit: every decoder linear keeps blocks (the LM head is dense)
        blocks = [m.gguf for m in linears if m.gguf is not None]
        assert len(blocks) == 4 * len(model.layers)
        assert all(isinstance(b, GGUFLinear) for b in blocks)
        # activation order permutes the inputs of layers with more than one group
        assert any(isinstance(b.blocks, PermutedBlocks) for b in blocks) == case[3]
        # a layer whose linears all keep their input order runs its decode steps as one C++ call
        for layer in model.layers:
            linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
            plain = not any(isinstance(m.gguf.blocks, PermutedBlocks) for m in linears)
            assert isinstance(layer.fused, FusedDecodeLayer) == plain


def test_blocks_are_taken_by_small_steps_only(bases, tmp_path):
    """A step of up to MAX_ROWS rows multiplies the codes (aiolm::gguf_linear), a larger one
    the dense weights; both give the checkpoint's values up to the order of the sums."""
    from safetensors.torch import load_file

    out, ref, _ = written(bases, tmp_path, "llama", ("gptq", 128, True, True))
    model = build_model(resolve_model(out), torch.float32)
    layer = model.layers[0].mlp.down_proj
    w = load_file(ref / "model.safetensors")["model.layers.0.mlp.down_proj.weight"]
    blocks = layer.gguf.blocks.weight
    calls = []
    real = blocks.linear
    object.__setattr__(blocks, "linear", lambda *a: calls.append(1) or real(*a))
    for rows in (1, MAX_ROWS, MAX_ROWS + 1, 40):
        x = torch.randn(rows, w.shape[1])
        before = len(calls)
        y = layer(x)
        assert len(calls) - before == (1 if rows <= MAX_ROWS else 0), rows
        torch.testing.assert_close(y, x @ w.t(), rtol=1e-5, atol=1e-4)


def test_permutation_is_read_from_g_idx():
    """Groups scattered over the inputs become blocks of sorted inputs with x gathered to
    match; tensors fused into one layer with different orders get no blocks (dense only)."""
    g = torch.Generator().manual_seed(0)
    n, k = 16, 128
    group = torch.randperm(k, generator=g) // 32

    def codes(grp):
        return Int4Codes(
            torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
            torch.rand(n, 4, generator=g) + 0.1,
            torch.randint(0, 16, (n, 4), generator=g).float(),
            grp,
        )

    a, b = codes(group), codes(group)
    blocks = codes_as_blocks([a, b])
    assert isinstance(blocks, PermutedBlocks)
    x = torch.randn(3, k, generator=g)
    want = x @ torch.cat([a.dense(), b.dense()]).t()
    torch.testing.assert_close(blocks.linear(x), want, rtol=1e-5, atol=1e-4)
    # the same codes read as if the groups were contiguous give other values
    plain = codes_as_blocks([Int4Codes(a.codes, a.scale, a.zero, torch.arange(k) // 32)])
    assert isinstance(plain, GGUFWeight)
    assert (plain.linear(x) - want[:, :n]).abs().max() > 1e-2
    other = codes(torch.randperm(k, generator=g) // 32)
    assert codes_as_blocks([a, other]) is None
    # a group of 48 inputs would split blocks of 32
    assert codes_as_blocks([codes(torch.arange(k).clamp(max=95) // 48)]) is None


def test_awq_order_matters():
    """AutoAWQ's interleaved nibble order is what the reader undoes: the same words read in
    sequential order are another weight (so the parity tests above would fail)."""
    from aiolm.quant.checkpoint_formats import int4_codes

    g = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (64, 32), generator=g)  # [K, N]
    z = torch.randint(0, 16, (1, 32), generator=g)
    s = torch.rand(1, 32, generator=g).half()
    quant = WeightQuant("awq", 4, -1)
    parts = {"qweight": pack_cols(q, AWQ_ORDER), "qzeros": pack_cols(z, AWQ_ORDER), "scales": s}
    c = int4_codes(quant, parts, "layer")
    assert torch.equal(c.codes.long(), q.t())
    assert torch.equal(c.zero.long(), z.t())
    wrong = {**parts, "qweight": pack_cols(q)}  # sequential order
    assert not torch.equal(int4_codes(quant, wrong, "layer").codes.long(), q.t())


def test_gptq_v1_zero_point_zero_wraps_back():
    """GPTQ v1 stores z - 1 in four bits: a group with no negative weights has z = 0, stored as
    15, and reads back as 0 (AutoGPTQ's own dequantization wraps), not 16."""
    from aiolm.quant.checkpoint_formats import int4_codes

    w = torch.rand(16, 64, generator=torch.Generator().manual_seed(2))  # all positive: z = 0
    c = quantize4(w, 32, sym=False, scale_dtype=torch.float16)
    assert (c.zero == 0).all()
    got = int4_codes(WeightQuant("gptq", 4, 32, zero_offset=1), gptq_tensors(c), "layer")
    assert torch.equal(got.dense(), c.dense())


@pytest.mark.parametrize(
    ("actorder", "by_g_idx"),
    [("group", True), ("dynamic", True), (True, True), ("weight", False), ("static", False), (None, False)],
)
def test_compressed_tensors_actorder_aliases(actorder, by_g_idx):
    """compressed-tensors spells activation order "group" or its aliases true and "dynamic"
    (then weight_g_idx is read), and reordering at quantization only "weight" or "static"."""
    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "actorder": actorder}
    groups = {"g": {"weights": weights}}
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": groups}
    assert read_quantization({"quantization_config": qc}).act_order is by_g_idx


def test_gptq_folder_with_a_separate_quantize_config(bases, tmp_path):
    """Older AutoGPTQ folders keep the format in quantize_config.json, not config.json; read
    as dense, their packed tensors would not load."""
    out, ref, _ = written(bases, tmp_path, "llama", ("gptq", 128, True, True))
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    del qc["quant_method"]  # AutoGPTQ's file does not say it
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "quantize_config.json").write_text(json.dumps(qc))
    source = resolve_model(out)
    assert source.config.quantization == WeightQuant("gptq", 4, 128, act_order=True, zero_offset=1)
    from safetensors.torch import load_file

    expected = load_file(ref / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    got = dict(iter_weights(source, lazy=True))[name][...]
    assert torch.equal(got, expected[name])
    # errors name the file that holds what is wrong
    (out / "quantize_config.json").write_text(json.dumps({**qc, "bits": 8}))
    with pytest.raises(ModelLoadError, match=r"quantize_config\.json: quantization_config \(gptq\): 8-bit"):
        resolve_model(out)
    (out / "quantize_config.json").write_text(json.dumps(qc))
    (out / "config.json").write_text(json.dumps({**cfg, "rope_scaling": {"type": "dynamic", "factor": 2.0}}))
    with pytest.raises(ModelLoadError, match=r"/config\.json: rope_scaling type 'dynamic'"):
        resolve_model(out)


@pytest.mark.parametrize(
    "case",
    [("ct4", 32, True, False), ("ct4", 64, False, False), ("ct4", -1, True, False), ("ct_fp8", None, True, False)],
    ids=case_id,
)
def test_compressed_tensors_reads_the_tests_files_alike(bases, tmp_path, case):
    """compressed-tensors itself decompresses the files the tests write to the values aiolm
    loads (rounded to the scales' dtype, in which it computes): its layouts are what the
    quantizer writes."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file

    out, ref, _ = written(bases, tmp_path, "llama", case)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["group_0"]
    scheme = QuantizationScheme.model_validate(group)
    compressor = BaseCompressor.get_value_from_registry(qc["format"])
    tensors = load_file(out / "model.safetensors")
    expected = load_file(ref / "model.safetensors")
    layers = {n.rpartition(".")[0] for n in tensors if n.endswith(("weight_packed", "weight_scale"))}
    assert len(layers) == 7 * 2
    for layer in sorted(layers):
        local = {n.removeprefix(layer + "."): t for n, t in tensors.items() if n.startswith(layer + ".")}
        theirs = compressor.decompress(local, scheme)["weight"]
        # they multiply in the scale's dtype: the exact float32 values, rounded once to it
        assert torch.equal(theirs, expected[layer + ".weight"].to(theirs.dtype)), layer


# -- what is refused ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("qc", "named"),
    [
        ({"quant_method": "bitsandbytes"}, "'bitsandbytes'"),
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "8-bit"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 48}, "group_size 48"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "'marlin'"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "'gemv'"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "naive-quantized",
                "config_groups": {"g": {"weights": {}}},
            },
            "'naive-quantized'",
        ),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}, "config_groups"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "tensor"}}},
            },
            "'tensor'",
        ),
        ({"quant_method": "gptq", "bits": 4, "is_marlin_format": True}, "is_marlin_format"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "channel"}}},
                "sparsity_config": {"format": "sparse-bitmask"},
            },
            "'sparse-bitmask'",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {
                    "g": {"weights": {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": False}}
                },
            },
            "asymmetric fp8",
        ),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "'e5m2'"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ],
)
def test_unsupported_quantization_is_a_load_error_naming_it(qc, named):
    with pytest.raises(ModelLoadError, match="quantization_config") as e:
        read_quantization({"quantization_config": qc})
    assert named in str(e.value)


def test_unsupported_quantization_fails_when_the_folder_is_read(bases, tmp_path):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(bases["llama"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "hqq"}}))
    with pytest.raises(ModelLoadError, match="'hqq' is not supported"):
        resolve_model(folder)


@pytest.mark.parametrize(
    ("drop", "change", "named"),
    [
        ("model.layers.1.mlp.down_proj.qzeros", None, "model.layers.1.mlp.down_proj.qzeros: missing"),
        (None, ("model.layers.0.self_attn.o_proj.scales", lambda t: t[:2]), "model.layers.0.self_attn.o_proj"),
        (None, ("model.layers.0.mlp.up_proj.g_idx", lambda t: t[:-8]), "model.layers.0.mlp.up_proj: g_idx"),
        # desc_act without g_idx: contiguous groups would load the wrong scales
        ("model.layers.0.mlp.up_proj.g_idx", None, "model.layers.0.mlp.up_proj.g_idx: missing"),
    ],
)
def test_missing_or_misshapen_tensors_fail_naming_them(bases, tmp_path, drop, change, named):
    from safetensors.torch import load_file, save_file

    out, _, _ = written(bases, tmp_path, "llama", ("gptq", 32, True, True))
    tensors = load_file(out / "model.safetensors")
    if drop:
        del tensors[drop]
    if change:
        tensors[change[0]] = change[1](tensors[change[0]]).contiguous()
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(ModelLoadError) as e:
        build_model(resolve_model(out), torch.float32)
    assert named in str(e.value)
