"""transformers generate() on left-padded static batches: python run_transformers.py GGUF [--dtype bfloat16]."""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import report, workload  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--single", action="store_true", help="one 128-token prompt, 128 outputs")
    a = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    dt = getattr(torch, a.dtype)
    path = os.path.abspath(a.gguf)
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dt).eval()
    items = workload(1, (128, 128), (128, 128), seed=1) if a.single else workload(a.num_requests)
    pad = 0

    def run() -> None:
        for i in range(0, len(items), a.batch):
            chunk = items[i:i + a.batch]
            width = max(len(p) for p, _ in chunk)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
            new = max(o for _, o in chunk)
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                               do_sample=False, pad_token_id=pad)

    if a.single:  # warm-up for the short run; the long one warms itself
        run()
    times = []
    for _ in range(a.repeats):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    report("transformers-static16", a.dtype, times, sum(o for _, o in items))


if __name__ == "__main__":
    main()
