"""GGUF mixtures of experts (Qwen3-MoE, Qwen2-MoE, Mixtral) converted to Hugging Face folders.

Each family's tiny random transformers model is written as llama.cpp's converter writes it
(tests/gguf_moe_writer.py: stacked experts, F32 router, Mixtral's permuted Q/K) and converted
with aiolm's converter. Checked against the model itself: every tensor of the converted
model.safetensors is the one save_pretrained would write (bit for bit from F32 files, within
Q8_0's rounding from Q8_0 ones); transformers reads the converted config with the original's
MoE fields and, loading the folder, gives the original's logits and greedy tokens; and a file
with an expert tensor missing or of the wrong shape is refused with the tensor named.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from aiolm.checkpoint.gguf_convert import convert_gguf, hf_expert_names, hf_name
from aiolm.errors import ModelLoadError
from gguf_moe_writer import VOCAB, hub_state_dict, tiny_moe_model, write_moe_gguf
from paged import hf_greedy

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")
NEW_TOKENS = 8
PROMPT = [5, 77, 130, 9, 201, 48, 33, 260, 101]
# what transformers' config must read back as the original's, per family
MOE_FIELDS = {
    "qwen3_moe": (
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "intermediate_size",
        "norm_topk_prob",
        "decoder_sparse_step",
        "mlp_only_layers",
        "attention_bias",
        "head_dim",
    ),
    "qwen2_moe": (
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "intermediate_size",
        "norm_topk_prob",
        "decoder_sparse_step",
        "mlp_only_layers",
        "qkv_bias",
    ),
    "mixtral": ("num_local_experts", "num_experts_per_tok", "intermediate_size", "sliding_window", "head_dim"),
}
COMMON_FIELDS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "rms_norm_eps",
    "tie_word_embeddings",
)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(model_type, the original model, its save_pretrained tensors, the F32 GGUF's converted folder)."""
    model_type = request.param
    root = tmp_path_factory.mktemp(model_type)
    model = tiny_moe_model(model_type)
    write_moe_gguf(model, root / "model-F32.gguf")
    (root / "converted").mkdir()
    convert_gguf(root / "model-F32.gguf", root / "converted")
    return model_type, model, hub_state_dict(model), root / "converted"


def test_f32_file_converts_to_the_checkpoints_tensors_exactly(family):
    model_type, model, expected, folder = family
    got = load_file(str(folder / "model.safetensors"))
    assert sorted(got) == sorted(expected)
    for name, t in expected.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], t), name
    experts = [n for n in got if ".experts." in n]
    per_layer = model.config.num_experts if model_type != "mixtral" else model.config.num_local_experts
    sparse = [i for i in range(3) if i not in getattr(model.config, "mlp_only_layers", [])]
    assert len(experts) == len(sparse) * per_layer * 3


@pytest.mark.parametrize("model_type", FAMILIES)
def test_q8_0_file_converts_within_its_rounding(model_type, tmp_path):
    model = tiny_moe_model(model_type, seed=1)
    expected = hub_state_dict(model)
    write_moe_gguf(model, tmp_path / "model-Q8_0.gguf", "Q8_0")
    (tmp_path / "out").mkdir()
    convert_gguf(tmp_path / "model-Q8_0.gguf", tmp_path / "out")
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(got) == sorted(expected)
    kept_f32 = ("mlp.gate.weight", "block_sparse_moe.gate.weight", "shared_expert_gate.weight")
    for name, t in expected.items():
        if t.ndim == 1 or name.endswith(kept_f32):
            assert torch.equal(got[name], t), name  # norms, routers and the shared expert's gate stay F32
            continue
        # Q8_0: blocks of 32 along a row, step amax / 127 in float16: the error is at most half
        # a step plus the step's float16 rounding times 127; a row from elsewhere is far off
        blocks = t.reshape(-1, 32)
        bound = blocks.abs().amax(1, keepdim=True) / 127 * 0.57 + 1e-7
        err = (got[name] - t).reshape(-1, 32).abs()
        assert (err <= bound).all() and float(err.max()) > 0, name


