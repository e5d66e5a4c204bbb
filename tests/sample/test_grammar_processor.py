"""The grammar processor on the embedded model's tokenizer: masks, advance, rebuilds, the end."""

from __future__ import annotations

import pytest
import torch

from aiolm.params import SamplingParams
from aiolm.sample.logits_processors import BatchRows
from aiolm.sample.logits_processors.grammar import Grammar
from aiolm.structured.backend import Compiler
from aiolm.structured.spec import StructuredOutputs, choice_grammar

pytest.importorskip("xgrammar")
VOCAB = 49152
EOS = 2


@pytest.fixture(scope="module")
def tokenizer():
    from aiolm.checkpoint.source import resolve_model

    tok = resolve_model(None).load_tokenizer()
    Compiler.configure(lambda: tok)
    return tok


def _params(spec: StructuredOutputs | None, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=50, structured_outputs=spec, eos_token_ids=(EOS,), **kw)


def _rows(params, outputs) -> BatchRows:
    return BatchRows(params, outputs, [[] for _ in params], VOCAB, torch.device("cpu"))


def _greedy(proc: Grammar, logits: torch.Tensor) -> list[int]:
    logits = logits.clone()
    proc.apply(logits)
    return logits.argmax(-1).tolist()


def test_rows_follow_their_grammar_to_the_stop_token(tokenizer):
    torch.manual_seed(0)
    params = [
        _params(StructuredOutputs("regex", "[0-9]{3}-ok")),
        _params(None),
        _params(StructuredOutputs("grammar", choice_grammar(["alpha", "beta"]))),
    ]
    outputs: list[list[int]] = [[], [], []]
    proc = Grammar.build(_rows(params, outputs))
    assert proc is not None and proc.rows == [0, 2]
    free_row = torch.randn(VOCAB)
    for _ in range(12):
        logits = torch.randn(3, VOCAB)
        logits[1] = free_row
        picks = _greedy(proc, logits)
        assert picks[1] == int(free_row.argmax())  # an unconstrained row is left alone
        new = [[t] if not (o and o[-1] == EOS) else [] for t, o in zip(picks, outputs)]
        for o, n in zip(outputs, new):
            o.extend(n)
        proc.advance(new)
    text0 = tokenizer.decode(outputs[0][:-1])
    assert outputs[0][-1] == EOS and len(text0) == 6 and text0[:3].isdigit() and text0.endswith("-ok"), text0
    assert outputs[2][-1] == EOS and tokenizer.decode(outputs[2][:-1]) in ("alpha", "beta")


def test_rebuild_carries_each_matcher_and_replays_only_new_tokens(tokenizer):
    spec = StructuredOutputs("regex", "xy[0-9]+z")
    a, b = _params(spec), _params(spec)
    x_y = tokenizer.encode("xy", add_special_tokens=False)
    # b joined after a; a has output already, b none; then the rows swap places (a condense)
    proc = Grammar.build(_rows([a], [x_y]))
    m_a = proc.matchers[0]
    assert m_a.accepted == len(x_y)
    proc2 = Grammar.build(_rows([b, a], [[], x_y]))
    assert proc2.matchers[1] is m_a and proc2.matchers[0] is not m_a
    picks = _greedy(proc2, torch.zeros(2, VOCAB))
    first_b = tokenizer.decode([picks[0]])
    assert first_b and "xy".startswith(first_b)  # b starts at the beginning; a continues after "xy"
    assert tokenizer.decode([picks[1]])[0].isdigit()


def test_a_row_that_ignores_eos_gets_only_stop_tokens_after_the_end(tokenizer):
    p = _params(StructuredOutputs("regex", "hi"), ignore_eos=True)
    out = tokenizer.encode("hi", add_special_tokens=False) + [EOS]  # the stop token, ignored by the engine
    proc = Grammar.build(_rows([p], [out]))
    assert proc.matchers[0].matcher.is_terminated()
    logits = torch.randn(1, VOCAB)
    proc.apply(logits)
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert allowed == [EOS]


def test_no_constrained_row_means_no_processor():
    assert Grammar.build(_rows([_params(None)], [[]])) is None


