"""Engine logprobs -> the two OpenAI shapes (chat's ``content`` list, completions' columns)."""

from __future__ import annotations

import math
from typing import Any

from aiolm.outputs import Logprob

_FLOOR = -9999.0  # JSON has no -Infinity; OpenAI-compatible servers clamp like this


def clamp(v: float) -> float:
    return v if math.isfinite(v) and v > _FLOOR else _FLOOR


def _token(tid: int, entry: dict[int, Logprob], tokenizer: Any) -> tuple[str, float]:
    lp = entry.get(tid)
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token, clamp(lp.logprob)
    text = tokenizer.decode([tid]) if tokenizer is not None else ""
    return text, clamp(lp.logprob) if lp is not None else _FLOOR


def _top(entry: dict[int, Logprob], n: int) -> list[tuple[int, Logprob]]:
    return sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:n]


def chat_logprobs(token_ids: list[int], lps: list[dict[int, Logprob]] | None, top_n: int,
                  tokenizer: Any) -> dict[str, Any] | None:
    if lps is None:
        return None
    content = []
    for tid, entry in zip(token_ids, lps):
        text, value = _token(tid, entry, tokenizer)
        top = [{"token": lp.decoded_token or "", "logprob": clamp(lp.logprob),
                "bytes": list((lp.decoded_token or "").encode())} for _, lp in _top(entry, top_n)]
        content.append({"token": text, "logprob": value, "bytes": list(text.encode()), "top_logprobs": top})
    return {"content": content, "refusal": None}


class CompletionLogprobs:
    """Builds completions' column-shaped logprobs, keeping the text offset across chunks."""

    def __init__(self, top_n: int, tokenizer: Any, offset: int = 0) -> None:
        self.top_n = top_n
        self.tokenizer = tokenizer
        self.offset = offset

    def prompt(self, token_ids: list[int]) -> dict[str, Any]:
        """Echoed prompt tokens: the engine scores no prompt, so their logprobs are null."""
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid in token_ids:
            text = self.tokenizer.decode([tid])
            out["tokens"].append(text)
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    def generated(self, token_ids: list[int], lps: list[dict[int, Logprob]]) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, entry in zip(token_ids, lps):
            text, value = _token(tid, entry, self.tokenizer)
            out["tokens"].append(text)
            out["token_logprobs"].append(value)
            out["top_logprobs"].append({lp.decoded_token or "": clamp(lp.logprob) for _, lp in _top(entry, self.top_n)})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def merge(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    if a is None:
        return b
    return {k: a[k] + b[k] for k in a}
