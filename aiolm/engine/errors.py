"""Errors users of the engine can catch by type."""


class EngineDeadError(RuntimeError):
    """The engine stopped (a worker or actor died, or it was shut down); nothing more will be served."""


class RequestError(RuntimeError):
    """One request failed (e.g. it can never fit in the KV cache); others go on."""


class EngineBusyError(RuntimeError):
    """The engine refuses new work for now (its queue is full); retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineRecoveringError(EngineBusyError):
    """New work is refused while the engine replaces its workers; in-flight requests are kept."""


class RequestTimeoutError(RequestError):
    """The request ran past the timeout it was given; it was aborted and its KV blocks freed."""
