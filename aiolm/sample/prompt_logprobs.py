"""Prompt logprobs: how likely the model found each prompt token given the ones before it.

Computed on the worker from the hidden states of a prefill chunk, which are
otherwise thrown away except for the last position: position p's logits score
prompt token p + 1. Raw float32 log-softmax, like the sampled tokens' logprobs
(``sampler.py``). Logits for a long chunk are made a slice of rows at a time,
so a 2048-token chunk does not need a [2048, vocab] float32 tensor at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from aiolm.core.step import LogprobsLists, PromptLogprobs

_ROWS_PER_SLICE = 256


def score_prompt(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    start_loc: int,
    first_pos: int,
    num_positions: int,
    prompt: Sequence[int],
    top_n: int,
) -> PromptLogprobs | None:
    """Entries for the prompt tokens that positions ``first_pos ...`` of this chunk predict.

    ``hidden[start_loc + i]`` is position ``first_pos + i``; positions at or past the
    prompt's last token predict output tokens and are skipped.
    """
    count = min(num_positions, len(prompt) - 1 - first_pos)
    if count <= 0:
        return None
    token_ids: list[list[int]] = []
    logprobs: list[list[float]] = []
    ranks: list[int] = []
    for lo in range(0, count, _ROWS_PER_SLICE):
        hi = min(count, lo + _ROWS_PER_SLICE)
        logits = compute_logits(hidden[start_loc + lo : start_loc + hi]).float()
        raw = torch.log_softmax(logits, dim=-1)
        targets = torch.tensor(prompt[first_pos + lo + 1 : first_pos + hi + 1], dtype=torch.long, device=raw.device)
        tok_lp = raw.gather(1, targets.unsqueeze(1))
        ranks += (raw >= tok_lp).sum(dim=-1).tolist()  # vLLM's rank: tokens at least as likely, itself included
        tok_l, lp_l = targets.tolist(), tok_lp.squeeze(1).tolist()
        if top_n > 0:
            top_lp, top_ids = raw.topk(top_n, dim=-1)
            top_lp_l, top_ids_l = top_lp.tolist(), top_ids.tolist()
        else:
            top_lp_l, top_ids_l = [[] for _ in tok_l], [[] for _ in tok_l]
        token_ids += [[t] + ids for t, ids in zip(tok_l, top_ids_l)]
        logprobs += [[v] + vals for v, vals in zip(lp_l, top_lp_l)]
    return PromptLogprobs(first_pos + 1, LogprobsLists(token_ids, logprobs, ranks))
