"""Seeded random workloads, identical for aiolm and every peer.

The offline-64 workload of docs/benchmarks.md: numpy default_rng(seed); prompt lengths
integers(lo, hi+1), output lengths integers(lo, hi+1), then each prompt as
integers(100, 40001, size=len) token ids.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path

from aiolm.config import positive


@dataclass
class Item:
    prompt_token_ids: list[int]
    max_tokens: int
    prompt_text: str | None = None  # sent instead of the ids to servers that only take text


def as_text(items: list[Item], tokenizer: object) -> list[Item]:
    """The same prompts as text, for servers that refuse token-id prompts (llama-cpp-python)."""
    return [
        Item(it.prompt_token_ids, it.max_tokens, tokenizer.decode(it.prompt_token_ids))  # type: ignore[attr-defined]
        for it in items
    ]


def random_workload(
    num_requests: int = 64,
    prompt_len: tuple[int, int] = (64, 256),
    output_len: tuple[int, int] = (32, 128),
    seed: int = 0,
) -> list[Item]:
    import numpy as np

    rng = np.random.default_rng(seed)
    plens = rng.integers(prompt_len[0], prompt_len[1] + 1, size=num_requests)
    olens = rng.integers(output_len[0], output_len[1] + 1, size=num_requests)
    return [Item(rng.integers(100, 40001, size=int(p)).tolist(), int(o)) for p, o in zip(plens, olens)]


def jsonl_workload(path: str | Path) -> list[Item]:
    """Lines of {"prompt_token_ids": [...], "max_tokens": N}."""
    items = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            ids, most = d["prompt_token_ids"], d["max_tokens"]
            if not (isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids)):
                raise ValueError("prompt_token_ids must be a non-empty list of token ids")
            if not (isinstance(most, int) and most >= 1):
                raise ValueError("max_tokens must be an integer >= 1")
        except (ValueError, KeyError, TypeError) as e:
            why = f"no {e}" if isinstance(e, KeyError) else str(e)
            raise ValueError(f"{path}, line {number}: {why} (lines are {{prompt_token_ids, max_tokens}})") from None
        items.append(Item(list(ids), most))
    if not items:
        raise ValueError(f"{path}: no requests in it")
    return items


def parse_range(text: str) -> tuple[int, int]:
    """``lo-hi`` (or one number) of token counts, 1 <= lo <= hi; an argparse type."""
    lo, _, hi = str(text).partition("-")
    try:
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a range of token counts like 64-256") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"{text!r}: the range must run from at least 1 up (lo-hi, lo <= hi)")
    return low, high


def existing_file(text: str) -> str:
    """A path that is a readable file; an argparse type."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text!r}: no such file")
    return text


def rate_list(text: str) -> list[float]:
    """A comma list of request rates (req/s, > 0; inf = all at once); an argparse type."""
    return [positive(r) for r in str(text).split(",")]
