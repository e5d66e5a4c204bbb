"""Verifying speculative drafts in one forward pass: exact for greedy, distribution-
preserving for sampling.

A request with drafts d_0..d_{k-1} ran positions whose logits give the target
distribution p_j of the token after ``output + d[:j]``, for j = 0..k. Each j becomes
its own sampling row, with ``output + d[:j]`` as its history, so every logits
processor (bias, allowed ids, bad words, min tokens, penalties) sees exactly the
state it would have seen had the tokens been generated one at a time, and the
sampler applies temperature, top-k, top-p and min-p as usual. Then:

* row j draws t_j ~ p_j (the argmax for greedy rows);
* drafts are accepted while t_j == d_j; the first mismatch t_a (or the bonus t_k
  when all match) is the one extra token. The step emits ``t_0..t_a``.

For a deterministic proposer (q_j = one-hot on d_j, as n-gram drafts are) this is
the standard rejection sampler: it accepts d_j with probability min(1, p_j(d_j) /
q_j(d_j)) = p_j(d_j), and given a rejection t_j is distributed as p_j with d_j
removed and renormalised, the residual max(0, p_j - q_j) normalised. Each
emitted token is therefore a draw from p given the tokens before it, exactly as
in plain decoding; for greedy rows it is the argmax, so the output is the same
token for token (up to the forward pass's own rounding, which the parity tests
check). Requests the rows cannot model are kept out of speculation upstream
(``aiolm/spec_decode/config.py``).
"""

from __future__ import annotations

from collections.abc import Sequence


def verify_positions(sample_idx: Sequence[int], query_ends: Sequence[int], num_drafts: Sequence[int]) -> list[int]:
    """Flat-batch indices whose logits are needed: for each sampling request i, its last
    ``num_drafts[i] + 1`` positions (the last known token, then each draft)."""
    out: list[int] = []
    for i in sample_idx:
        end = query_ends[i]
        out.extend(range(end - 1 - num_drafts[i], end))
    return out


def row_histories(output: list[int], drafts: Sequence[int]) -> list[list[int]]:
    """Output token history of each verification row: ``output + drafts[:j]``, j = 0..k."""
    return [output] + [output + list(drafts[:j]) for j in range(1, len(drafts) + 1)]


def accepted_prefix(sampled: Sequence[int], drafts: Sequence[int]) -> int:
    """How many drafts are accepted: the leading ones the rows' own draws agree with."""
    a = 0
    while a < len(drafts) and sampled[a] == drafts[a]:
        a += 1
    return a
