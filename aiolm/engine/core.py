"""EngineCore actor: the step loop that keeps the workers busy.

drain mailbox (adds, aborts) -> schedule -> execute on the executor (awaited, the
loop stays free) -> update the scheduler -> hand outputs to the OutputProcessor.
With nothing to do it sleeps on its mailbox; it never spins.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from aiolm.actors import Actor
from aiolm.core.outputs import EngineCoreOutput
from aiolm.core.scheduler import Scheduler
from aiolm.engine.messages import AbortRequests, AddRequests, CoreMessage, StepOutputs
from aiolm.engine.output import OutputProcessor
from aiolm.executor.base import Executor
from aiolm.params import ParamError

log = logging.getLogger(__name__)


@dataclass
class StepTimes:
    """Per-step cost accounting (seconds), summed; logged per step when debugging."""

    steps: int = 0
    schedule: float = 0.0
    execute: float = 0.0
    update: float = 0.0
    last: dict[str, float] = field(default_factory=dict)


class EngineCore(Actor[CoreMessage]):
    name = "engine-core"

    def __init__(self, scheduler: Scheduler, executor: Executor, output: OutputProcessor,
                 log_steps: bool = False) -> None:
        super().__init__()
        self.scheduler = scheduler
        self.executor = executor
        self.output = output
        self.log_steps = log_steps
        if log_steps:  # asked for explicitly: make sure the lines are seen
            log.setLevel(logging.INFO)
            if not logging.getLogger().handlers and not log.handlers:
                log.addHandler(logging.StreamHandler())
        self.times = StepTimes()

    def _handle(self, msg: CoreMessage) -> None:
        if isinstance(msg, AddRequests):
            errors: list[EngineCoreOutput] = []
            for req in msg.requests:
                try:
                    self.scheduler.add_request(req)
                except (ParamError, ValueError) as e:
                    errors.append(EngineCoreOutput(req.req_id, [], finish_reason="error", error=str(e)))
            if errors:
                self.output.send(StepOutputs(errors))
        elif isinstance(msg, AbortRequests):
            outs = self.scheduler.abort_requests(msg.req_ids)
            if outs:
                self.output.send(StepOutputs(outs))

    async def run(self) -> None:
        sched = self.scheduler
        while True:
            if not sched.has_unfinished_requests():
                self._handle(await self.mailbox.receive())
            for msg in self.mailbox.drain():
                self._handle(msg)
            if not sched.has_unfinished_requests():
                continue
            t0 = time.perf_counter()
            out = sched.schedule()
            t1 = time.perf_counter()
            result = await self.executor.execute(out)
            t2 = time.perf_counter()
            # Aborts that arrived during the step: apply before update so their blocks free now.
            for msg in self.mailbox.drain():
                self._handle(msg)
            outputs = sched.update_from_output(out, result)
            t3 = time.perf_counter()
            if outputs:
                self.output.send(StepOutputs(outputs))
            self._account(out.total_num_scheduled_tokens, len(out.num_scheduled_tokens), t0, t1, t2, t3)

    def _account(self, tokens: int, reqs: int, t0: float, t1: float, t2: float, t3: float) -> None:
        tm = self.times
        tm.steps += 1
        tm.schedule += t1 - t0
        tm.execute += t2 - t1
        tm.update += t3 - t2
        tm.last = {"schedule": t1 - t0, "execute": t2 - t1, "update": t3 - t2}
        if self.log_steps:
            log.info("step %d: %d reqs %d tokens schedule %.3f ms execute %.3f ms update %.3f ms",
                     tm.steps, reqs, tokens, 1e3 * (t1 - t0), 1e3 * (t2 - t1), 1e3 * (t3 - t2))
