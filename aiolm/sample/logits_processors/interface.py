"""The contract between the sampler and a logits processor.

A logits processor is one constraint on the next token (a bias, a ban, a
penalty, later a grammar mask) written as a small class. The sampler runs the
processors of the registry (``logits_processors/__init__.py``) in its order, on
float32 logits, after the raw logprobs are taken and before temperature, top-k,
top-p, min-p and the pick; it knows nothing else about them.

Rows. A processor keeps batched state: one entry per row of the
:class:`~aiolm.sample.sampler.SamplingMetadata` it was built for, row i being the
i-th request that samples this step, in the persistent batch's row order. It
is told about rows in exactly two ways:

* :meth:`LogitsProcessor.build` whenever that set of rows or their order
  changes: a request joined or left, the persistent batch compacted its rows
  (``InputBatch.condense`` moves the last rows into holes), or a step samples a
  different subset (a chunked prefill that has not finished does not sample).
  Build reads the rows' params and token histories from :class:`BatchRows`;
  the persistent batch (``aiolm/worker/input_batch.py``) is their one source
  of truth, so a processor keeps no add/remove/move bookkeeping and a moved row
  can never carry another row's state.
* :meth:`LogitsProcessor.advance` after each step in which the same rows
  sampled again (pure decode, the common case): the tokens appended to each
  row since the last step, one list per row (usually one token; empty for a
  row that got none; several for speculative steps).

Cost. ``build`` returns None when no row uses the processor; an inactive
processor is then not in the batch's list and costs nothing per step. ``build``
may be slow-ish (Python over the rows); ``advance`` and ``apply`` run every
step and should stay vectorised.

Apply. :meth:`LogitsProcessor.apply` gets the step's logits, float32
``[num_rows, vocab_size]`` with dense rows, a copy the sampler owns, and
modifies them in place: add to a logit, or set it to -inf to forbid a token.
It must not read the device's values back to the host (no ``.item()``,
``.tolist()`` or data-dependent shapes), so a GPU step does not stall, and
must not keep a reference to the tensor. Which rows are greedy or random does
not concern it: the sampler picks from whatever the processors leave.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from aiolm.params import SamplingParams


@dataclass(frozen=True)
class BatchRows:
    """What a processor may build its state from: one entry per sampling row.

    ``prompt_token_ids[i]`` is empty unless some processor's
    :meth:`LogitsProcessor.needs_prompt` is true for row i's params (copying
    every prompt each rebuild would cost more than most processors do).
    """

    params: Sequence[SamplingParams]
    output_token_ids: Sequence[Sequence[int]]
    prompt_token_ids: Sequence[Sequence[int]]
    vocab_size: int
    device: torch.device

    def __len__(self) -> int:
        return len(self.params)


class LogitsProcessor(abc.ABC):
    """One constraint on the logits, with its per-row state for one batch of rows."""

    name: ClassVar[str]  # how SamplingMetadata exposes the active instance (``m.<name>``)

    @classmethod
    @abc.abstractmethod
    def build(cls, rows: BatchRows) -> LogitsProcessor | None:
        """State for these rows, or None when no row uses this processor."""

    @classmethod
    def needs_prompt(cls, params: SamplingParams) -> bool:
        """Whether a row with these params needs its prompt tokens in :class:`BatchRows`."""
        return False

    def advance(self, new_token_ids: Sequence[Sequence[int]]) -> None:
        """Tokens appended to each row since the last step (one list per row, maybe empty).
        A processor whose state does not follow the output keeps the default, which ignores them."""
        return None

    @abc.abstractmethod
    def apply(self, logits: torch.Tensor) -> None:
        """Edit ``logits`` [num_rows, vocab_size] float32 in place."""
