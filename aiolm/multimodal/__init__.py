"""Multimodal inputs: the images chat requests carry, fetched and decoded within limits."""
