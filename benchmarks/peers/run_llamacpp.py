"""llama.cpp (llama-cpp-python) on the same GGUF, one request at a time: python run_llamacpp.py GGUF."""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import report, workload  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("--dtype", default="q4_1", help="the GGUF's weight type, as the result's label")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--single", action="store_true", help="one prompt of --prompt-len tokens, 128 outputs")
    ap.add_argument("--prompt-len", type=int, default=128, help="with --single")
    a = ap.parse_args()
    from llama_cpp import Llama

    llm = Llama(model_path=a.gguf, n_ctx=max(2048, a.prompt_len + 128), n_threads=2, n_batch=512, verbose=False, seed=0)
    items = workload(1, (a.prompt_len, a.prompt_len), (128, 128), seed=1) if a.single else workload(a.num_requests)

    def one(prompt: list[int], n: int) -> None:
        llm.reset()
        got = 0
        for _tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            got += 1
            if got >= n:
                break

    one(items[0][0][:16], 4)
    times = []
    for _ in range(a.repeats):
        t = time.perf_counter()
        for p, o in items:
            one(p, o)
        times.append(time.perf_counter() - t)
    report("llama.cpp", a.dtype, times, sum(o for _, o in items))


if __name__ == "__main__":
    main()
