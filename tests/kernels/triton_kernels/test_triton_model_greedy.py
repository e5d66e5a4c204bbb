"""The embedded model gives the same greedy tokens with TritonAttention as with its CPU attention.

The model is built with ``attention="triton"`` (``--attention-backend triton``), which the CPU
platform offers under TRITON_INTERPRET=1. Through the interpreter on a CPU; on a GPU,
benchmarks/gpu/check.py does the same on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from paged import PagedHarness


@pytest.mark.slow
def test_triton_attention_greedy_matches_cpu_path(real_source, real_model, tokenizer, device):
    if device != "cpu":
        pytest.skip("the session's model lives on the CPU; the GPU run is benchmarks/gpu/check.py")
    from aiolm.attention.triton_backend import TritonAttention
    from aiolm.model.registry import build_model

    prompts = [tokenizer.encode("The capital of France is"),
               tokenizer.encode("List three colours of the rainbow, then say why the sky is blue:")]
    max_new = 5
    # prefill in two passes: the first pass has two fresh chunks, the second two chunks that
    # attend to a cached prefix; then decode rows, all in flat batches of both prompts
    want = PagedHarness(real_model, block_size=16).greedy(prompts, max_new, split=3)

    triton_model = build_model(real_source, torch.float32, attention="triton")
    assert all(type(layer.self_attn.attn) is TritonAttention for layer in triton_model.layers)
    got = PagedHarness(triton_model, block_size=16).greedy(prompts, max_new, split=3)
    assert got == want
    assert len(want[0]) == len(want[1]) == max_new
