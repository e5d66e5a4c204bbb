"""Pooling models offline (``LLM.embed``, ``LLM.score``, ``LLM.classify``) against the
libraries their users compare with: sentence-transformers' ``SentenceTransformer.encode``
and ``CrossEncoder.predict``, and transformers' classifier logits.

Tiny random models built here and saved as sentence-transformers folders (a BERT pooling
by CLS or by the mean and normalising, a BERT cross-encoder, a Qwen3 pooling its last
token) run in real worker processes; a batch of mixed lengths, one step, equals the same
inputs one at a time.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from aiolm import LLM
from pooling_models import bert_cross_encoder, bert_embedder, qwen3_embedder

TEXTS = [
    "the cat sat on the mat",
    "a quick brown fox jumps over the lazy dog and runs far away into the green hills",
    "hello",
    "rain falls softly on the quiet town while the children sleep",
    "numbers like one two three",
]
LLM_ARGS = dict(max_model_len=128, kv_cache_memory=32 << 20, max_num_seqs=16, num_threads=1)


def _cos(a, b) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.as_tensor(a).float(), torch.as_tensor(b).float(), dim=0))


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda d: bert_embedder(d, pooling="mean"), id="bert-mean"),
        pytest.param(lambda d: bert_embedder(d, pooling="cls", normalize=False), id="bert-cls"),
        pytest.param(qwen3_embedder, id="qwen3-last"),
    ],
)
def test_embeddings_equal_sentence_transformers(build, tmp_path):
    from sentence_transformers import SentenceTransformer

    path = str(build(tmp_path))
    ref = SentenceTransformer(path, device="cpu").encode(TEXTS, convert_to_numpy=True)
    with LLM(path, runner="pooling", **LLM_ARGS) as llm:
        batch = [o.outputs.embedding for o in llm.embed(TEXTS)]
        single = [llm.embed(t)[0].outputs.embedding for t in TEXTS[:3]]
        pc = llm.engine.pooling_config
    for got, want in zip(batch, ref):
        assert len(got) == len(want)
        assert _cos(got, want) >= 0.99999
        if pc.normalize:
            assert abs(math.sqrt(sum(x * x for x in got)) - 1.0) < 1e-5
        else:  # unnormalised: the values themselves agree, not only the direction
            assert max(abs(x - float(y)) for x, y in zip(got, want)) < 1e-4
    for a, b in zip(single, batch):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5


def test_bfloat16_embeddings_stay_within_a_bfloat16_rounding_of_float32(tmp_path):
    """--dtype bfloat16 (bfloat16 matmuls where this CPU has them, float32 around them; float32
    elsewhere) keeps each embedding's direction: the opt-in speed of docs/benchmarks.md."""
    from sentence_transformers import SentenceTransformer

    path = str(bert_embedder(tmp_path, pooling="mean"))
    ref = SentenceTransformer(path, device="cpu").encode(TEXTS, convert_to_numpy=True)
    with LLM(path, runner="pooling", dtype="bfloat16", **LLM_ARGS) as llm:
        got = [o.outputs.embedding for o in llm.embed(TEXTS)]
    for g, want in zip(got, ref):
        assert len(g) == len(want) and all(isinstance(x, float) for x in g)
        assert 0.999 <= _cos(g, want)


def test_cross_encoder_scores_and_classifier_logits(tmp_path):
    """``LLM.score`` equals ``CrossEncoder.predict`` (query against each document, and pair
    by pair); ``LLM.classify`` equals transformers' logits of a three-label classifier."""
    from sentence_transformers import CrossEncoder
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    ce_path = str(bert_cross_encoder(tmp_path / "ce"))
    query = "where does the cat sit"
    want = CrossEncoder(ce_path, device="cpu").predict([(query, d) for d in TEXTS])
    with LLM(ce_path, **LLM_ARGS) as llm:  # runner auto: a sequence classifier pools
        assert llm.engine.runner == "pooling"
        one_to_n = llm.score(query, TEXTS)
        pairwise = llm.score([query] * 2, TEXTS[:2])
    assert max(abs(a - float(b)) for a, b in zip(one_to_n, want)) < 1e-5
    assert max(abs(a - b) for a, b in zip(pairwise, one_to_n[:2])) < 1e-6

    # A folder whose CrossEncoder applies no activation scores with the raw logit (it was
    # always a sigmoid)
    raw_path = tmp_path / "ce-raw"
    shutil.copytree(ce_path, raw_path)
    config = json.loads((raw_path / "config.json").read_text())
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    (raw_path / "config.json").write_text(json.dumps(config))
    want_raw = CrossEncoder(str(raw_path), device="cpu").predict([(query, d) for d in TEXTS])
    with LLM(str(raw_path), **LLM_ARGS) as llm:
        raw = llm.score(query, TEXTS)
    assert max(abs(a - float(b)) for a, b in zip(raw, want_raw)) < 1e-5
    assert any(x < 0 or x > 1 for x in raw) or max(abs(a - b) for a, b in zip(raw, one_to_n)) > 1e-3

    cls_path = str(bert_cross_encoder(tmp_path / "cls", num_labels=3))
    tok = AutoTokenizer.from_pretrained(cls_path)
    hf = AutoModelForSequenceClassification.from_pretrained(cls_path).eval()
    with torch.inference_mode():
        logits = hf(**tok(TEXTS, padding=True, return_tensors="pt")).logits
    with LLM(cls_path, **LLM_ARGS) as llm:
        got = [o.outputs.logits for o in llm.classify(TEXTS)]
        assert llm.engine.pooling_config.labels == tuple(hf.config.id2label[i] for i in range(3))
    assert torch.allclose(torch.tensor(got), logits.float(), atol=1e-5)


