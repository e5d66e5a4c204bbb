"""Errors users of the engine can catch by type."""


class EngineDeadError(RuntimeError):
    """The engine stopped (a worker or actor died, or it was shut down); nothing more will be served."""


class RequestError(RuntimeError):
    """One request failed (e.g. it can never fit in the KV cache); others go on."""
