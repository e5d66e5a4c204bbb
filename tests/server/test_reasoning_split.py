"""The reasoning split (aiolm/server/reasoning.py) on text: where thinking starts and ends
for each family, and streamed deltas joining to exactly the whole-text split however the
text is cut."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiolm.server.reasoning import FORMATS, ReasoningSplitter, split_reasoning

R1, QWEN3, GRANITE = FORMATS["deepseek_r1"], FORMATS["qwen3"], FORMATS["granite"]

CASES = [
    # (format, prompt tail, generated text, reasoning, content)
    (R1, "<|assistant|><think>\n", "Let me see.\n</think>\n\nParis.", "Let me see.\n", "\n\nParis."),
    (R1, "<|assistant|>", "<think>Let me see.</think>Paris.", "Let me see.", "Paris."),
    (R1, "<|assistant|>", "Let me see.</think>Paris.", "Let me see.", "Paris."),
    (R1, "<|assistant|>", "Still thinking when cut", "Still thinking when cut", None),
    (R1, "<|assistant|><think>\n\n</think>\n\n", "Paris.", None, "Paris."),
    (QWEN3, "<|assistant|>", "<think>\nhm\n</think>\n\nParis.", "\nhm\n", "\n\nParis."),
    (QWEN3, "<|assistant|>", "\n<think>hm</think>Paris.", "hm", "Paris."),
    (QWEN3, "<|assistant|>", "Paris, no thinking.", None, "Paris, no thinking."),
    (QWEN3, "<|assistant|>", "Paris. <think>late</think> tags stay", None, "Paris. <think>late</think> tags stay"),
    (QWEN3, "<|assistant|><think>\n", "hm</think>Paris.", "hm", "Paris."),
    (QWEN3, "<|assistant|><think>\n\n</think>\n\n", "Paris.", None, "Paris."),
    (QWEN3, "<|assistant|>", "<think>cut short", "cut short", None),
    (QWEN3, "<|assistant|>", "<thi", None, "<thi"),
    (QWEN3, "<|assistant|>", "<think>a </think", "a </think", None),
    (QWEN3, "<|assistant|>", "", None, ""),
    (
        GRANITE,
        "<|assistant|>",
        "Here is my thought process: rivers. Here is my response: Rome.",
        " rivers. ",
        " Rome.",
    ),
    (GRANITE, "<|assistant|>", "Here's my thought process:a Here's my response:b", "a ", "b"),
    (GRANITE, "<|assistant|>", "Rome.", None, "Rome."),
]


@pytest.mark.parametrize(("fmt", "prompt", "text", "reasoning", "content"), CASES)
def test_whole_text_split(fmt, prompt, text, reasoning, content) -> None:
    assert split_reasoning(fmt, prompt, text) == (reasoning, content)


@pytest.mark.parametrize(("fmt", "prompt", "text", "reasoning", "content"), CASES)
def test_streamed_deltas_join_to_the_whole_split(fmt, prompt, text, reasoning, content) -> None:
    rng = random.Random(len(text))
    for _ in range(30):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        s = ReasoningSplitter(fmt, prompt)
        r = c = ""
        for p in pieces:
            dr, dc = s.feed(p)
            assert not (dc and s.thinking), "content is only released once thinking ended"
            r, c = r + dr, c + dc
        dr, dc = s.finish()
        assert (r + dr, c + dc) == (reasoning or "", content or "")


def test_nothing_past_a_partial_end_marker_is_released() -> None:
    s = ReasoningSplitter(QWEN3, "<|assistant|>")
    assert s.feed("<think>abc</th") == ("abc", "")
    assert s.thinking
    assert s.feed("ink>Paris") == ("", "Paris")
    assert not s.thinking


def test_a_marker_split_one_character_at_a_time() -> None:
    s = ReasoningSplitter(GRANITE, "")
    text = "Here is my thought process: x Here is my response: y"
    out = [s.feed(ch) for ch in text]
    assert "".join(r for r, _ in out) == " x "
    assert "".join(c for _, c in out) == " y"


_PIECES = st.sampled_from(
    [
        "<think>",
        "</think>",
        "<th",
        "ink>",
        "</",
        "Here is my thought process:",
        "Here is my response:",
        "Here",
        "a",
        " ",
        "\n",
    ]
)


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(sorted(FORMATS)),
    prompt=st.sampled_from(["", "<|assistant|>", "<think>\n", "<think></think>\n"]),
    pieces=st.lists(_PIECES | st.text(max_size=3), max_size=30),
    cuts=st.lists(st.integers(1, 7), max_size=40),
)
def test_any_text_streamed_in_any_pieces_joins_to_the_whole_split(name, prompt, pieces, cuts):
    fmt, text = FORMATS[name], "".join(pieces)
    reasoning, content = split_reasoning(fmt, prompt, text)
    assert (reasoning or "") + (content or "") in (text, text.lstrip()) or any(
        t in text for t in fmt.starts + fmt.ends
    ), "only markers (and whitespace before a start marker) are dropped"
    s = ReasoningSplitter(fmt, prompt)
    r = c = ""
    pos = 0
    for n in [*cuts, len(text)]:
        dr, dc = s.feed(text[pos : pos + n])
        r, c, pos = r + dr, c + dc, pos + n
        if pos >= len(text):
            break
    dr, dc = s.finish()
    assert (r + dr, c + dc) == (reasoning or "", content or "")
