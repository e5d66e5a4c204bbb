"""Tool calls read while they are being written: JSON as it arrives, re-spelt the way the
finished call's arguments are.

A finished call's ``arguments`` is ``json_text(args)`` of what the model wrote: its
``json.dumps(args, ensure_ascii=False)`` with lone surrogates escaped (base.py).
``JsonSpeller`` writes that same text a character at a time from the model's raw JSON:
punctuation with ``json.dumps``' separators, strings decoded and escaped as ``json.dumps``
escapes them, each released as its characters arrive, numbers and literals once they end. What
it has written is never taken back, so a stream can send it at once and the pieces join to the
finished call's arguments (for any JSON without repeated keys, which ``json.loads`` would
collapse).

``JsonCallsReader`` reads a run of call objects (``{"name": ..., "arguments": {...}}``,
with whatever lies between them skipped): the name once its string is complete, the
arguments as they are spelt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from aiolm.server.errors import escape_lone_surrogates

_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_NUMBER = set("+-.0123456789eE")
_LITERALS = ("true", "false", "null")


def json_text(value: Any) -> str | None:
    """A call's arguments as the JSON text sent; None where JSON cannot say them (NaN, an
    infinity: json.loads takes them, a client's parser does not)."""
    try:
        return escape_lone_surrogates(json.dumps(value, ensure_ascii=False, allow_nan=False))
    except (TypeError, ValueError):
        return None


def _spell(ch: str) -> str:
    return escape_lone_surrogates(json.dumps(ch, ensure_ascii=False)[1:-1])


class JsonSpeller:
    """One JSON value, fed raw text; ``out`` is its normalized spelling so far. For the
    top-level object it records where each key's value is spelt (``spans``) and the text
    of string values (``strings``)."""

    def __init__(self) -> None:
        self.out: list[str] = []
        self.size = 0  # characters in out
        self.stack: list[list[str]] = []  # per open container: [kind, expecting, key]
        self.done = False
        self.failed = False
        self.spans: dict[str, tuple[int, int | None]] = {}  # top-level key -> (start, end)
        self.strings: dict[str, str] = {}  # top-level key -> its completed string value
        self._str: list[str] | None = None  # the string being read (decoded)
        self._str_is_key = False
        self._escape: str | None = None  # an escape sequence still arriving
        self._high: str | None = None  # a high surrogate waiting for its pair
        self._atom = ""  # a number or literal still arriving

    def _emit(self, text: str) -> None:
        self.out.append(text)
        self.size += len(text)

    def text(self, start: int = 0, end: int | None = None) -> str:
        return "".join(self.out)[start:end]

    def feed(self, text: str) -> int:
        """Consume ``text``; returns how many characters it used (fewer once the value ended)."""
        for i, ch in enumerate(text):
            if self.done or self.failed:
                return i
            self._char(ch)
        return len(text)

    # -- the state machine ------------------------------------------------------------

    def _char(self, ch: str) -> None:
        if self._str is not None:
            self._string_char(ch)
            return
        if self._atom:
            if ch in _NUMBER or ch.isalpha():
                self._atom += ch
                return
            self._end_atom()
            if self.failed:
                return
        if ch in " \t\r\n":
            return
        expecting = self.stack[-1][1] if self.stack else "value"
        if expecting == "key":
            if ch == '"':
                self._open_string(key=True)
            elif ch == "}" and self.stack[-1][2] == "":  # {} : no key yet
                self._close("}")
            else:
                self.failed = True
        elif expecting == "colon":
            if ch == ":":
                self._emit(": ")
                self.stack[-1][1] = "value"
                self._value_starts()
            else:
                self.failed = True
        elif expecting == "comma":
            kind = self.stack[-1][0]
            if ch == ",":
                self._emit(", ")
                self.stack[-1][1] = "key" if kind == "{" else "value"
            elif ch == ("}" if kind == "{" else "]"):
                self._close(ch)
            else:
                self.failed = True
        else:  # a value
            in_array = bool(self.stack) and self.stack[-1][0] == "["
            if ch == "]" and in_array and self.stack[-1][2] == "":
                self._close("]")  # [] : no value yet
                return
            if in_array:
                self.stack[-1][2] = "+"  # a value has begun: "]" is no longer "[]"
            if ch == "{" or ch == "[":
                self._emit(ch)
                self.stack.append([ch, "key" if ch == "{" else "value", ""])
            elif ch == '"':
                self._open_string(key=False)
                self._emit('"')
            elif ch in _NUMBER or ch.isalpha():
                self._atom = ch
            else:
                self.failed = True

    def _value_starts(self) -> None:
        """After a key's colon: a top-level key's value is spelt from here."""
        if len(self.stack) == 1:
            self.spans[self.stack[0][2]] = (self.size, None)

    def _value_ends(self, string: str | None = None) -> None:
        if not self.stack:
            self.done = True
            return
        top = self.stack[-1]
        top[1] = "comma"
        if len(self.stack) == 1 and top[0] == "{":
            key = top[2]
            self.spans[key] = (self.spans[key][0], self.size)
            if string is not None:
                self.strings[key] = string

    def _close(self, ch: str) -> None:
        self._emit(ch)
        self.stack.pop()
        self._value_ends()

    def _open_string(self, key: bool) -> None:
        self._str, self._str_is_key = [], key

    def _string_char(self, ch: str) -> None:
        assert self._str is not None
        if self._escape is not None:
            self._escape += ch
            if self._escape[1] == "u":
                if len(self._escape) < 6:
                    return
                try:
                    decoded = chr(int(self._escape[2:], 16))
                except ValueError:
                    self.failed = True
                    return
            elif self._escape[1] in _ESCAPES:
                decoded = _ESCAPES[self._escape[1]]
            else:
                self.failed = True
                return
            self._escape = None
            self._string_text(decoded)
            return
        if ch == "\\":
            self._escape = ch
        elif ch == '"':
            self._end_string()
        elif ord(ch) < 0x20:  # raw control characters: not JSON (json.loads is strict)
            self.failed = True
        else:
            self._string_text(ch)

    def _string_text(self, ch: str) -> None:
        assert self._str is not None
        if self._high is not None:
            ch, self._high = (self._high + ch).encode("utf-16", "surrogatepass").decode("utf-16", "replace"), None
        elif "\ud800" <= ch <= "\udbff":
            self._high = ch  # a surrogate pair's first half: wait for the second
            return
        self._str.append(ch)
        if not self._str_is_key:
            self._emit(_spell(ch))

    def _end_string(self) -> None:
        assert self._str is not None
        if self._high is not None:
            self._string_text("")  # a lone high surrogate, kept as json.loads keeps it
        text, self._str = "".join(self._str), None
        if self._str_is_key:
            top = self.stack[-1]
            top[2] = text or "\x00"  # the empty key is still a key seen ("}" is no longer "{}")
            self._emit(escape_lone_surrogates(json.dumps(text, ensure_ascii=False)))
            top[1] = "colon"
            return
        self._emit('"')
        self._value_ends(text)

    def _end_atom(self) -> None:
        atom, self._atom = self._atom, ""
        try:
            value = json.loads(atom)
        except ValueError:
            self.failed = True
            return
        if atom.isalpha() and atom not in _LITERALS:
            self.failed = True
            return
        try:
            self._emit(json.dumps(value, allow_nan=False))
        except ValueError:  # NaN, an infinity, 1e999: json.loads takes them, JSON has no such number
            self.failed = True
            return
        self._value_ends()


