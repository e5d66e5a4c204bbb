"""How far an fp8 (e4m3) or float16 KV cache moves the embedded model's logits from a float32
cache's, on the parity prompts and 32 greedy tokens each, teacher-forced (every cache sees
the float32 cache's tokens, so one early change does not hide the later ones).

    python benchmarks/fp8_kv_error.py [--tokens 32]

Per cache and prompt: the mean |logit difference| over the continuation, how many of its
positions pick another token than the float32 cache, and the float32 cache's smallest margin
between its two best tokens there (a change of the logits larger than that margin can make
greedy decoding part).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

from aiolm.checkpoint.source import resolve_model  # noqa: E402
from aiolm.model.registry import build_model  # noqa: E402
from paged import PagedHarness, parity_prompt_ids  # noqa: E402  (the tests' paged-cache driver)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32)
    a = p.parse_args()
    source = resolve_model(None)
    model = build_model(source, torch.float32)
    prompts = parity_prompt_ids(source.load_tokenizer())
    # each prompt followed by its greedy tokens over a float32 cache
    seqs = [p + c for p, c in zip(prompts, PagedHarness(model).greedy(prompts, a.tokens))]

    def logits(dtype: torch.dtype) -> list[torch.Tensor]:
        h = PagedHarness(model, dtype=dtype)  # one prefill a sequence: its positions read the cache
        return [h.step({i: s}, every=True)[i][-a.tokens - 1 : -1] for i, s in enumerate(seqs)]

    ref = logits(torch.float32)
    top2 = [r.topk(2).values for r in ref]
    margins = [(t[:, 0] - t[:, 1]).min().item() for t in top2]
    print("float32 cache's least top-2 margin per prompt:", " ".join(f"{m:.3f}" for m in margins))
    for name, dtype in (("float16", torch.float16), ("fp8 e4m3", torch.float8_e4m3fn)):
        got = logits(dtype)
        diff = [(g - r).abs().mean().item() for g, r in zip(got, ref)]
        flips = [int((g.argmax(-1) != r.argmax(-1)).sum()) for g, r in zip(got, ref)]
        print(
            f"{name:9s} mean |logit diff| per prompt {' '.join(f'{d:.4f}' for d in diff)}; "
            f"tokens changed {sum(flips)}/{a.tokens * len(seqs)} ({' '.join(map(str, flips))})"
        )


if __name__ == "__main__":
    main()
