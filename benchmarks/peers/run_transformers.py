"""transformers on the offline workload: generate() on left-padded static batches, or with
--continuous its own continuous batching (the manager behind generate_batch, each request
with its own max_new_tokens and no EOS): python run_transformers.py MODEL [--dtype bfloat16], MODEL a
GGUF file or a Hugging Face folder."""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import report, workload  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", help="a .gguf file or a Hugging Face folder")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--single", action="store_true", help="one prompt of --prompt-len tokens, 128 outputs")
    ap.add_argument("--prompt-len", type=int, default=128, help="with --single")
    ap.add_argument("--continuous", action="store_true", help="continuous batching instead of static batches")
    a = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    dt = getattr(torch, a.dtype)
    path = os.path.abspath(a.model)
    if os.path.isdir(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dt).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dt
        ).eval()
    items = workload(1, (a.prompt_len, a.prompt_len), (128, 128), seed=1) if a.single else workload(a.num_requests)
    pad = 0

    def run() -> None:
        for i in range(0, len(items), a.batch):
            chunk = items[i : i + a.batch]
            width = max(len(p) for p, _ in chunk)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
            new = max(o for _, o in chunk)
            with torch.no_grad():
                model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    pad_token_id=pad,
                )

    if a.continuous:
        run = continuous(model, items)
    if a.single:  # warm-up for the short run; the long one warms itself
        run()
    times = []
    for _ in range(a.repeats):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    report("transformers-cb" if a.continuous else "transformers-static16", a.dtype, times, sum(o for _, o in items))


def continuous(model, items):
    from transformers import GenerationConfig

    cfg = GenerationConfig(do_sample=False, max_new_tokens=max(o for _, o in items), pad_token_id=0, eos_token_id=-1)

    def run() -> None:
        with model.continuous_batching_context_manager(generation_config=cfg, block=True, timeout=5) as m:
            for i, (p, o) in enumerate(items):
                m.add_request(list(p), request_id=f"r{i}", max_new_tokens=o, eos_token_id=-1)
            done = 0
            deadline = time.monotonic() + 3600
            while done < len(items):
                r = m.get_result(timeout=1)
                if r is not None and r.is_finished():
                    if len(r.generated_tokens) != items[int(r.request_id[1:])][1]:
                        raise RuntimeError(f"{r.request_id}: {len(r.generated_tokens)} tokens generated")
                    done += 1
                elif r is None and (not m.is_running() or time.monotonic() > deadline):
                    raise RuntimeError("transformers' continuous batching stopped early")

    return run


if __name__ == "__main__":
    main()
