"""Pythonic style (Llama 3.2/4, ToolACE): the output is a list of calls,
``[get_weather(city="Paris"), add(a=1, b=2)]``. Read with ``ast`` and literal values
only; nothing the model wrote is ever evaluated."""

from __future__ import annotations

import ast
from typing import Any

from aiolm.server.tool_parsers.base import ParsedCall, ToolParser
from aiolm.server.tool_parsers.json_stream import PartialCall, json_text


class PythonicParser(ToolParser):
    markers = ("[",)
    at_start = True

    def stream_reader(self) -> PythonicCallsReader:
        return PythonicCallsReader()

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
    text = json_text(args)  # None: sets, bytes, complex numbers, 1e999: not JSON
    return None if text is None else ParsedCall(node.func.id, text)


class PythonicCallsReader:
    """The calls of ``[f(a=1), g(b="x")]`` as it is written: each name once its ``(`` is
    seen, its arguments once its ``)`` closes it (read by ``_call``, as ``extract`` does)."""

    def __init__(self) -> None:
        self.calls: list[PartialCall] = []
        self.failed = False
        self._text = ""
        self._pos = 0
        self._depth = 0  # brackets open, the list's included
        self._quote: str | None = None
        self._escaped = False
        self._start = 0  # where the call being read begins

    def feed(self, text: str) -> None:
        self._text += text
        while self._pos < len(self._text) and not self.failed:
            ch = self._text[self._pos]
            self._pos += 1
            if self._quote is not None:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == self._quote:
                    self._quote = None
            elif ch in "'\"":
                self._quote = ch
            elif ch in "([{":
                if ch == "(" and self._depth == 1:
                    name = self._text[self._start : self._pos - 1].strip().lstrip("[,").strip()
                    if not name.isidentifier():
                        self.failed = True
                        return
                    self.calls.append(PartialCall(name))
                self._depth += 1
            elif ch in ")]}":
                self._depth -= 1
                if ch == ")" and self._depth == 1:
                    self._finish_call()
                    self._start = self._pos
            elif ch == "," and self._depth == 1:
                self._start = self._pos

    def _finish_call(self) -> None:
        source = self._text[self._start : self._pos].strip().lstrip("[,").strip()
        try:
            call = _call(ast.parse(source, mode="eval").body)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            call = None
        if call is None or not self.calls:
            self.failed = True
            return
        self.calls[-1].arguments, self.calls[-1].done = call.arguments, True
