"""Messages between the engine's actors: one module, small typed dataclasses."""

from __future__ import annotations

from dataclasses import dataclass

from aiolm.core.outputs import EngineCoreOutput
from aiolm.core.request import Request


@dataclass
class AddRequests:
    requests: list[Request]


@dataclass
class AbortRequests:
    req_ids: list[str]


@dataclass
class StepOutputs:
    outputs: list[EngineCoreOutput]


CoreMessage = AddRequests | AbortRequests
