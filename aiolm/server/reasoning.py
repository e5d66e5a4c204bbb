"""Reasoning models: the thinking a model writes before its answer, split from the answer.

``aiolm serve --reasoning-parser NAME`` (vLLM's names) reads each chat choice's text
as it is generated and puts what lies between the model's thinking markers into the
message's ``reasoning_content`` (and ``reasoning``, as newer vLLM spells it); the rest
is ``content``, which tool-call parsing and structured outputs see alone.

Where the thinking starts depends on the family and on the prompt: DeepSeek-R1 thinks
from its first token (its templates end the prompt with ``<think>`` or leave it out);
Qwen3 thinks when it writes ``<think>`` first, or when the prompt already ends inside
one (Qwen3-Thinking templates), and not when the prompt ends with an empty
``<think></think>`` (``enable_thinking: false``); Granite 3.2 writes its "thought
process" marker first when asked to think. The split works on text, holding back any
tail that could still grow into a marker, so a marker split over tokens is found and
a stream's deltas join to exactly the non-streamed split.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningFormat:
    """How one family marks its thinking, and which template variable asks for it. ``always``:
    it thinks from the first token unless the prompt closed the thinking already."""

    starts: tuple[str, ...]
    ends: tuple[str, ...]
    switch: str  # the chat template variable that turns the thinking on or off
    always: bool = False


_THINK = ("<think>",), ("</think>",)
FORMATS: dict[str, ReasoningFormat] = {
    "deepseek_r1": ReasoningFormat(*_THINK, "thinking", always=True),  # DeepSeek-V3.1's templates read it
    "qwen3": ReasoningFormat(*_THINK, "enable_thinking"),
    "granite": ReasoningFormat(
        ("Here is my thought process:", "Here's my thought process:"),
        ("Here is my response:", "Here's my response:"),
        "thinking",
    ),
}


def reasoning_format(name: str | None) -> ReasoningFormat | None:
    """The server's ``--reasoning-parser``, None without one."""
    return None if name is None else FORMATS[name]


# where a choice's text is
_MAYBE, _REASONING, _CONTENT = "maybe", "reasoning", "content"


def _held(text: str, tags: tuple[str, ...]) -> int:
    """The length of the longest tail of ``text`` that is a proper prefix of a tag."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


def _find(text: str, tags: tuple[str, ...]) -> tuple[int, int]:
    """(start, end) of the earliest tag in ``text``, or (-1, -1)."""
    hits = [(i, i + len(t)) for t in tags if (i := text.find(t)) >= 0]
    return min(hits) if hits else (-1, -1)


class ReasoningSplitter:
    """One choice's text, fed as it is generated, split into (reasoning, content) deltas."""

    def __init__(self, fmt: ReasoningFormat, prompt: str, continued: str = "") -> None:
        """``continued``: the text of a final assistant message the output continues (it ends
        the prompt), whose own markers say whether the model is inside its thinking."""
        self.fmt = fmt
        tail = prompt.rstrip()
        opened = max((continued.rfind(t) for t in fmt.starts), default=-1)
        closed = max((continued.rfind(t) for t in fmt.ends), default=-1)
        if closed > opened or tail.endswith(fmt.ends):
            self.state = _CONTENT
        elif opened > closed or fmt.always or tail.endswith(fmt.starts):
            self.state = _REASONING
        else:
            self.state = _MAYBE
        self.pending = ""
        # a leading start marker is still dropped (not when the continued text opened it)
        self.opening = self.state != _CONTENT and not opened > closed
        self.saw_reasoning = self.state == _REASONING

    @property
    def undecided(self) -> bool:
        """Whether the model may think or answer at once (the prompt leaves it open)."""
        return self.state == _MAYBE

    @property
    def thinking(self) -> bool:
        """Whether the model may still be thinking (structured outputs wait until it stops)."""
        return self.state != _CONTENT

    def feed(self, delta: str) -> tuple[str, str]:
        self.pending += delta
        reasoning = content = ""
        if self.opening:
            body = self.pending.lstrip()
            at, end = _find(body, self.fmt.starts)
            if at == 0:
                self.pending, self.opening = body[end:], False
                self.state, self.saw_reasoning = _REASONING, True
            elif body and not any(t.startswith(body) for t in self.fmt.starts):
                self.opening = False
                if self.state == _MAYBE:
                    self.state = _CONTENT
            else:
                return "", ""  # could still be the start marker
        if self.state == _REASONING:
            at, end = _find(self.pending, self.fmt.ends)
            if at < 0:
                cut = len(self.pending) - _held(self.pending, self.fmt.ends)
                reasoning, self.pending = self.pending[:cut], self.pending[cut:]
                return reasoning, ""
            reasoning, self.pending = self.pending[:at], self.pending[end:]
            self.state = _CONTENT
        content, self.pending = self.pending, ""
        return reasoning, content

    def step(self, delta: str, finished: bool) -> tuple[str, str]:
        """``feed``, and with the choice's last delta what was held back too."""
        reasoning, content = self.feed(delta)
        if finished:
            more, rest = self.finish()
            reasoning, content = reasoning + more, content + rest
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, once the choice has ended."""
        rest, self.pending, self.opening = self.pending, "", False
        if self.state == _REASONING:
            return rest, ""
        self.state = _CONTENT
        return "", rest


def split_reasoning(fmt: ReasoningFormat, prompt: str, text: str, continued: str = "") -> tuple[str | None, str | None]:
    """A whole choice's (reasoning, content); reasoning None when the model did not think,
    content None when it only thought (``continued``: as ReasoningSplitter's)."""
    s = ReasoningSplitter(fmt, prompt, continued)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    if not s.saw_reasoning:
        return None, c1 + c2
    return (r1 + r2) or None, (c1 + c2) or None  # nothing streamed is null, as a stream sends none
