"""Engine logprobs -> the two OpenAI shapes (chat's ``content`` list, completions' columns)."""

from __future__ import annotations

import math
from typing import Any

from aiolm.outputs import Logprob

_FLOOR = -9999.0  # JSON has no -Infinity; OpenAI-compatible servers clamp like this


def clamp(v: float) -> float:
    return v if math.isfinite(v) and v > _FLOOR else _FLOOR


def _token(tid: int, entry: dict[int, Logprob], tokenizer: Any, as_ids: bool = False) -> tuple[str, float]:
    """A token's text (``as_ids``: ``token_id:<id>``, vLLM's spelling) and its logprob."""
    lp = entry.get(tid)
    if as_ids:
        return _as_id(tid), clamp(lp.logprob) if lp is not None else _FLOOR
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token, clamp(lp.logprob)
    text = tokenizer.decode([tid]) if tokenizer is not None else ""
    return text, clamp(lp.logprob) if lp is not None else _FLOOR


def _as_id(tid: int) -> str:
    return f"token_id:{tid}"


def _text(tid: int, lp: Logprob, as_ids: bool) -> str:
    return _as_id(tid) if as_ids else lp.decoded_token or ""


def _top(entry: dict[int, Logprob], n: int, named: list[int] | None = None) -> list[tuple[int, Logprob]]:
    """The ``n`` most likely of ``entry`` (-1, vLLM's "the whole vocabulary": all of them), or
    with ``named`` (vLLM's ``logprob_token_ids``) those tokens, in the order asked."""
    if named is not None:
        return [(t, entry[t]) for t in named if t in entry]
    return sorted(entry.items(), key=lambda kv: -kv[1].logprob)[: n if n >= 0 else None]


def prompt_logprobs_json(
    plp: list[dict[int, Logprob] | None] | None, token_ids: list[int], top_n: int
) -> list[dict[str, Any] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token, null for the first, else token id ->
    {logprob, rank, decoded_token} for the token itself and the top ``top_n`` (the engine
    may have scored more, for echo)."""
    if plp is None:
        return None
    out: list[dict[str, Any] | None] = []
    for tid, e in zip(token_ids, plp):
        if e is None:
            out.append(None)
            continue
        keep = [(tid, e[tid])] if tid in e else []
        keep += [(t, lp) for t, lp in _top(e, top_n) if t != tid]
        out.append(
            {
                str(t): {"logprob": clamp(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
                for t, lp in keep
            }
        )
    return out


def chat_logprobs(
    token_ids: list[int],
    lps: list[dict[int, Logprob]] | None,
    top_n: int,
    tokenizer: Any,
    as_ids: bool = False,
    named: list[int] | None = None,
) -> dict[str, Any] | None:
    """``as_ids``: tokens spelt ``token_id:<id>`` (vLLM's ``return_tokens_as_token_ids``);
    ``named``: these tokens as the top logprobs (vLLM's ``logprob_token_ids``)."""
    if lps is None:
        return None
    content = []
    for tid, entry in zip(token_ids, lps):
        text, value = _token(tid, entry, tokenizer, as_ids)
        top = [
            {
                "token": _text(t, lp, as_ids),
                "logprob": clamp(lp.logprob),
                "bytes": list(_text(t, lp, as_ids).encode()),
            }
            for t, lp in _top(entry, top_n, named)
        ]
        content.append({"token": text, "logprob": value, "bytes": list(text.encode()), "top_logprobs": top})
    return {"content": content, "refusal": None}


class CompletionLogprobs:
    """Builds completions' column-shaped logprobs, keeping the text offset across chunks."""

    def __init__(
        self, top_n: int, tokenizer: Any, offset: int = 0, as_ids: bool = False, named: list[int] | None = None
    ) -> None:
        """``as_ids``: tokens spelt ``token_id:<id>`` (vLLM's ``return_tokens_as_token_ids``);
        the text offsets still count the text. ``named``: these tokens as the generated
        tokens' top logprobs (vLLM's ``logprob_token_ids``)."""
        self.top_n = top_n
        self.named = named
        self.tokenizer = tokenizer
        self.offset = offset
        self.as_ids = as_ids

    def _top(self, tid: int, entry: dict[int, Logprob], named: list[int] | None) -> dict[str, float]:
        """A token's top logprobs; as OpenAI's completions give them, the token's own is there
        too ("up to logprobs + 1 elements"), so logprobs 0 still names it. Named tokens
        (``logprob_token_ids``) are those alone."""
        top = _top(entry, self.top_n, named)
        if named is None and tid in entry and all(t != tid for t, _ in top):
            top.append((tid, entry[tid]))
        return {_text(t, lp, self.as_ids): clamp(lp.logprob) for t, lp in top}

    def prompt(self, token_ids: list[int], plp: list[dict[int, Logprob] | None] | None) -> dict[str, Any]:
        """Echoed prompt tokens with their prompt logprobs (the first token has none: null)."""
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for i, tid in enumerate(token_ids):
            entry = plp[i] if plp is not None and i < len(plp) else None
            text = self.tokenizer.decode([tid])
            if entry is None:
                value, top = None, None
            else:
                value = _token(tid, entry, self.tokenizer)[1]
                top = self._top(tid, entry, None)
            out["tokens"].append(_as_id(tid) if self.as_ids else text)
            out["token_logprobs"].append(value)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    def generated(self, token_ids: list[int], lps: list[dict[int, Logprob]]) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, entry in zip(token_ids, lps):
            text, value = _token(tid, entry, self.tokenizer)
            out["tokens"].append(_as_id(tid) if self.as_ids else text)
            out["token_logprobs"].append(value)
            out["top_logprobs"].append(self._top(tid, entry, self.named))
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def merge(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    if a is None:
        return b
    return {k: a[k] + b[k] for k in a}
