"""What every batched LoRA kernel computes, in plain torch: the reference the CPU and Triton
kernels are tested against, and the path of any device that has neither.

One linear layer holds ``S`` adapter slots. A fused layer (q/k/v, gate/up) has ``L``
slices of output columns, each with its own LoRA pair, so a slot's A matrices are stacked
along the rank, ``lora_a[s, i*R:(i+1)*R]`` being slice i's, and its B matrices along the
output, ``lora_b[s, c_i:c_{i+1}]``, each over the R columns of its own slice's part of the
shrunk row. An adapter of rank r < R fills the first r of its slice's R and leaves zeros;
its scaling (alpha / r, or alpha / sqrt(r) for rsLoRA) is already in B.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def lora_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slot_ids: torch.Tensor,
    slice_starts: Sequence[int],
) -> None:
    """In place, for every row t whose slot s = slot_ids[t] is >= 0 and every slice i:
    ``y[t, c_i:c_{i+1}] += (x[t] @ lora_a[s, i*R:(i+1)*R].T) @ lora_b[s, c_i:c_{i+1}].T``,
    accumulated in float32. Rows whose slot is -1 are left as they are.

    x [T, K]; y [T, N]; lora_a [S, L*R, K]; lora_b [S, N, R]; slot_ids integer [>= T] (a
    static buffer may be longer than the batch: entries past T are not read);
    slice_starts: L + 1 column offsets, 0 = c_0 < c_1 < ... < c_L = N.
    """
    t = x.shape[0]
    rank = lora_b.shape[2]
    ids = slot_ids[:t].long()
    for s in ids.unique().tolist():
        if s < 0:
            continue
        rows = (ids == s).nonzero().squeeze(1)
        shrunk = x[rows].float() @ lora_a[s].float().T  # [n, L*R]
        for i in range(len(slice_starts) - 1):
            c0, c1 = slice_starts[i], slice_starts[i + 1]
            delta = shrunk[:, i * rank : (i + 1) * rank] @ lora_b[s, c0:c1].float().T
            y[rows, c0:c1] += delta.to(y.dtype)
