"""Pythonic style (Llama 3.2/4, ToolACE): the output is a list of calls,
``[get_weather(city="Paris"), add(a=1, b=2)]``. Read with ``ast`` and literal values
only; nothing the model wrote is ever evaluated."""

from __future__ import annotations

import ast
import json
from typing import Any

from aiolm.server.tool_parsers.base import ParsedCall, ToolParser


class PythonicParser(ToolParser):
    markers = ("[",)
    at_start = True

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        body = text.strip()
        if not body.startswith("["):
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return text, []
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            call = _call(node)
            if call is None:
                return text, []
            calls.append(call)
        return None, calls


def _call(node: ast.expr) -> ParsedCall | None:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None  # positional arguments have no parameter names to map to
    args: dict[str, Any] = {}
    for kw in node.keywords:
        if kw.arg is None:  # **kwargs
            return None
        try:
            args[kw.arg] = ast.literal_eval(kw.value)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
    try:
        text = json.dumps(args, ensure_ascii=False)
    except (TypeError, ValueError):  # sets, bytes, complex numbers: not JSON
        return None
    return ParsedCall(node.func.id, text)
