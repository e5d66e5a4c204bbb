"""Llama 3.x JSON style: ``{"name": ..., "parameters": {...}}`` objects (``;``-separated for
several), optionally after ``<|python_tag|>``, as the whole output."""

from __future__ import annotations

import json

from aiolm.server.tool_parsers.base import ParsedCall, ToolParser, call_from_object

_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    markers = (_TAG, "{")
    at_start = True
    args_keys = ("parameters", "arguments")
    args_required = True  # bare JSON: any answer object with a "name" would be a call

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        body = text.strip()
        if body.startswith(_TAG):
            body = body[len(_TAG) :].lstrip()
        if not body.startswith("{"):
            return text, []
        decoder = json.JSONDecoder()
        calls: list[ParsedCall] = []
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError:
                return text, []
            call = call_from_object(obj, self.args_keys, self.args_required)
            if call is None:
                return text, []
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return None, calls
