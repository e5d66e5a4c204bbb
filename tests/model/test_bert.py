"""aiolm's BERT encoder (model/bert.py) against transformers on tiny random folders
(tests/pooling_models.py), and decoders built for pooling (no LM head).

The batch is flat: requests of different lengths back to back, some with token types
(sentence pairs), through each CPU attention backend's ``forward_encoder``; every token's
final hidden state must match transformers' padded, masked batch.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from aiolm.attention.metadata import AttentionMetadata
from aiolm.checkpoint.source import resolve_model
from aiolm.errors import ModelLoadError
from aiolm.model.registry import build_model
from pooling_models import bert_cross_encoder, bert_embedder, qwen3_embedder

TEXTS = ["the cat sat on the mat", "paris", "what is the capital of france", "a dog ran in the park and the bird flew"]
PAIRS = [("what is paris", "paris is the capital of france"), ("fish", "the fish swam in the sea")]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("pooling")
    return {
        "embedder": bert_embedder(root / "bert"),
        "cross": bert_cross_encoder(root / "cross", num_labels=3),
    }


def _batch(tokenizer, with_pairs: bool):
    """Token ids and token types of TEXTS (and PAIRS), one list per request."""
    enc = [tokenizer(t) for t in TEXTS]
    if with_pairs:
        enc += [tokenizer(a, b) for a, b in PAIRS]
    return [e["input_ids"] for e in enc], [e["token_type_ids"] for e in enc]


def _aiolm_hidden(model, ids, types):
    """Final hidden states of every token, the requests back to back in one step."""
    lens = [len(x) for x in ids]
    meta = AttentionMetadata.build(lens, lens, [[0] * -(-n // 16) for n in lens], 16)
    flat = torch.tensor([t for x in ids for t in x])
    pos = torch.tensor([p for n in lens for p in range(n)])
    tt = torch.tensor([t for x in types for t in x])
    return model(flat, pos, [], meta, token_type_ids=tt)


def _hf_hidden(hf, ids, types):
    """transformers' hidden states over a right-padded batch, unpadded back to back."""
    width = max(len(x) for x in ids)
    pad = torch.zeros(len(ids), width, dtype=torch.long)
    tt, mask = pad.clone(), pad.clone()
    for i, (x, t) in enumerate(zip(ids, types)):
        pad[i, : len(x)], tt[i, : len(t)], mask[i, : len(x)] = torch.tensor(x), torch.tensor(t), 1
    with torch.no_grad():
        out = hf(input_ids=pad, token_type_ids=tt, attention_mask=mask, output_hidden_states=True)
    return out, torch.cat([out.hidden_states[-1][i, : len(x)] for i, x in enumerate(ids)])


@pytest.mark.parametrize("attention", ["torch", "cpu"])
def test_hidden_states_match_transformers_on_a_mixed_batch(folders, attention):
    from transformers import BertModel

    source = resolve_model(folders["embedder"])
    assert source.config.encoder_only and source.config.architecture == "bert"
    ids, types = _batch(source.load_tokenizer(), with_pairs=True)
    assert any(1 in t for t in types) and min(len(x) for x in ids) == 3  # pairs, and "[CLS] paris [SEP]"
    model = build_model(source, torch.float32, attention=attention)
    assert model.is_encoder_only and not hasattr(model, "classify")
    got = _aiolm_hidden(model, ids, types)
    _, want = _hf_hidden(BertModel.from_pretrained(str(folders["embedder"])).eval(), ids, types)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_one_request_alone_equals_it_in_a_batch(folders):
    source = resolve_model(folders["embedder"])
    ids, types = _batch(source.load_tokenizer(), with_pairs=True)
    model = build_model(source, torch.float32)
    batch = _aiolm_hidden(model, ids, types)
    alone = _aiolm_hidden(model, ids[2:3], types[2:3])
    start = sum(len(x) for x in ids[:2])
    torch.testing.assert_close(alone, batch[start : start + len(ids[2])], atol=1e-5, rtol=1e-5)


def test_mean_pooled_and_normalised_equals_sentence_transformers(folders):
    """The folder's own pooling (mean over tokens, then unit length), by hand over our states."""
    from sentence_transformers import SentenceTransformer

    source = resolve_model(folders["embedder"])
    ids, types = _batch(source.load_tokenizer(), with_pairs=False)
    hidden = _aiolm_hidden(build_model(source, torch.float32), ids, types)
    pooled, at = [], 0
    for x in ids:
        pooled.append(hidden[at : at + len(x)].mean(0))
        at += len(x)
    ours = torch.nn.functional.normalize(torch.stack(pooled), dim=-1)
    st = SentenceTransformer(str(folders["embedder"]), device="cpu")
    want = torch.from_numpy(st.encode(TEXTS))
    assert torch.nn.functional.cosine_similarity(ours, want).min() >= 0.99999