def test_transformers_reads_the_config_and_runs_the_folder_as_the_original(family):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model_type, model, _, folder = family
    ours, theirs = AutoConfig.from_pretrained(str(folder)), model.config
    for key in COMMON_FIELDS + MOE_FIELDS[model_type]:
        assert getattr(ours, key) == getattr(theirs, key), key
    assert ours.architectures == [type(model).__name__]  # a model built in memory has none to compare
    assert ours.rope_parameters["rope_theta"] == theirs.rope_parameters["rope_theta"]
    raw = json.loads((folder / "config.json").read_text())  # spelled as the checkpoints spell it
    assert ("num_local_experts" if model_type == "mixtral" else "num_experts") in raw
    converted = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        a = converted(torch.tensor([PROMPT])).logits
        b = model(torch.tensor([PROMPT])).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    expected = hf_greedy(model, PROMPT, NEW_TOKENS)
    assert len(set(expected)) > 1  # not one token over and over: the weights matter
    assert hf_greedy(converted, PROMPT, NEW_TOKENS) == expected
    tok = AutoTokenizer.from_pretrained(str(folder))
    assert len(tok) == VOCAB and tok.decode(tok("the cat")["input_ids"]) == "the cat"


def test_unstacked_mixtral_experts_convert_too(tmp_path):
    """llama.cpp's first Mixtral files held one tensor per expert (blk.N.ffn_gate.E.weight)."""
    model = tiny_moe_model("mixtral", seed=2)
    write_moe_gguf(model, tmp_path / "old.gguf", stacked=False)
    (tmp_path / "out").mkdir()
    convert_gguf(tmp_path / "old.gguf", tmp_path / "out")
    got, expected = load_file(str(tmp_path / "out" / "model.safetensors")), hub_state_dict(model)
    assert sorted(got) == sorted(expected)
    assert all(torch.equal(got[n], t) for n, t in expected.items())


def test_expert_names_for_the_block_side():
    """hf_name leaves stacked experts to hf_expert_names (one GGUF tensor, many HF ones)."""
    for arch in ("qwen3moe", "qwen2moe", "llama"):
        assert hf_name("blk.3.ffn_up_exps.weight", arch) is None
        assert hf_expert_names("blk.3.attn_q.weight", arch, 4) is None
    assert hf_expert_names("blk.3.ffn_up_exps.weight", "qwen3moe", 2) == [
        "model.layers.3.mlp.experts.0.up_proj.weight",
        "model.layers.3.mlp.experts.1.up_proj.weight",
    ]
    assert hf_expert_names("blk.0.ffn_down_exps.weight", "llama", 8)[7] == (
        "model.layers.0.block_sparse_moe.experts.7.w2.weight"
    )
    assert hf_name("blk.1.ffn_gate_inp.weight", "qwen2moe") == "model.layers.1.mlp.gate.weight"
    assert hf_name("blk.1.ffn_gate_inp.weight", "llama") == "model.layers.1.block_sparse_moe.gate.weight"
    assert hf_name("blk.1.ffn_gate_inp_shexp.weight", "qwen2moe") == "model.layers.1.mlp.shared_expert_gate.weight"
    assert hf_name("blk.1.ffn_gate.weight", "qwen3moe") == "model.layers.1.mlp.gate_proj.weight"  # a dense layer
    assert hf_name("blk.1.ffn_gate.2.weight", "llama") == "model.layers.1.block_sparse_moe.experts.2.w1.weight"


def _drop(target: str):
    return lambda name, arr: None if name == target else arr


def _three_experts(target: str):
    return lambda name, arr: arr[:3] if name == target else arr


def _narrow_router(target: str):
    return lambda name, arr: arr[:, :32] if name == target else arr


@pytest.mark.parametrize(
    ("model_type", "edit", "target", "says"),
    [
        ("qwen3_moe", _drop, "blk.2.ffn_up_exps.weight", "layer 2's stacked up experts) missing"),
        ("qwen3_moe", _three_experts, "blk.0.ffn_down_exps.weight", "has shape [3, 64, 32]; expected [8, 64, 32]"),
        ("qwen3_moe", _drop, "blk.1.ffn_down.weight", "missing"),  # the dense layer's
        ("qwen2_moe", _drop, "blk.1.ffn_gate_inp_shexp.weight", "shared expert gate) missing"),
        ("mixtral", _narrow_router, "blk.0.ffn_gate_inp.weight", "has shape [4, 32]; expected [4, 64]"),
        ("mixtral", _three_experts, "blk.1.ffn_gate_exps.weight", "expected [4, 32, 64]"),
    ],
)
def test_missing_or_misshapen_expert_tensor_is_refused_by_name(model_type, edit, target, says, tmp_path):
    path = tmp_path / "bad.gguf"
    write_moe_gguf(tiny_moe_model(model_type), path, edit=edit(target))
    (tmp_path / "out").mkdir()
    with pytest.raises(ModelLoadError) as e:
        convert_gguf(path, tmp_path / "out")
    assert str(path) in str(e.value) and f"tensor {target}" in str(e.value) and says in str(e.value)
    assert not (tmp_path / "out" / "config.json").exists()  # the folder is not marked complete


