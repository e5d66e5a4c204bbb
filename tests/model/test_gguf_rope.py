"""What a GGUF file says about RoPE scaling and end-of-turn tokens, read into config.json and
generation_config.json (aiolm/checkpoint/gguf_convert.py).

llama.cpp's converter stores Llama 3.1's scaling only as the ``rope_freqs`` tensor of
per-frequency divisors; linear and YaRN scaling as ``rope.scaling.*`` fields. A file read as
unscaled answers wrong past the first positions, so each is read or refused by name. That the
scalings read here compute as transformers computes them is tests/model/test_loader.py's
Hugging Face folder cases (llama3 and yarn against transformers' logits).
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest

from aiolm.checkpoint.gguf_convert import _turn_end_ids, generation_ends, read_hf_config
from aiolm.errors import ModelLoadError

HEAD_DIM, THETA = 128, 500000.0


def llama_cpp_rope_freqs(factor: float, low: float, high: float, length: int) -> np.ndarray:
    """The divisors llama.cpp's convert_hf_to_gguf.py writes for a ``llama3`` rope_scaling,
    computed here from the formula as that script states it."""
    out = []
    for i in range(0, HEAD_DIM, 2):
        wavelen = 2 * math.pi * THETA ** (i / HEAD_DIM)
        if wavelen < length / high:
            out.append(1.0)
        elif wavelen > length / low:
            out.append(factor)
        else:
            smooth = (length / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write(path: Path, fields: dict | None = None, rope_freqs: np.ndarray | None = None, eot: dict | None = None):
    """A llama GGUF with the metadata read_hf_config needs and no weights but ``rope_freqs``."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(131072)
    w.add_embedding_length(HEAD_DIM * 2)
    w.add_feed_forward_length(512)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(THETA)
    for key, value in (fields or {}).items():
        (w.add_string if isinstance(value, str) else w.add_float32)(f"llama.{key}", value)
    for key, value in (eot or {}).items():
        w.add_uint32(f"tokenizer.ggml.{key}", value)
    w.add_tensor("output_norm.weight", np.ones(HEAD_DIM * 2, np.float32))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf.GGUFReader(str(path))


def config_of(tmp_path: Path, **kw) -> dict:
    path = tmp_path / "m.gguf"
    return read_hf_config(write(path, **kw), path)


@pytest.mark.parametrize(
    "factor, low, high, length",
    [(8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192), (16.0, 1.0, 8.0, 4096)],
    ids=["llama-3.1", "llama-3.2", "other-ramp"],
)
def test_rope_freqs_become_the_llama3_scaling_that_wrote_them(tmp_path, factor, low, high, length):
    cfg = config_of(tmp_path, rope_freqs=llama_cpp_rope_freqs(factor, low, high, length))
    assert cfg["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": length,
    }


def test_rope_scaling_fields_become_config_json_s(tmp_path):
    linear = config_of(tmp_path, fields={"rope.scaling.type": "linear", "rope.scaling.factor": 4.0})
    assert linear["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    yarn = config_of(
        tmp_path,
        fields={
            "rope.scaling.type": "yarn",
            "rope.scaling.factor": 4.0,
            "rope.scaling.original_context_length": 32768.0,
        },
    )
    assert yarn["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert config_of(tmp_path, fields={"rope.scaling.type": "none"})["rope_scaling"] is None
    # a factor without a type is linear, as llama.cpp reads it, and so is older files' key
    for key in ("rope.scaling.factor", "rope.scale_linear"):
        assert config_of(tmp_path, fields={key: 2.0})["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(fields={"rope.scaling.type": "longrope", "rope.scaling.factor": 4.0}), "'longrope' is not supported"),
        (dict(fields={"rope.scaling.type": "linear"}), "needs a positive rope.scaling.factor"),
        (dict(rope_freqs=np.linspace(1, 3, HEAD_DIM // 2, dtype=np.float32)[::-1].copy()), "not a Llama 3"),
        (dict(rope_freqs=np.ones(HEAD_DIM, np.float32)), "has 128 values; head_dim 128 needs 64"),
        (
            dict(
                fields={"rope.scaling.type": "linear", "rope.scaling.factor": 2.0},
                rope_freqs=np.ones(64, np.float32),
            ),
            "both rope_freqs.weight and rope.scaling.type",
        ),
        (
            dict(fields={"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.attn_factor": 2.0}),
            "rope.scaling.attn_factor 2.0 is not supported",
        ),
    ],
    ids=["unknown-type", "no-factor", "odd-divisors", "wrong-length", "both", "yarn-attn-factor"],
)
def test_a_scaling_that_cannot_be_stated_is_refused_by_name(tmp_path, kw, message):
    with pytest.raises(ModelLoadError, match=message):
        config_of(tmp_path, **kw)


def test_end_of_turn_and_message_tokens_end_generation(tmp_path):
    """Llama 3's files name <|eot_id|> and <|eom_id|> besides eos; llama.cpp stops on each."""
    path = tmp_path / "m.gguf"
    assert _turn_end_ids(write(path, eot={"eot_token_id": 9, "eom_token_id": 8}), "llama") == [9, 8]
    assert _turn_end_ids(write(path), "llama") == []
    assert generation_ends(2, [9, 8]) == [2, 9, 8] and generation_ends(2, [2]) == 2 and generation_ends(2, []) == 2
    assert generation_ends(None, [9]) == [9] and generation_ends(None, []) is None  # no EOS: the turn end stands
