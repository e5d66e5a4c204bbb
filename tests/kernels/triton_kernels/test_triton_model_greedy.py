"""The embedded model gives the same greedy tokens with TritonAttention as with its CPU attention.

No attention selector exists in the model yet, so this test swaps each layer's backend
(``layer.self_attn.attn``) for the Triton one, and monkeypatch puts the CPU one back.
Through the interpreter on a CPU; on a GPU, benchmarks/gpu/check.py does the same on CUDA.
"""

from __future__ import annotations

import pytest

from paged import PagedHarness


@pytest.mark.slow
def test_triton_attention_greedy_matches_cpu_path(real_model, tokenizer, monkeypatch, device):
    if device != "cpu":
        pytest.skip("the session's model lives on the CPU; the GPU run is benchmarks/gpu/check.py")
    from aiolm.attention.triton_backend import TritonAttention

    prompts = [tokenizer.encode("The capital of France is"),
               tokenizer.encode("List three colours of the rainbow, then say why the sky is blue:")]
    max_new = 5
    # prefill in two passes: the first pass has two fresh chunks, the second two chunks that
    # attend to a cached prefix; then decode rows, all in flat batches of both prompts
    want = PagedHarness(real_model, block_size=16).greedy(prompts, max_new, split=3)

    for layer in real_model.layers:
        a = layer.self_attn
        monkeypatch.setattr(a, "attn", TritonAttention(a.num_heads, a.num_kv_heads, a.head_dim, a.attn.scale))
    got = PagedHarness(real_model, block_size=16).greedy(prompts, max_new, split=3)
    assert got == want
    assert len(want[0]) == len(want[1]) == max_new
