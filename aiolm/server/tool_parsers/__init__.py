"""Parsers that find tool calls in a model's free output (``tool_choice: auto``).

Each model family writes calls its own way; ``aiolm serve --tool-call-parser NAME``
picks one from ``PARSERS``. A parser never raises on what the model wrote: text
it cannot read as calls stays plain content.
"""

from __future__ import annotations

from aiolm.server.tool_parsers.base import ParsedCall, ToolParser
from aiolm.server.tool_parsers.hermes import HermesParser
from aiolm.server.tool_parsers.llama3_json import Llama3JsonParser
from aiolm.server.tool_parsers.pythonic import PythonicParser

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "pythonic": PythonicParser,
}

__all__ = ["PARSERS", "ParsedCall", "ToolParser"]
