"""Chat messages shaped as the model's own template reads them, as vLLM shapes them.

Templates differ in what they take: most read a message's ``content`` as a string, some
(LLaVA's, many vision models') loop over a list of typed parts and render nothing from a
string; most know no ``developer`` role (OpenAI's newer name for ``system``) and drop or
mislabel such a message. Both are read from the template once and applied to every
conversation rendered through it, on the server and in ``LLM.chat`` alike.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

import jinja2
from jinja2 import nodes


@functools.lru_cache(maxsize=16)
def template_traits(template: str) -> tuple[bool, bool]:
    """(whether the template loops over a message's content parts, whether it names the
    ``developer`` role)."""
    try:
        tree = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return False, "developer" in template
    loops = any(_is_content(_unfiltered(loop.iter)) for loop in tree.find_all(nodes.For))
    return loops, "developer" in template


def _unfiltered(node: nodes.Node) -> nodes.Node:
    """What a chain of filters (``message['content'] | selectattr(...)``) is applied to."""
    while isinstance(node, nodes.Filter) and node.node is not None:
        node = node.node
    return node


def _is_content(node: nodes.Node) -> bool:
    """``x.content`` or ``x['content']`` itself: what a loop over content parts iterates
    (``message.content.split(...)`` loops over a string's lines)."""
    if isinstance(node, nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
    return False


def shaped_for(template: str, messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` (OpenAI's shapes) as ``template`` reads them: string content as one text
    part where it loops over parts, text parts joined a line apart where it does not; a
    call's JSON arguments as an object (templates serialize them themselves); ``developer``
    as ``system`` where it knows no such role."""
    parts, developer = template_traits(template)
    out = []
    for m in messages:
        m = dict(m)
        if not developer and m.get("role") == "developer":
            m["role"] = "system"
        content = m.get("content")
        if parts and isinstance(content, str):
            m["content"] = [{"type": "text", "text": content}] if content else []
        elif not parts and isinstance(content, list) and all(_is_text(p) for p in content):
            m["content"] = "\n".join(p["text"] for p in content)
        if isinstance(m.get("tool_calls"), list):
            m["tool_calls"] = [_with_object_arguments(c) for c in m["tool_calls"]]
        out.append(m)
    return out


def _is_text(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


def _with_object_arguments(call: Any) -> Any:
    """A call whose arguments are JSON text with them as an object; text that is not an
    object (an answer cut by max_tokens) as no arguments, as vLLM gives them."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
    except ValueError:
        args = {}
    return {**call, "function": {**fn, "arguments": args if isinstance(args, dict) else {}}}
