"""Incremental detokenizer and stop strings, against the real SmolLM2 tokenizer."""

from __future__ import annotations

import random

import pytest

from aiolm.engine.detokenizer import IncrementalDetokenizer, StopChecker, TextStream

FFFD = "\ufffd"

TEXTS = [
    "Hello, world! This is a plain English sentence.",
    "def f(x):\n    return x ** 2  # squares\n\n\tprint(f(3))",
    "你好，世界！今天天气很好。我们去公园散步吧。",
    "日本語のテキスト、カタカナとひらがな。",
    "Emoji: 🎉🚀👍🏽 family 👨‍👩‍👧‍👦 flag 🇫🇷 heart ❤️",
    "Accents: café, naïve, résumé, Ångström, Øre, ß, ĳ, e\u0301 (combining)",
    "Mixed: Привет мир, γειά σου κόσμε, مرحبا بالعالم, שלום",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\nSure! 好的 🎉<|im_end|>",
    "<|endoftext|><|im_start|><|im_end|>  spaces   and\n\nnewlines\r\n",
    "Math: ∑ᵢ xᵢ² ≤ ∞, ∀ε>0 ∃δ; 𝔽𝕠𝕟𝕥 𝒮𝒸𝓇𝒾𝓅𝓉",
    "a" * 50 + "😀" * 10 + "b",
]
PROMPT_TEXT = "<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok(tokenizer):
    """The embedded model's real tokenizer (session fixture in conftest.py)."""
    return tokenizer


