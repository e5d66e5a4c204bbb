"""JSON a client sent, parsed with one bound on its nesting.

Python's parser gives up near the interpreter's recursion limit (about a thousand
levels) with a RecursionError rather than a ValueError, and whatever walks the
value afterwards (schema checks, the tool-call shaping, a grammar compiler that
recurses in C++) has a lower limit of its own. So client JSON deeper than
``MAX_DEPTH`` levels of arrays and objects is refused where it is parsed, with
one message, and nothing downstream meets a deeper value. Real requests (chat
messages, tool schemas, response formats) stay far below it.
"""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 128


class TooDeep(ValueError):
    def __init__(self) -> None:
        super().__init__(f"nested too deeply (more than {MAX_DEPTH} levels of arrays and objects)")


def loads(text: str | bytes | bytearray) -> Any:
    """``json.loads``, raising TooDeep past MAX_DEPTH (and ValueError when malformed)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise TooDeep() from None
    check_depth(value)
    return value


def check_depth(value: Any) -> None:
    """Raise TooDeep if ``value`` nests deeper than MAX_DEPTH (walked without recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > MAX_DEPTH:
            raise TooDeep()
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
