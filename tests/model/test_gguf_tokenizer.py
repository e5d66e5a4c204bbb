"""GGUF tokenizers as llama.cpp reads them: a byte-level file's control tokens whole at their own
ids (DeepSeek's), pre-tokenizers that would split otherwise refused, and the end-of-generation
tokens llama.cpp knows by their text. Tiny files written here: one layer, hidden size 8."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from transformers.convert_slow_tokenizer import bytes_to_unicode

from aiolm.checkpoint.gguf_convert import _turn_end_ids
from aiolm.checkpoint.source import resolve_model
from aiolm.errors import ModelLoadError

BYTES = list(bytes_to_unicode().values())  # the byte-level alphabet, ids 0..255
DEEPSEEK = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% else %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)


def _write(
    path: Path,
    tokens: list[str],
    types: list[int],
    pre: str | None,
    bos: int,
    eos: int,
    model: str = "gpt2",
    merges: tuple[str, ...] = ("h i",),
    scores: list[float] | None = None,
    add_space_prefix: bool | None = None,
) -> Path:
    hidden, vocab = 8, len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if model == "gpt2":
        w.add_token_merges(list(merges))
    if scores is not None:
        w.add_token_scores(scores)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(True)
    w.add_chat_template(TEMPLATE)
    rng = np.random.default_rng(0)

    def tensor(name: str, *shape: int) -> None:
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32) * 0.02)

    tensor("token_embd.weight", vocab, hidden)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(hidden, np.float32))
    for name in ("q", "k", "v", "output"):
        tensor(f"blk.0.attn_{name}.weight", hidden, hidden)
    tensor("blk.0.ffn_gate.weight", 16, hidden)
    tensor("blk.0.ffn_up.weight", 16, hidden)
    tensor("blk.0.ffn_down.weight", hidden, 16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _deepseek(folder: Path, pre: str = "deepseek-r1-qwen") -> Path:
    tokens = [*BYTES, "hi", *DEEPSEEK, "<|eot_id|>"]
    types = [1] * (len(BYTES) + 1) + [3] * (len(DEEPSEEK) + 1)
    folder.mkdir(parents=True, exist_ok=True)
    return _write(folder / "m.gguf", tokens, types, pre, tokens.index(DEEPSEEK[0]), tokens.index(DEEPSEEK[1]))


def test_control_tokens_outside_the_byte_alphabet_keep_their_ids(tmp_path, monkeypatch):
    """DeepSeek-R1 distills' files: transformers made their BOS and EOS new ids past the vocabulary
    (every request failed, "token id 263 is outside the vocabulary") and cut <｜User｜> into bytes.
    llama.cpp reads the prompt below as [257, 259, 256, 260]."""
    monkeypatch.setenv("AIOLM_CACHE_DIR", str(tmp_path / "cache"))
    src = resolve_model(_deepseek(tmp_path / "ds"))
    tok = src.load_tokenizer()
    assert len(tok) == len(BYTES) + 6 and (tok.bos_token_id, tok.eos_token_id) == (257, 258)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert tok.encode(prompt, add_special_tokens=False) == [257, 259, 256, 260]
    assert tok.encode("hi") == [257, 256]  # the file's add_bos
    assert tok.decode([256, 258], skip_special_tokens=True) == "hi"
    assert tok.decode([256, 258]) == "hi<｜end▁of▁sentence｜>"
    assert src.eos_token_ids == (258, 261)  # and <|eot_id|>, which llama.cpp knows by its text


def test_a_pre_tokenizer_that_would_split_otherwise_is_refused(tmp_path, monkeypatch):
    """deepseek-coder's regex keeps "\\n\\n\\n" apart where GPT-2's, which transformers falls back to,
    joins it: such files were served, tokenized otherwise than llama.cpp tokenizes them."""
    monkeypatch.setenv("AIOLM_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.pre 'deepseek-coder' is not supported"):
        resolve_model(_deepseek(tmp_path / "coder", pre="deepseek-coder"))


def test_end_of_generation_tokens_found_by_their_text(tmp_path):
    """A Llama 3.1 file seldom names <|eom_id|>, and a Qwen file never its <|endoftext|>: llama.cpp
    stops at the tokens it knows by their text, beside the EOS."""
    path = _write(
        tmp_path / "m.gguf",
        [*BYTES, "hi", "<|end_of_text|>", "<|eom_id|>", "<|eot_id|>", "<|im_start|>"],
        [1] * 257 + [3] * 4,
        "llama-bpe",
        257,
        259,
    )
    assert _turn_end_ids(gguf.GGUFReader(str(path)), "llama") == [257, 258, 259]


def test_llama3_words_in_the_vocabulary_are_whole(tmp_path, monkeypatch):
    """llama.cpp's Llama 3 pre-tokenizers (and Llama 3's own tokenizer.json) ignore the merges
    for a word the vocabulary holds whole: "abc" is one token, not "ab" + "c"."""
    monkeypatch.setenv("AIOLM_CACHE_DIR", str(tmp_path / "cache"))
    tokens = [*BYTES, "ab", "abc", "<|begin_of_text|>", "<|eot_id|>"]
    folder = tmp_path / "l3"
    folder.mkdir()
    path = _write(folder / "m.gguf", tokens, [1] * 258 + [3, 3], "llama-bpe", 258, 259, merges=("a b",))
    tok = resolve_model(path).load_tokenizer()
    assert tok.convert_ids_to_tokens(tok.encode("abc", add_special_tokens=False)) == ["abc"]


def test_a_sentencepiece_file_without_a_space_prefix(tmp_path, monkeypatch):
    """add_space_prefix false (Yi's files): llama.cpp puts no space before the text, so "hello"
    is "he" + "llo", not "▁hello"; transformers' builder ignored the flag."""
    monkeypatch.setenv("AIOLM_CACHE_DIR", str(tmp_path / "cache"))
    pieces = "▁ e h l o w r d ▁h ▁w he ll llo ello ▁he ▁hel ▁hello ▁wo ▁wor ▁world or ld".split()
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-1.0 - i for i in range(len(pieces))]
    got = {}
    for prefix in (True, False):
        folder = tmp_path / f"spm-{prefix}"
        folder.mkdir()
        path = _write(folder / "m.gguf", tokens, types, None, 1, 2, "llama", scores=scores, add_space_prefix=prefix)
        tok = resolve_model(path).load_tokenizer()
        ids = tok.encode("hello world", add_special_tokens=False)
        got[prefix] = (tok.convert_ids_to_tokens(ids), tok.decode(ids))
    assert got == {True: (["▁hello", "▁world"], "hello world"), False: (["he", "llo", "▁world"], "hello world")}