@pytest.fixture(scope="module")
def byte_token_ids(tok) -> dict[int, int]:
    """Byte value -> id of the single-byte token (GPT-2 byte-to-unicode map)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    vocab = tok.get_vocab()
    ids = {b: vocab[c] for b, c in chars.items() if c in vocab}  # bytes never seen in training lack one
    assert tok.decode([ids[0xE4], ids[0xBD], ids[0xA0]]) == "你"
    return ids


def chunks(ids: list[int], rng: random.Random | None) -> list[list[int]]:
    if rng is None:
        return [[t] for t in ids]
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 5)
        out.append(ids[i : i + n])
        i += n
    return out


def stream(tok, ids, rng=None, prompt=(), skip=True) -> tuple[list[str], IncrementalDetokenizer]:
    det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [det.push(c) for c in chunks(ids, rng)]
    deltas.append(det.finish())
    return deltas, det


@pytest.mark.parametrize("skip", [True, False])
def test_real_text_round_trip(tok, skip):
    rng = random.Random(0)
    prompt = tok.encode(PROMPT_TEXT, add_special_tokens=False)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        truth = tok.decode(ids, skip_special_tokens=skip)
        assert FFFD not in truth
        for r in (None, rng, rng):
            for p in ((), prompt):
                deltas, det = stream(tok, ids, r, p, skip)
                assert "".join(deltas) == truth
                assert det.text == truth
                assert not any(FFFD in d for d in deltas), deltas
                assert len(det._window) <= 16


def test_work_per_token_is_bounded(tok):
    """Each decode sees a short window, however long the output gets."""
    ids = tok.encode(" ".join(TEXTS) * 6, add_special_tokens=False)
    det = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    sizes: list[int] = []
    inner = det._decode
    det._decode = lambda w: (sizes.append(len(w)), inner(w))[1]
    for t in ids:
        det.push([t])
    assert len(ids) > 1500 and max(sizes) <= 16
    assert len(sizes) <= 2 * len(ids) + 2
    assert det.text == tok.decode(ids)


def test_partial_characters_are_held_back(tok):
    ids = tok.encode(" 🎉", add_special_tokens=False)
    assert len(ids) >= 2  # the emoji spans several byte tokens
    det = IncrementalDetokenizer(tok, [])
    deltas = [det.push([t]) for t in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == " 🎉"
    assert det.finish() == ""


def test_random_token_ids(tok):
    rng = random.Random(1)
    vocab = len(tok)
    for _ in range(150):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        if rng.random() < 0.3:  # sprinkle special tokens
            ids = [t if rng.random() > 0.2 else rng.randrange(17) for t in ids]
        skip = rng.random() < 0.5
        truth = tok.decode(ids, skip_special_tokens=skip)
        deltas, det = stream(tok, ids, rng if rng.random() < 0.5 else None, skip=skip)
        assert "".join(deltas) == truth
        if FFFD not in truth:
            assert not any(FFFD in d for d in deltas)


def test_random_raw_bytes_exact(tok, byte_token_ids):
    """Streams of raw byte tokens: incomplete and invalid UTF-8 everywhere."""
    rng = random.Random(2)
    ascii_ids = [i for b, i in byte_token_ids.items() if 0x20 <= b < 0x7F]
    high_ids = [i for b, i in byte_token_ids.items() if b >= 0x80]
    valid = [tok.encode(c, add_special_tokens=False) for c in "é你🎉ß€"]
    for _ in range(150):
        ids: list[int] = []
        while len(ids) < 60:
            x = rng.random()
            if x < 0.5:
                ids.append(rng.choice(high_ids))
            elif x < 0.7:
                ids.append(rng.choice(ascii_ids))
            elif x < 0.8:
                ids.append(rng.randrange(3))  # specials, skipped
            else:
                ids.extend(rng.choice(valid))
        truth = tok.decode(ids, skip_special_tokens=True)
        deltas, det = stream(tok, ids, rng if rng.random() < 0.5 else None)
        assert "".join(deltas) == truth


def test_invalid_byte_run_streams_with_bounded_window(tok, byte_token_ids):
    ids = [byte_token_ids[0x80]] * 200 + tok.encode("ok 你好", add_special_tokens=False)
    det = IncrementalDetokenizer(tok, [])
    released_before_end = 0
    for t in ids:
        released_before_end += len(det.push([t]))
        assert len(det._window) <= 16  # O(1) work per token
    assert released_before_end >= 190
    det.finish()
    assert det.text == tok.decode(ids)


def test_trailing_partial_char_flushed_at_finish(tok, byte_token_ids):
    ids = tok.encode("ab", add_special_tokens=False) + [byte_token_ids[0xE4], byte_token_ids[0xBD]]
    det = IncrementalDetokenizer(tok, [])
    assert det.push(ids) == "ab"
    assert det.finish() == FFFD
    assert det.text == tok.decode(ids) == "ab" + FFFD


def test_prompt_ending_mid_character(tok, byte_token_ids):
    prompt = tok.encode("x", add_special_tokens=False) + [byte_token_ids[0xE4]]
    out = [byte_token_ids[0xBD], byte_token_ids[0xA0]] + tok.encode("ok", add_special_tokens=False)
    deltas, det = stream(tok, out, prompt=prompt)
    assert det.text == tok.decode(out)


def test_skipped_special_run_keeps_window_small(tok):
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = [end] * 100 + tok.encode(" done", add_special_tokens=False)
    det = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    for t in ids:
        det.push([t])
        assert len(det._window) <= 16
    det.finish()
    assert det.text == " done"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_skipped_or_kept(tok, skip):
    text = "<|im_start|>assistant\nHi<|im_end|>"
    ids = tok.encode(text, add_special_tokens=False)
    deltas, det = stream(tok, ids, skip=skip)
    assert det.text == (text if not skip else "assistant\nHi")


# ---------------------------------------------------------------- StopChecker


def feed_all(checker: StopChecker, pieces) -> tuple[str, str | None, list[str]]:
    out = []
    for p in pieces:
        text, m = checker.feed(p)
        out.append(text)
        if m is not None:
            return "".join(out), m, out
    out.append(checker.finish())
    return "".join(out), None, out


def reference_stop(text: str, stop: list[str], include: bool) -> tuple[str, str | None]:
    """Char by char: the first stop to complete wins; ties go to the longer one."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stop if text[:end].endswith(s)]
        if hits:
            s = max(hits, key=len)
            return text[:end] if include else text[: end - len(s)], s
    return text, None


def test_stop_split_across_deltas():
    c = StopChecker(["world"])
    assert c.feed("Hello wor") == ("Hello ", None)  # "wor" may become the stop
    assert c.feed("ld! more") == ("", "world")
    assert c.feed("ignored") == ("", None) and c.finish() == ""


def test_stop_at_very_start():
    assert StopChecker(["STOP"]).feed("STOP and more") == ("", "STOP")
    assert StopChecker(["STOP"], include_stop_str_in_output=True).feed("STOP and more") == ("STOP", "STOP")