def test_settings_sentence_transformers_keeps_outside_config_json(tmp_path):
    """sentence-transformers 6 keeps a CrossEncoder's activation in config_sentence_transformers.json
    and its length limit as the tokenizer's model_max_length (a sigmoid was applied to a raw
    score, and inputs past the limit ran whole); a folder's do_lower_case lowercases texts
    before the cased tokenizer sees them (they came out as [UNK]s)."""
    from sentence_transformers import CrossEncoder, SentenceTransformer

    args = {k: v for k, v in LLM_ARGS.items() if k != "max_model_len"}  # the folders' own limits
    query = "cat"
    ce = CrossEncoder(str(bert_cross_encoder(tmp_path / "ce")), device="cpu", max_length=16)
    ce.activation_fn = torch.nn.Identity()
    ce.save(str(tmp_path / "ce6"))
    short = ["the cat sat on the mat", "hello", "a quick brown fox"]  # within the 16 tokens, with the query
    want = CrossEncoder(str(tmp_path / "ce6"), device="cpu").predict([(query, d) for d in short])
    with LLM(str(tmp_path / "ce6"), **args) as llm:
        assert llm.engine.max_model_len == 16 and llm.engine.pooling_config.score_activation == "identity"
        got = llm.score(query, short)
    assert max(abs(a - float(b)) for a, b in zip(got, want)) < 1e-5

    cased = bert_embedder(tmp_path / "cased", pooling="mean")
    tokenizer = json.loads((cased / "tokenizer.json").read_text())
    tokenizer["normalizer"]["lowercase"] = False
    (cased / "tokenizer.json").write_text(json.dumps(tokenizer))
    sbert = json.loads((cased / "sentence_bert_config.json").read_text())
    (cased / "sentence_bert_config.json").write_text(json.dumps({**sbert, "do_lower_case": True}))
    mixed = [t.title() for t in TEXTS]
    ref = SentenceTransformer(str(cased), device="cpu").encode(mixed, convert_to_numpy=True)
    with LLM(str(cased), runner="pooling", **LLM_ARGS) as llm:
        got = [o.outputs.embedding for o in llm.embed(mixed)]
    assert all(_cos(g, w) >= 0.99999 for g, w in zip(got, ref))


@pytest.mark.parametrize(
    "problem_type, num_labels, activation",
    [
        (None, 1, torch.sigmoid),
        (None, 3, lambda x: torch.softmax(x, -1)),
        ("single_label_classification", 3, lambda x: torch.softmax(x, -1)),
        ("multi_label_classification", 3, torch.sigmoid),  # it was a softmax: labels are not exclusive
        ("regression", 2, lambda x: x),
    ],
)
def test_classify_probabilities_follow_the_problem_type(tmp_path, problem_type, num_labels, activation):
    """/classify's probs are the logits through what transformers trains the config's
    problem_type with (vLLM reads it the same way)."""
    from aiolm.pooling.config import read_pooling_config
    from aiolm.pooling.scores import class_probs

    hf_config = {"architectures": ["BertForSequenceClassification"], "num_labels": num_labels}
    if problem_type is not None:
        hf_config["problem_type"] = problem_type
    cfg = read_pooling_config(str(tmp_path), hf_config, encoder_only=True)
    logits = [0.3, -1.2, 2.0][:num_labels]
    want = activation(torch.tensor(logits, dtype=torch.float64)).tolist()
    assert class_probs(logits, cfg.class_activation) == pytest.approx(want, abs=1e-12)


def test_generation_only_settings_are_refused_for_a_pooling_model(tmp_path):
    """Drafting tokens means nothing to a model that generates none: refused at start (it
    started and ignored the flag)."""
    path = str(qwen3_embedder(tmp_path / "q"))
    with pytest.raises(ValueError, match="speculative 'ngram' drafts generated tokens"):
        LLM(path, runner="pooling", speculative="ngram", **LLM_ARGS)
