"""Offline batch generation with aiolm.LLM: no event loop to manage, a progress bar, outputs in order.

``LLM`` runs its engine on a private event loop in a background thread, so this
works the same from a script, a notebook or a REPL. All prompts are queued at
once and batched continuously; results come back in the order of the prompts.

    python examples/offline_batch.py [--max-tokens 24]
"""

from __future__ import annotations

import argparse
import time

from aiolm import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Three things to pack for a beach trip:",
    "def is_prime(n):",
    "Water boils at",
    "A haiku about autumn:\n",
    "The quick brown fox",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--num-threads", type=int, default=0, help="torch threads per worker (0 = default)")
    p.add_argument("--executor", default="mp", choices=["mp", "local"])
    args = p.parse_args()

    t0 = time.perf_counter()
    with LLM(max_model_len=1024, kv_cache_memory=256 << 20, max_num_seqs=16,
             num_threads=args.num_threads, executor=args.executor) as llm:
        print(f"engine ready in {time.perf_counter() - t0:.1f}s")

        # One SamplingParams for every prompt; greedy, so the run is reproducible.
        greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        t1 = time.perf_counter()
        outputs = llm.generate(PROMPTS, greedy)  # a tqdm progress bar on stderr
        elapsed = time.perf_counter() - t1
        for prompt, out in zip(PROMPTS, outputs):
            assert out.prompt == prompt  # input order, whatever order they finished in
            print(f"{prompt!r} -> {out.outputs[0].text!r} [{out.outputs[0].finish_reason}]")
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        print(f"{len(outputs)} prompts, {tokens} tokens in {elapsed:.2f}s ({tokens / elapsed:.1f} tok/s)")

        # A list of SamplingParams, one per conversation; two samples for the second.
        conversations = [
            [{"role": "user", "content": "Name a primary colour."}],
            [{"role": "system", "content": "You are a poet."}, {"role": "user", "content": "Describe the sea."}],
        ]
        params = [SamplingParams(temperature=0.0, max_tokens=args.max_tokens),
                  SamplingParams(n=2, temperature=0.9, seed=1, max_tokens=args.max_tokens)]
        for conv, out in zip(conversations, llm.chat(conversations, params)):
            for c in out.outputs:
                print(f"chat {conv[-1]['content']!r} #{c.index} -> {c.text!r}")
    print("done")


if __name__ == "__main__":
    main()