def test_overlapping_stop_candidates():
    assert feed_all(StopChecker(["abc", "ab"]), ["xa", "bc"])[:2] == ("x", "ab")
    assert feed_all(StopChecker(["abcd", "bc"]), ["za", "bcd"])[:2] == ("za", "bc")
    # Same end: the longer (earlier-starting) stop wins.
    assert feed_all(StopChecker(["bc", "abc"]), ["zabc"])[:2] == ("z", "abc")
    assert feed_all(StopChecker(["abc", "ab"], True), ["xabc"])[:2] == ("xab", "ab")


def test_include_stop_str_in_output_does_not_hold():
    c = StopChecker(["world"], include_stop_str_in_output=True)
    assert c.feed("Hello wor") == ("Hello wor", None)
    assert c.feed("ld! more") == ("ld", "world")


def test_held_text_released_at_finish_and_on_mismatch():
    c = StopChecker(["world"])
    assert c.feed("hello w") == ("hello ", None)
    assert c.feed("x") == ("wx", None)
    assert c.feed(" wo") == (" ", None)
    assert c.finish() == "wo"


def test_unchecked_text_is_context_only():
    c = StopChecker(["STOP"])
    assert c.feed("a STOP b ST", check=False) == ("a STOP b ", None)  # held "ST" still
    assert c.feed("OP!") == ("", "STOP")  # starts in unchecked text, ends in checked


def test_stop_checker_matches_reference_under_random_chunking():
    rng = random.Random(3)
    for _ in range(400):
        alphabet = "abc"[: rng.randint(2, 3)]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stop = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        include = rng.random() < 0.5
        pieces, i = [], 0
        while i < len(text):
            n = rng.randint(0, 5)
            pieces.append(text[i : i + n])
            i += n
        out, matched, deltas = feed_all(StopChecker(stop, include), pieces)
        assert (out, matched) == reference_stop(text, stop, include), (text, stop, pieces)


# ----------------------------------------------------------------- TextStream


def run_stream(ts: TextStream, ids, rng=None) -> tuple[str, str | None]:
    out = []
    for c in chunks(ids, rng):
        text, m = ts.push(c)
        out.append(text)
        if m is not None:
            assert ts.finish() == ""
            return "".join(out), m
    out.append(ts.finish())
    return "".join(out), None


def test_text_stream_stop_spanning_tokens(tok):
    text = "The capital of France is Paris. 你好🎉 It is big."
    ids = tok.encode(text, add_special_tokens=False)
    rng = random.Random(4)
    for stop, include in [("s Par", False), ("s Par", True), ("🎉 I", False), ("好🎉", True), ("big.", False)]:
        i = text.index(stop)
        want = text[: i + len(stop)] if include else text[:i]
        for r in (None, rng):
            ts = TextStream(tok, [], stop=[stop, "never"], include_stop_str_in_output=include)
            assert run_stream(ts, ids, r) == (want, stop)
            assert ts.text == want and ts.stop_reason == stop
    ts = TextStream(tok, [], stop=["never"])
    assert run_stream(ts, ids) == (text, None)


def test_text_stream_min_tokens_like_vllm(tok):
    text = "Hello, my name is Lee, and I'm a student in the college of engineering"
    ids = tok.encode(text, add_special_tokens=False)
    prompt, out = ids[:4], ids[4:]
    full = tok.decode(out)
    for min_tokens in (0, 1, 5):
        unchecked = len(tok.decode(out[:min_tokens]))
        want = full[: full.index("e", unchecked)]
        ts = TextStream(tok, prompt, stop=["e"], min_tokens=min_tokens)
        assert run_stream(ts, out, random.Random(min_tokens)) == (want, "e")
    assert "e" in tok.decode(out[:5])  # min_tokens=5 really skipped a match


def test_text_stream_stop_terminated_token_text(tok):
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("Hi there", add_special_tokens=False)
    for include, want in ((False, "Hi there"), (True, "Hi there<|im_end|>")):
        ts = TextStream(tok, [], include_stop_str_in_output=include, skip_special_tokens=False)
        text, m = ts.push(ids[:-1])
        text2, m2 = ts.push([ids[-1], end], stop_terminated=True)
        assert m is m2 is None
        assert text + text2 + ts.finish() == want == ts.text


