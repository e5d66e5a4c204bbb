"""Sampling: the sampler core (``sampler.py``) and the logits processors it runs first."""
