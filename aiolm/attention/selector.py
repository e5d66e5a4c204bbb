"""Which attention backend the model being built uses.

Model layers construct ``attention_backend()(...)`` and never name a backend;
``build_model`` picks one through the platform (``--attention-backend
auto|cpu|torch|triton``) and sets it for the duration of the build.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

_chosen: type | None = None


@contextlib.contextmanager
def use_attention_backend(cls: type) -> Iterator[None]:
    """Layers built inside this block get ``cls``."""
    global _chosen
    before, _chosen = _chosen, cls
    try:
        yield
    finally:
        _chosen = before


def attention_backend() -> type:
    """The class to build attention with: the chosen one, else the CPU platform's default."""
    if _chosen is not None:
        return _chosen
    from aiolm.platforms import get_platform

    return get_platform("cpu").attention_backend("auto")