def test_text_stream_from_params(tok):
    from aiolm.params import SamplingParams

    params = SamplingParams(stop=["!"], include_stop_str_in_output=True, skip_special_tokens=False)
    ids = tok.encode("<|im_start|>Hey! you", add_special_tokens=False)
    ts = TextStream.from_params(tok, [], params)
    assert run_stream(ts, ids) == ("<|im_start|>Hey!", "!")


def test_final_only_output_defers_detokenizing_and_gives_the_streamed_text(tok, byte_token_ids):
    """A final-only request without stop strings is detokenized once at its end, in runs of
    ids; its text equals the text a streaming request builds step by step, with a stop
    token dropped, and an abort flushes what was deferred."""
    from aiolm.core.step import EngineCoreOutput
    from aiolm.engine.output_processor import OutputProcessor
    from aiolm.params import OutputKind, SamplingParams

    prompt = tok.encode(PROMPT_TEXT, add_special_tokens=False)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    texts = TEXTS[:7] + ["x" + "".join(chr(0x4F60 + i) for i in range(5))]
    op = OutputProcessor(tok, abort_children=lambda ids: None)
    kinds = {"final": OutputKind.FINAL_ONLY, "stream": OutputKind.CUMULATIVE}
    states = {}
    for i, _ in enumerate(texts):
        for name, kind in kinds.items():
            rid = f"{name}{i}"
            states[rid] = op.register(rid, None, prompt, SamplingParams(max_tokens=500, output_kind=kind), [rid])
    assert all(s.seqs[0].defer_text == rid.startswith("final") for rid, s in states.items())
    ids = {i: tok.encode(t, add_special_tokens=False) + [eos] for i, t in enumerate(texts)}
    ids[0] = ids[0][:-1] + [byte_token_ids[0xE4]]  # ends mid-character, by length
    for step in range(max(map(len, ids.values()))):
        outs = []
        for i, seq in ids.items():
            if step < len(seq):
                last = step == len(seq) - 1
                reason = None if not last else ("length" if i == 0 else "stop")
                for name in kinds:
                    outs.append(
                        EngineCoreOutput(
                            f"{name}{i}",
                            [seq[step]],
                            finish_reason=reason,
                            stop_reason=eos if reason == "stop" else None,
                        )
                    )
        op.process(outs)
        if step == 3:  # deferred: nothing detokenized yet
            assert states["final1"].seqs[0].text.text == "" and states["stream1"].seqs[0].text.text
    for i in range(len(texts)):
        final, streamed = states[f"final{i}"].build(delta=False), states[f"stream{i}"].build(delta=False)
        assert final.finished and final.outputs[0].text == streamed.outputs[0].text
        want = tok.decode(ids[i] if i == 0 else ids[i][:-1])
        assert final.outputs[0].text == want, (i, final.outputs[0].text, want)

    st = op.register("late", None, prompt, SamplingParams(max_tokens=50, output_kind=OutputKind.FINAL_ONLY), ["late"])
    op.process([EngineCoreOutput("late", [t]) for t in tok.encode(" partial answer", add_special_tokens=False)])
    assert st.seqs[0].text.text == ""
    op.abort("late")
    assert st.build(delta=False).outputs[0].text == " partial answer"


def test_several_tokens_in_one_step_end_where_a_stop_string_ends(tok):
    """A speculative step hands over several tokens at once: the stop string is found after
    the token that completes it, and the token ids and logprobs stop there too, as if the
    tokens had come one per step."""
    from aiolm.core.step import EngineCoreOutput, LogprobsLists
    from aiolm.engine.output_processor import OutputProcessor
    from aiolm.params import SamplingParams

    ids = tok.encode(" one two three four five", add_special_tokens=False)
    stop_at = 2  # " three" completes the stop string "two th"
    aborted: list[list[str]] = []
    op = OutputProcessor(tok, abort_children=aborted.append)
    sp = SamplingParams(max_tokens=50, stop=["two th"], logprobs=0)
    states = {rid: op.register(rid, None, [1], sp, [rid]) for rid in ("burst", "single")}
    lps = LogprobsLists([[t] for t in ids], [[-0.5 * (j + 1)] for j in range(len(ids))], [1] * len(ids))
    op.process([EngineCoreOutput("burst", ids, new_logprobs=lps)])
    for j, t in enumerate(ids):
        op.process([EngineCoreOutput("single", [t], new_logprobs=lps.slice(j, j + 1))])
    burst, single = (states[r].build(delta=False).outputs[0] for r in ("burst", "single"))
    assert burst.token_ids == ids[: stop_at + 1] == single.token_ids
    assert burst.text == single.text == " one " and burst.stop_reason == single.stop_reason == "two th"
    assert [next(iter(d.values())).logprob for d in burst.logprobs] == [-0.5, -1.0, -1.5]
    assert aborted == [["burst"], ["single"]]


