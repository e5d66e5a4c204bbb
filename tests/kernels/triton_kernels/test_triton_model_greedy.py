"""The embedded model gives the same greedy tokens on the Triton path as on its CPU path.

The Triton path is what the CUDA platform runs: the model is built with
``attention="triton"`` (``--attention-backend triton``, which the CPU platform offers under
TRITON_INTERPRET=1) and its norms, RoPE and SiLU-and-mul go through TritonOps. Through the
interpreter on a CPU; on a GPU, benchmarks/gpu/check.py does the same on CUDA.
"""

from __future__ import annotations

from collections import Counter

import pytest
from triton_cases import model_with_ops

from paged import PagedHarness


@pytest.mark.slow
def test_triton_path_greedy_matches_cpu_path(real_source, real_model, tokenizer, device, monkeypatch):
    if device != "cpu":
        pytest.skip("the session's model lives on the CPU; the GPU run is benchmarks/gpu/check.py")
    from aiolm.attention.triton_backend import TritonAttention
    from aiolm.kernels.triton import activation, norm, rope
    from aiolm.kernels.triton.ops import TritonOps

    prompts = [
        tokenizer.encode("The capital of France is"),
        tokenizer.encode("List three colours of the rainbow, then say why the sky is blue:"),
    ]
    max_new = 3
    # prefill in two passes: the first pass has two fresh chunks, the second two chunks that
    # attend to a cached prefix; then decode rows, all in flat batches of both prompts
    want = PagedHarness(real_model, block_size=16).greedy(prompts, max_new, split=3)

    triton_model = model_with_ops(real_source, TritonOps(), "triton")
    assert all(type(layer.self_attn.attn) is TritonAttention for layer in triton_model.layers)
    launches: Counter[str] = Counter()

    def counting(real, name):
        def counted(*a, **kw):
            launches[name] += 1
            return real(*a, **kw)

        return counted

    for mod, name in ((norm, "rms_norm"), (norm, "add_rms_norm_"), (rope, "rotary_"), (activation, "silu_and_mul")):
        monkeypatch.setattr(mod, name, counting(getattr(mod, name), name))
    got = PagedHarness(triton_model, block_size=16).greedy(prompts, max_new, split=3)
    assert got == want
    assert len(want[0]) == len(want[1]) == max_new
    # every op of every layer ran its kernel: 2 prefill passes + 2 decode steps
    layers, steps = len(triton_model.layers), 2 + max_new - 1
    assert launches == {
        "rms_norm": steps,
        "add_rms_norm_": (2 * layers - 1 + 1) * steps,
        "rotary_": layers * steps,
        "silu_and_mul": layers * steps,
    }, launches
