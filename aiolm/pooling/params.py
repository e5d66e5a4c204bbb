"""PoolingParams: what one pooling request asks for, validated where it is made.

It crosses to the workers inside NewRequestData (aiolm/core/step.py), so it is a
msgspec struct of plain fields; errors name the field, as SamplingParams' do.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from aiolm.params import ParamError

PoolingTask = Literal["embed", "classify", "score"]
TASKS: tuple[str, ...] = ("embed", "classify", "score")


class PoolingParams(msgspec.Struct, array_like=True, gc=False):
    """``task``: embed (one vector per input), classify (the classifier's logits) or score
    (a cross-encoder's logits for a pair; bi-encoders score through two embeddings).
    ``normalize``: None takes the model's own choice (its folder's Normalize module);
    ``dimensions``: keep the first N embedding values (matryoshka models only), before
    normalising. ``token_type_ids``: segment ids of a cross-encoder's pair, one per token."""

    task: str = "embed"
    normalize: bool | None = None
    dimensions: int | None = None
    token_type_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ParamError("task", f"must be one of {', '.join(TASKS)}, got {self.task!r}")
        dims = self.dimensions
        if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or not 1 <= dims < 2**63):
            raise ParamError("dimensions", f"must be a positive integer, got {dims!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ParamError("normalize", f"must be true, false or None, got {self.normalize!r}")
        if self.normalize is not None and self.task != "embed":  # logits are never normalised
            raise ParamError("normalize", f"applies to embeddings only; a {self.task} output is the model's logits")
