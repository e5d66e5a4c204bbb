"""Structured outputs: a request's grammar (JSON schema, regex, choice, EBNF) and its backend."""