@dataclass
class PartialCall:
    """A call as far as it has been read: ``arguments`` is a prefix of the finished call's."""

    name: str | None = None
    arguments: str = ""
    done: bool = False


class JsonCallsReader:
    """Call objects one after another in a stream; anything before an object's ``{`` is
    skipped (tags, separators, a list's brackets and commas)."""

    def __init__(self, args_keys: tuple[str, ...] = ("arguments",), args_required: bool = False) -> None:
        """``args_required``: an object is a call only with an arguments key (its name is held
        back until one is seen), as the finished text is read (base.call_from_object)."""
        self.args_keys = args_keys
        self.args_required = args_required
        self.calls: list[PartialCall] = []
        self._obj: JsonSpeller | None = None
        self.failed = False

    def feed(self, text: str) -> None:
        while text and not self.failed:
            if self._obj is None:
                at = text.find("{")
                if at < 0:
                    return
                text = text[at:]
                self._obj = JsonSpeller()
                self.calls.append(PartialCall())
            used = self._obj.feed(text)
            text = text[used:]
            self._update(self.calls[-1], self._obj)
            if self._obj.failed:
                self.failed = True
            elif self._obj.done:
                self._obj = None

    def _update(self, call: PartialCall, obj: JsonSpeller) -> None:
        key = next((k for k in self.args_keys if k in obj.spans), None)
        if call.name is None and "name" in obj.strings and (key is not None or not self.args_required):
            call.name = obj.strings["name"]
        if key is not None:
            start, end = obj.spans[key]
            spelt = obj.text(start, end)
            if spelt.startswith('"'):  # arguments written as JSON text: read once complete
                if end is not None:
                    try:
                        text = json_text(json.loads(obj.strings[key]))
                    except ValueError:
                        text = None
                    if text is None:
                        self.failed = True
                    else:
                        call.arguments = text
            elif spelt.startswith("{"):  # only an object can be a call's arguments
                call.arguments = spelt
        if obj.done:
            call.done = True
            if key is None:
                if self.args_required:
                    self.failed = True  # an object with a "name", not a call
                call.arguments = "{}"
