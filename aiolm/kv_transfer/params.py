"""``kv_transfer_params``: what a request and its answer say about moving its KV, in the
shape vLLM's disaggregation proxy reads and writes.

To a prefill instance: ``{"do_remote_decode": true}`` (compute the prompt and keep its
blocks for a decode instance). Its answer carries the params for the decode instance:
``do_remote_prefill`` true and where the blocks are (``remote_host``, ``remote_port``,
``remote_block_ids``, ``remote_request_id``, ``remote_engine_id``, ``tp_size``). Pure
Python: checked where SamplingParams is checked.
"""

from __future__ import annotations

from typing import Any

_TYPES: dict[str, tuple[type, ...]] = {
    "do_remote_decode": (bool,),
    "do_remote_prefill": (bool,),
    "remote_engine_id": (str,),
    "remote_host": (str,),
    "remote_port": (int,),
    "remote_block_ids": (list,),
    "remote_request_id": (str,),
    "tp_size": (int,),
}
_NEEDED_FOR_PREFILL = ("remote_host", "remote_port", "remote_block_ids", "remote_request_id")


def check_kv_transfer_params(params: Any) -> str | None:
    """Why ``params`` cannot be used (a sentence naming the key), or None."""
    if params is None:
        return None
    if not isinstance(params, dict):
        return "must be an object"
    for key, value in params.items():
        types = _TYPES.get(key)
        if types is None:
            return f"{key!r} is not supported; supported: {', '.join(_TYPES)}"
        if value is None:
            continue
        if not isinstance(value, types) or (types != (bool,) and isinstance(value, bool)):
            return f"{key!r} must be a {types[0].__name__}"
    if params.get("do_remote_decode") and params.get("do_remote_prefill"):
        return "do_remote_decode and do_remote_prefill cannot both be true"
    if params.get("do_remote_prefill"):
        for key in _NEEDED_FOR_PREFILL:
            if params.get(key) is None:
                return f"do_remote_prefill needs {key!r} (the prefill instance's answer carries it)"
        ids = params["remote_block_ids"]
        if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in ids):
            return "'remote_block_ids' must be block ids (integers >= 0)"
        if not 1 <= params["remote_port"] <= 65535:
            return "'remote_port' must be a port number"
    return None


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    return bool(params and params.get("do_remote_decode"))


def wants_remote_prefill(params: dict[str, Any] | None) -> bool:
    return bool(params and params.get("do_remote_prefill"))