def test_background_compiles_report_ready_and_errors_and_leave_the_grammar_cached(tokenizer):
    """The worker's side of the grammar wait state: compiles run on their own threads, requests
    sharing a grammar share the compile, errors carry the compiler's message, and the processor
    then builds its matcher from the cache."""
    import time

    from aiolm.structured.backend import BackgroundCompiles

    spec = StructuredOutputs("regex", "[A-Z][a-z]{1,120}-background")
    jobs = BackgroundCompiles(VOCAB)
    try:
        assert jobs.collect() == ([], {})
        jobs.submit({"a": spec, "b": spec, "bad": StructuredOutputs("regex", "(ab")})
        ready: list[str] = []
        errors: dict[str, str] = {}
        deadline = time.monotonic() + 60
        while len(ready) + len(errors) < 3:
            assert time.monotonic() < deadline, (ready, errors)
            r, e = jobs.collect(wait=0.05)
            ready += r
            errors.update(e)
        assert sorted(ready) == ["a", "b"] and list(errors) == ["bad"] and "invalid regex" in errors["bad"]
        assert jobs.collect(wait=0.05) == ([], {})  # each request is reported once; nothing waits
        t0 = time.perf_counter()
        proc = Grammar.build(_rows([_params(spec)], [[]]))
        assert proc is not None and time.perf_counter() - t0 < 0.25  # a cache hit, not a compile
    finally:
        jobs.close()


def test_tokenizer_info_is_cached_by_the_tokenizer_files(tmp_path, monkeypatch, real_source, tokenizer):
    """A worker builds xgrammar's tokenizer info once per tokenizer (a file in aiolm's cache):
    a later process reads it back without loading the tokenizer, and what it reads is what
    building gives; changed files or a damaged entry build it again."""
    import shutil

    import xgrammar as xgr

    from aiolm.structured.backend import tokenizer_info

    monkeypatch.setenv("AIOLM_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "tok"
    shutil.copytree(real_source.path, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    loads = []

    def loader():
        loads.append(1)
        return tokenizer

    built = tokenizer_info(loader, VOCAB, folder)
    entries = list((tmp_path / "cache" / "tokenizer-info").glob("*.json"))
    assert len(loads) == 1 and len(entries) == 1
    read = tokenizer_info(lambda: pytest.fail("the cached info must not load the tokenizer"), VOCAB, folder)
    for attr in (
        "decoded_vocab",
        "stop_token_ids",
        "special_token_ids",
        "vocab_type",
        "add_prefix_space",
        "vocab_size",
    ):
        assert getattr(read, attr) == getattr(built, attr), attr
    reference = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB)
    assert read.decoded_vocab == reference.decoded_vocab and read.stop_token_ids == reference.stop_token_ids
    # The same grammar compiled from either gives the same first mask.
    masks = []
    for info in (reference, read):
        matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_json_schema('{"type": "integer"}'))
        bitmask = xgr.allocate_token_bitmask(1, VOCAB)
        matcher.fill_next_token_bitmask(bitmask)
        masks.append(bitmask)
    assert torch.equal(masks[0], masks[1])

    entries[0].write_text("{not json")  # damaged: rebuilt and replaced
    tokenizer_info(loader, VOCAB, folder)
    assert len(loads) == 2 and xgr.TokenizerInfo.deserialize_json(entries[0].read_text()).vocab_size == VOCAB
    (folder / "tokenizer.json").touch()  # the tokenizer changed: another entry
    tokenizer_info(loader, VOCAB, folder)
    assert len(loads) == 3 and len(list(entries[0].parent.glob("*.json"))) == 2


def test_a_grammar_with_after_leaves_the_row_free_until_the_marker_then_constrains_it(tokenizer):
    marker = tokenizer.encode("</think>", add_special_tokens=False)
    spec = StructuredOutputs("regex", "[0-9]{2}", after=tuple(marker))
    params = [_params(spec)]
    outputs: list[list[int]] = [[]]
    proc = Grammar.build(_rows(params, outputs))
    words = tokenizer.encode(" let me think", add_special_tokens=False)
    for t in words + marker[:-1]:  # thinking, and the marker but its last token: free
        logits = torch.zeros(1, VOCAB)
        logits[0, t] = 5.0
        assert _greedy(proc, logits) == [t]
        outputs[0].append(t)
        proc.advance([[t]])
    logits = torch.zeros(1, VOCAB)
    logits[0, marker[-1]] = 5.0
    assert _greedy(proc, logits) == [marker[-1]]
    outputs[0].append(marker[-1])
    proc.advance([[marker[-1]]])
    for _ in range(3):  # past the marker only the grammar's tokens (then the stop token) remain
        logits = torch.randn(1, VOCAB)
        (t,) = _greedy(proc, logits)
        outputs[0].append(t)
        proc.advance([[t]])
    answer = outputs[0][len(words) + len(marker) :]
    assert answer[-1] == EOS and tokenizer.decode(answer[:-1]).isdigit() and len(tokenizer.decode(answer[:-1])) == 2
    # a rebuild (the row moved or the batch changed) replays the output through the marker
    assert len(marker) > 1
    fresh = Grammar.build(_rows([_params(spec)], [outputs[0][: len(words) + len(marker) - 1]]))
    assert fresh is not None and not fresh.matchers[0].started
    fresh = Grammar.build(_rows([_params(spec)], [outputs[0][: len(words) + len(marker)]]))
    assert fresh is not None and fresh.matchers[0].started
