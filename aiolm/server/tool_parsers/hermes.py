"""Hermes / Qwen style: each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

from __future__ import annotations

import json
import re

from aiolm.server.tool_parsers.base import ParsedCall, ToolParser, call_from_object, content_or_none

_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


class HermesParser(ToolParser):
    markers = ("<tool_call>",)

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        start = self.calls_start(text)
        if start is None:
            return text, []
        calls = []
        for m in _BLOCK.finditer(text, start):
            try:
                call = call_from_object(json.loads(m.group(1).strip()))
            except ValueError:
                call = None
            if call is None:  # one unreadable block: the whole output is content
                return text, []
            calls.append(call)
        return content_or_none(text[:start]), calls
