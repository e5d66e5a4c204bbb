"""Messages between the engine's actors: one module, small typed dataclasses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiolm.core.request import Request
from aiolm.core.step import EngineCoreOutput


@dataclass
class AddRequests:
    requests: list[Request]


@dataclass
class AbortRequests:
    req_ids: list[str]


@dataclass
class StepOutputs:
    outputs: list[EngineCoreOutput]
    # time.monotonic() when the core had them: token times (TTFT, inter-token gaps) are
    # engine-side, not when the output processor got round to them. None: on receipt.
    timestamp: float | None = None


@dataclass
class WorkerFailed:
    """An executor's monitor saw a worker die while the core may be idle."""

    executor: Any  # the failed executor: a stale report about a replaced one is ignored
    reason: str


CoreMessage = AddRequests | AbortRequests | WorkerFailed
