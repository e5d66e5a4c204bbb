"""``--ray-placement``: where a Ray placement group puts an engine's ranks (no Ray import:
EngineArgs checks the flag before anything starts)."""

from __future__ import annotations

PLACEMENTS = ("auto", "pack", "spread", "strict-pack", "strict-spread")


def placement_strategy(placement: str, groups: int) -> str:
    """Ray's placement-group strategy for ``--ray-placement``. Bundles are one per rank, or
    one per group of ranks that must share a node: a pipeline stage (its tensor-parallel
    ranks), or a data-parallel replica (all its ranks). auto packs single ranks onto as few
    nodes as fit, and spreads ``groups`` > 1 over nodes where it can."""
    if placement not in PLACEMENTS:
        raise ValueError(f"ray_placement: {placement!r} is not supported; supported: {', '.join(PLACEMENTS)}")
    if placement == "auto":
        placement = "spread" if groups > 1 else "pack"
    return placement.upper().replace("-", "_")