def test_expert_count_metadata_is_checked(tmp_path):
    """A file whose expert_used_count exceeds its expert_count cannot be routed."""
    import gguf

    model = tiny_moe_model("qwen2_moe")
    model.config.num_experts_per_tok = 5  # written as qwen2moe.expert_used_count; 4 experts
    write_moe_gguf(model, tmp_path / "bad.gguf")
    with pytest.raises(ModelLoadError, match=r"qwen2moe\.expert_count 4 and qwen2moe\.expert_used_count 5"):
        convert_gguf(tmp_path / "bad.gguf", tmp_path)
    assert gguf.GGUFReader(str(tmp_path / "bad.gguf")).fields["qwen2moe.expert_count"].contents() == 4


def test_shared_expert_gate_of_a_quantized_file_is_one_dimensional(tmp_path):
    """Quantized Qwen2-MoE files hold the shared expert's gate as [hidden]; Hugging Face's is [1, hidden]."""
    import gguf

    model = tiny_moe_model("qwen2_moe")
    write_moe_gguf(model, tmp_path / "q.gguf", "Q8_0")
    shapes = {t.name: list(t.shape) for t in gguf.GGUFReader(str(tmp_path / "q.gguf")).tensors}
    assert shapes["blk.0.ffn_gate_inp_shexp.weight"] == [64]
    assert np.array_equal(shapes["blk.0.ffn_gate_exps.weight"], [64, 32, 4])  # ggml order: cols, rows, experts


def test_make_model_writes_the_moe_bench_model(tmp_path):
    """benchmarks/make_model.py --moe --scale tiny: the float32 folder is a Qwen3-MoE transformers
    runs; the Q4_K_M file has llama.cpp's mix (fallback types where a row is not a multiple of
    256) and every tensor in it is the folder's, within 4-bit rounding (gguf-py dequantizes)."""
    import sys
    from pathlib import Path

    import gguf
    from gguf.quants import dequantize
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from make_model import MOE_SCALES, make_model, moe_parameters

    manifest = make_model(tmp_path, "tiny", formats=("f32", "q4_k_m"), moe=True)
    s = MOE_SCALES["tiny"]
    assert manifest["files"] == {"f32": "hf-float32", "q4_k_m": "model-Q4_K_M.gguf"}
    assert (manifest["parameters"], manifest["active_parameters"]) == moe_parameters(s)
    folder = load_file(str(tmp_path / "hf-float32" / "model.safetensors"))
    assert sum(t.numel() for t in folder.values()) == manifest["parameters"]
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf-float32"), dtype=torch.float32)
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.config.num_experts == s.experts
    assert model.config.norm_topk_prob and model.config.vocab_size == 49152

    reader = gguf.GGUFReader(str(tmp_path / "model-Q4_K_M.gguf"))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["output.weight"] == "Q6_K" and types["blk.0.ffn_gate_exps.weight"] == "Q4_K"
    # layer 1 of 2 is one llama.cpp gives more bits: attn_v Q6_K; ffn_down_exps' rows of 128
    # cannot be K-quants, so Q6_K falls back to Q8_0 there and layer 0's Q4_K to Q5_0
    assert (types["blk.1.attn_v.weight"], types["blk.0.attn_v.weight"]) == ("Q6_K", "Q4_K")
    assert (types["blk.1.ffn_down_exps.weight"], types["blk.0.ffn_down_exps.weight"]) == ("Q8_0", "Q5_0")
    assert types["blk.0.ffn_gate_inp.weight"] == "F32"
    seen = set()
    for t in reader.tensors:
        arr = dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(d) for d in t.shape])))
        names = hf_expert_names(t.name, "qwen3moe", s.experts) or [hf_name(t.name, "qwen3moe")]
        parts = arr if t.name.endswith("_exps.weight") else arr[None]  # stacked experts: one per slice
        for name, part in zip(names, parts):
            ref = folder[name].numpy()
            rel = np.sqrt(np.mean((part - ref) ** 2)) / max(float(ref.std()), 1e-12)
            assert rel < (0.1 if t.tensor_type.name != "F32" else 1e-7), (t.name, name, rel)
            seen.add(name)
    assert seen == set(folder)