@pytest.mark.parametrize("attention", ["torch", "cpu"])
def test_cross_encoder_classify_equals_transformers_logits(folders, attention):
    from transformers import BertForSequenceClassification

    source = resolve_model(folders["cross"])
    assert source.config.architecture == "bert_classifier" and source.config.num_labels == 3
    ids, types = _batch(source.load_tokenizer(), with_pairs=True)
    model = build_model(source, torch.float32, attention=attention)
    hidden = _aiolm_hidden(model, ids, types)
    cls_rows = torch.tensor([0, *torch.tensor([len(x) for x in ids]).cumsum(0)[:-1].tolist()])
    logits = model.classify(hidden[cls_rows])
    assert logits.dtype == torch.float32 and logits.shape == (len(ids), 3)
    hf = BertForSequenceClassification.from_pretrained(str(folders["cross"])).eval()
    out, want_hidden = _hf_hidden(hf, ids, types)
    torch.testing.assert_close(hidden, want_hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, out.logits, atol=1e-5, rtol=1e-5)


def test_a_one_label_cross_encoder_scores_as_sentence_transformers(tmp_path):
    """CrossEncoder.predict of one label is the sigmoid of the logit."""
    from sentence_transformers import CrossEncoder

    folder = bert_cross_encoder(tmp_path / "ce1", num_labels=1)
    source = resolve_model(folder)
    tok = source.load_tokenizer()
    enc = [tok(a, b) for a, b in PAIRS]
    ids, types = [e["input_ids"] for e in enc], [e["token_type_ids"] for e in enc]
    model = build_model(source, torch.float32)
    hidden = _aiolm_hidden(model, ids, types)
    scores = torch.sigmoid(model.classify(hidden[torch.tensor([0, len(ids[0])])])[:, 0])
    want = torch.tensor(CrossEncoder(str(folder), device="cpu").predict(PAIRS))
    torch.testing.assert_close(scores, want, atol=1e-5, rtol=1e-5)


def _edited_copy(src, dst, edit):
    """``src`` copied to ``dst`` with its weights passed through ``edit`` (a dict in place)."""
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    edit(weights)
    save_file(weights, str(dst / "model.safetensors"))
    return dst


def test_a_missing_tensor_is_named(folders, tmp_path):
    name = "bert.encoder.layer.1.attention.self.key.bias"
    folder = _edited_copy(folders["cross"], tmp_path / "missing", lambda w: w.pop(name))
    with pytest.raises(ModelLoadError, match=r"missing 1 weights.*encoder\.layer\.1\.attention\.self\.key\.bias"):
        build_model(resolve_model(folder), torch.float32)
    head = _edited_copy(folders["cross"], tmp_path / "no-head", lambda w: w.pop("classifier.weight"))
    with pytest.raises(ModelLoadError, match=r"classifier\.weight"):
        build_model(resolve_model(head), torch.float32)


def test_a_misshapen_tensor_is_named(folders, tmp_path):
    name = "encoder.layer.0.intermediate.dense.weight"

    def cut(w):
        w[name] = w[name][:-1]

    folder = _edited_copy(folders["embedder"], tmp_path / "misshapen", cut)
    with pytest.raises(ModelLoadError, match=rf"{name}.*shape \(127, 64\), expected \(128, 64\)"):
        build_model(resolve_model(folder), torch.float32)


def test_an_unknown_tensor_is_named(folders, tmp_path):
    def add(w):
        w["encoder.layer.0.attention.self.distance_embedding.weight"] = torch.zeros(3, 64)

    folder = _edited_copy(folders["embedder"], tmp_path / "unknown", add)
    with pytest.raises(ModelLoadError, match="distance_embedding"):
        build_model(resolve_model(folder), torch.float32)


def test_config_refuses_what_the_encoder_does_not_implement(folders, tmp_path):
    folder = shutil.copytree(folders["embedder"], tmp_path / "relative")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["position_embedding_type"] = "relative_key"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="position_embedding_type 'relative_key'"):
        resolve_model(folder)


