"""What a request's output must match, as plain text that travels with its SamplingParams.

The engine validates the text once (``validator.Validator``, in a compile process)
before the request is queued; the worker compiles the same text into a token
mask (``aiolm/sample/logits_processors/grammar.py``). Both sides cache by the
text, so a grammar repeated across requests is compiled once per process. No
compiled object crosses the process boundary: xgrammar's compiled grammars do
not pickle, and their serialization (the token-mask cache included) is far
larger than the text it is compiled from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json", "json_object", "regex", "grammar")
# JSON schema keywords whose value maps names (any string, "const" too) to subschemas
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


@dataclass(frozen=True)
class StructuredOutputs:
    """``kind``: json (``text`` is a JSON schema), json_object (any JSON object; ``text`` is
    empty), regex, or grammar (EBNF/GBNF whose start rule is ``root``). ``strict``: with
    json, properties the schema does not list are not generated. ``after``: the output
    is free until it contains these tokens (a reasoning model's end-of-thinking marker),
    and the grammar constrains what follows them; empty, it constrains from the start.
    ``opens`` (one token, with ``after``: the start-of-thinking marker, when the prompt leaves
    it to the model whether to think): unless the output starts with it, the grammar
    constrains from the first token (a model that does not think is constrained too)."""

    kind: str
    text: str = ""
    strict: bool = True
    after: tuple[int, ...] = ()
    opens: tuple[int, ...] = ()

    def key(self) -> tuple[str, str, bool]:
        return (self.kind, self.text, self.strict)


def choice_grammar(choices: list[str]) -> str:
    """EBNF that matches exactly one of ``choices`` (vLLM's ``choice`` / ``guided_choice``)."""
    # JSON string literals are valid EBNF string literals (same escapes) once non-ASCII is kept raw.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
