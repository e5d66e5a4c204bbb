"""Dense weights in the model's dtype, multiplied by ``F.linear``: the method of every
platform that has no better layout, and of the torch reference platform."""

from __future__ import annotations

from aiolm.quant.base import LinearMethod, LinearSpec, QuantConfig


class DenseConfig(QuantConfig):
    name = "dense"

    def linear_method(self, spec: LinearSpec) -> LinearMethod:
        return LinearMethod()
