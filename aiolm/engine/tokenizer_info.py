"""The tokenizer's configuration as plain JSON: what vLLM's ``/tokenizer_info`` serves.

Clients that tokenize or render prompts on their side (routers, eval harnesses)
read it to match the server: the tokenizer class, its special tokens and the
chat template. It is ``tokenizer_config.json`` as the tokenizer was built, less
the server's own file paths.
"""

from __future__ import annotations

from typing import Any

# Where the tokenizer's files lie on the server: no use to a client, and not its business.
_PATHS = frozenset({"vocab_file", "merges_file", "tokenizer_file", "name_or_path"})
_SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")


def _plain(value: Any) -> Any:
    """JSON-able: an AddedToken becomes its text, dict keys (token ids) strings."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "content"):  # tokenizers.AddedToken
        return value.content
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def tokenizer_config(tokenizer: Any) -> dict[str, Any]:
    """``tokenizer_class``, ``vocab_size``, the special tokens (null when the tokenizer has
    none), ``chat_template`` when there is one, and the rest of the tokenizer's init kwargs."""
    init = getattr(tokenizer, "init_kwargs", None) or {}
    config = {k: _plain(v) for k, v in init.items() if k not in _PATHS}
    for name in _SPECIAL:
        if config.get(name) is None:
            config[name] = _plain(getattr(tokenizer, name, None))
    config["tokenizer_class"] = type(tokenizer).__name__
    config["vocab_size"] = len(tokenizer)
    template = getattr(tokenizer, "chat_template", None)
    config["chat_template"] = template if isinstance(template, str) else config.get("chat_template")
    return config
