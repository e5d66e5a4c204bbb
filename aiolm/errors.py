"""Errors raised below the engine and caught above it, in a module that imports nothing,
so that any layer may raise them without importing the layer that defines its subject."""


class ModelLoadError(ValueError):
    """A model cannot be loaded; the message names the file or field and what is supported."""
