"""The parser interface: where calls may begin (for streaming) and how to read them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from aiolm.server.tool_parsers.json_stream import JsonCallsReader, PartialCall, json_text


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object, as OpenAI returns it


class CallsReader(Protocol):
    """Calls read from text as it streams in (``feed`` gets the text from the first marker
    on): each call's name once known, and a prefix of its finished arguments."""

    calls: list[PartialCall]
    failed: bool

    def feed(self, text: str) -> None: ...


class ToolParser:
    """``markers``: texts that open the calls. With ``at_start`` they count only at the
    start of the output (after whitespace); otherwise anywhere. Streaming shows text as
    content until a marker may begin; from there ``stream_reader`` reads the calls as they
    are written, and ``extract`` reads the finished text."""

    markers: tuple[str, ...] = ()
    at_start: bool = False
    args_keys: tuple[str, ...] = ("arguments",)
    args_required = False  # an object without arguments is text (call_from_object)

    def stream_reader(self) -> CallsReader:
        """JSON call objects, the common case; a parser with another syntax has its own."""
        return JsonCallsReader(self.args_keys, self.args_required)

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls); no calls means the whole text is content."""
        raise NotImplementedError

    def calls_start(self, text: str) -> int | None:
        """Where calls begin in ``text`` (complete so far), or None if no marker has begun."""
        if self.at_start:
            stripped = text.lstrip()
            return len(text) - len(stripped) if stripped.startswith(self.markers) else None
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found) if found else None

    def safe_prefix(self, text: str) -> int:
        """How much of ``text`` can be streamed as content now: everything before a marker
        or before a tail that could still grow into one."""
        start = self.calls_start(text)
        if start is not None:
            return start
        if self.at_start:
            stripped = text.lstrip()
            if not stripped or any(m.startswith(stripped) for m in self.markers):
                return 0  # calls may still begin
            return len(text)
        hold = 0
        for m in self.markers:
            for k in range(min(len(m) - 1, len(text)), 0, -1):
                if text.endswith(m[:k]):
                    hold = max(hold, k)
                    break
        return len(text) - hold


def call_from_object(
    obj: Any, args_keys: tuple[str, ...] = ("arguments",), args_required: bool = False
) -> ParsedCall | None:
    """``{"name": str, "arguments": {...}}`` (or another arguments key) as a call, else None.
    ``args_required``: an object without arguments is not a call (where any JSON answer with a
    "name" would otherwise be one)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    for key in args_keys:
        if key in obj:
            args = obj[key]
            if isinstance(args, str):  # some models write the arguments as JSON text
                try:
                    args = json.loads(args)
                except ValueError:
                    return None
            text = json_text(args) if isinstance(args, dict) else None
            return None if text is None else ParsedCall(obj["name"], text)
    return None if args_required else ParsedCall(obj["name"], "{}")


def content_or_none(text: str) -> str | None:
    return text if text.strip() else None