def test_qwen3_embedder_folder_builds_for_pooling_without_lm_head(tmp_path):
    """A sentence-transformers Qwen3 folder holds the bare decoder (no "model." prefix, no
    lm_head); built for pooling it loads, and its last token's state, normalised, is what
    sentence-transformers embeds. Built to generate, it lacks its LM head."""
    from sentence_transformers import SentenceTransformer

    from paged import PagedHarness

    folder = qwen3_embedder(tmp_path / "qwen3")
    source = resolve_model(folder)
    assert not source.config.encoder_only
    model = build_model(source, torch.float32, pooling=True)
    assert model.lm_head is None
    with pytest.raises(RuntimeError, match="built for pooling"):
        model.compute_logits(torch.zeros(1, source.config.hidden_size))
    tok = source.load_tokenizer()
    ids = [tok(t)["input_ids"] for t in TEXTS]
    h = PagedHarness(model)
    lens = [len(x) for x in ids]
    meta = AttentionMetadata.build(lens, lens, [h._ensure(i, n) for i, n in enumerate(lens)], h.block_size)
    flat = torch.tensor([t for x in ids for t in x])
    pos = torch.tensor([p for n in lens for p in range(n)])
    hidden = model(flat, pos, h.caches, meta)
    last = torch.tensor(lens).cumsum(0) - 1
    ours = torch.nn.functional.normalize(hidden[last], dim=-1)
    want = torch.from_numpy(SentenceTransformer(str(folder), device="cpu").encode(TEXTS))
    assert torch.nn.functional.cosine_similarity(ours, want).min() >= 0.99999
    assert not source.config.tie_word_embeddings
    with pytest.raises(KeyError, match="lm_head"):
        build_model(source, torch.float32)


def _xlm_roberta(folder, classifier: bool):
    """A tiny random XLM-RoBERTa (positions from pad_token_id + 1, one token type) saved as
    transformers saves it: XLMRobertaModel bare, the classifier under "roberta."."""
    from transformers import XLMRobertaConfig, XLMRobertaForSequenceClassification, XLMRobertaModel

    torch.manual_seed(3)
    cfg = XLMRobertaConfig(
        vocab_size=90,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=66,
        type_vocab_size=1,
        pad_token_id=1,
        num_labels=2,
    )
    model = (XLMRobertaForSequenceClassification if classifier else XLMRobertaModel)(cfg).eval()
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if name.endswith("LayerNorm.weight") else 0.0))
    model.save_pretrained(str(folder))
    return model


@pytest.mark.parametrize("classifier", [False, True], ids=["model", "classifier"])
def test_xlm_roberta_matches_transformers(tmp_path, classifier):
    hf = _xlm_roberta(tmp_path / "xlmr", classifier)
    source = resolve_model(tmp_path / "xlmr")
    assert source.config.encoder_only and source.config.position_offset == 2
    assert source.config.max_position_embeddings == 64  # tokens a sequence may hold
    g = torch.Generator().manual_seed(5)
    lens = [5, 1, 64, 9]  # 64: the last row of the position table
    ids = [[0] + (torch.randint(3, 90, (n - 1,), generator=g)).tolist() for n in lens]
    types = [[0] * n for n in lens]
    model = build_model(source, torch.float32)
    hidden = _aiolm_hidden(model, ids, types)
    width = max(lens)
    pad = torch.ones(len(ids), width, dtype=torch.long)
    mask = torch.zeros_like(pad)
    for i, x in enumerate(ids):
        pad[i, : len(x)], mask[i, : len(x)] = torch.tensor(x), 1
    with torch.no_grad():
        out = hf(input_ids=pad, attention_mask=mask, output_hidden_states=True)
    want = torch.cat([out.hidden_states[-1][i, :n] for i, n in enumerate(lens)])
    torch.testing.assert_close(hidden, want, atol=1e-5, rtol=1e-5)
    if classifier:
        firsts = torch.tensor([0, *torch.tensor(lens).cumsum(0)[:-1].tolist()])
        torch.testing.assert_close(model.classify(hidden[firsts]), out.logits, atol=1e-5, rtol=1e-5)
    else:
        assert not hasattr(model, "classify")


def test_tensor_parallel_ranks_together_equal_one_rank(folders):
    """Two ranks in two threads, each building its half of the encoder (heads, intermediate
    features and vocabulary split; the all-reduce sums through a barrier), give what one
    rank gives alone."""
    import threading

    from aiolm.distributed.parallel_state import TPGroup, get_tp_group, set_tp_group

    source = resolve_model(folders["cross"])
    ids, types = _batch(source.load_tokenizer(), with_pairs=True)
    whole = build_model(source, torch.float32)
    want = _aiolm_hidden(whole, ids, types)
    barrier, slots = threading.Barrier(2, timeout=30), [None, None]

    def reducer(rank):
        def all_reduce(x):
            slots[rank] = x
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()  # both have read before either writes again
            return total

        return all_reduce

    before = get_tp_group()
    ranks = []
    try:
        for r in range(2):
            set_tp_group(TPGroup(rank=r, world_size=2, all_reduce_fn=reducer(r), all_gather_fn=None))
            ranks.append(build_model(source, torch.float32))
    finally:
        set_tp_group(before)
    outs = [None, None]

    def run(r):
        outs[r] = _aiolm_hidden(ranks[r], ids, types)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert ranks[0].layers[0].attn.num_heads == 2
    for got in outs:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    firsts = torch.tensor([0, *torch.tensor([len(x) for x in ids]).cumsum(0)[:-1].tolist()])
    torch.testing.assert_close(ranks[1].classify(outs[1][firsts]), whole.classify(want[firsts]), atol=1e-5, rtol=1e-5)
