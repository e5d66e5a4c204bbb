"""The attention backends by name (aiolm/attention/registry.py): each registered name loads
an AttentionBackend; an unknown one is refused with the known names."""

from __future__ import annotations

import importlib.util

import pytest

from aiolm.attention.metadata import AttentionBackend
from aiolm.attention.registry import BACKENDS, backend_class


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_each_registered_backend_loads(name):
    if name == "triton" and importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    cls = backend_class(name)
    assert issubclass(cls, AttentionBackend)
    layer = cls(4, 2, 16, 0.25, sliding_window=8)
    assert (layer.group, layer.sliding_window) == (2, 8)


def test_an_unknown_backend_is_refused_with_the_known_names():
    with pytest.raises(ValueError, match="'flash' is not known; known: auto, cpu, torch, triton"):
        backend_class("flash")