def test_the_stop_reason_and_text_where_a_step_also_ends_on_a_stop_token(tok):
    """vLLM's rules where a step's tokens end the sequence twice over: a stop string matched
    is the reason even when the same step ends on a stop token (the token id, or None for EOS,
    was reported); EOS's text is never part of the output, with special tokens kept or not
    (``<|im_end|>`` ended every answer with skip_special_tokens false)."""
    from aiolm.core.step import EngineCoreOutput
    from aiolm.engine.output_processor import OutputProcessor
    from aiolm.params import SamplingParams

    a = tok.encode(" a b c", add_special_tokens=False)
    eos = tok.convert_tokens_to_ids("<|im_end|>")

    def run(params: SamplingParams, steps: list[EngineCoreOutput]):
        op = OutputProcessor(tok, abort_children=lambda ids: None)
        st = op.register("r", None, [1], params, ["r"])
        for s in steps:
            op.process([s])
        return st.build(delta=False).outputs[0]

    same = run(SamplingParams(stop=[" b"], stop_token_ids=[a[2]]), [EngineCoreOutput("r", a[:3], "stop", a[2])])
    assert (same.text, same.finish_reason, same.stop_reason) == (" a", "stop", " b")
    spec = run(SamplingParams(stop=[" b"]), [EngineCoreOutput("r", [*a[:2], eos], "stop", None)])
    assert (spec.text, spec.stop_reason) == (" a", " b")
    last = run(
        SamplingParams(stop=[" c"], include_stop_str_in_output=True),
        [EngineCoreOutput("r", a[:2]), EngineCoreOutput("r", a[2:], "stop", a[2])],
    )
    assert (last.text, last.stop_reason) == (" a b c", " c")
    for skip in (True, False):
        ended = run(
            SamplingParams(skip_special_tokens=skip, eos_token_ids=(eos,)),
            [EngineCoreOutput("r", a), EngineCoreOutput("r", [eos], "stop", None)],
        )
        assert (ended.text, ended.finish_reason, ended.stop_reason) == (" a b c", "stop", None), skip


def test_byte_fallback_characters_split_across_multi_token_steps():
    """SentencePiece with byte fallback (Llama 2, Mistral, Gemma): a run of byte tokens
    decodes to U+FFFD whole when any byte of it is invalid, so a window cut inside a
    character spoilt the next one too ("€🎉����." for "€🎉🎉.") when a step held several
    tokens (speculative decoding, or min_tokens splitting a step's push)."""
    from tokenizers import Tokenizer, decoders, models

    vocab = [("<unk>", 0.0), *((f"<0x{b:02X}>", 0.0) for b in range(256)), ("▁the", -1.0), (".", -1.0)]
    tk = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tk.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    rng = random.Random(7)
    for text in ("€🎉🎉.", "the 日本語 €.", "🎉" * 5):
        ids = tk.encode(text, add_special_tokens=False).ids
        for _ in range(40):
            d = IncrementalDetokenizer(tk)
            out, i = [], 0
            while i < len(ids):
                k = rng.randint(1, 3)
                out.append(d.push(ids[i : i + k]))
                i += k
            out.append(d.finish())
            assert "".join(out) == tk.decode(ids) == d.text, (text, out)
    # A decoder that strips a leading space decodes a cut's tail without it: the cut must still
    # be taken (the window was kept whole, and each step decoded the whole output again)
    from tokenizers import normalizers

    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    ids = tk.encode(" ".join(["the"] * 600), add_special_tokens=False).ids
    assert len(ids) == 600  # one ▁the per word
    d = IncrementalDetokenizer(tk)
    for i in range(0, len(ids), 3):
        d.push(ids[i : i + 3])
        assert len(d._window) <= 8, (i, len(d._window))
