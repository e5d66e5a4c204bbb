"""Attention backends behind one metadata contract (see metadata.py)."""

from aiolm.attention.metadata import AttentionMetadata

__all__ = ["AttentionMetadata"]
