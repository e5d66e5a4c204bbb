"""EngineCore actor: the step loop that keeps the workers busy.

drain mailbox (adds, aborts) -> schedule -> execute on the executor (awaited, the
loop stays free) -> update the scheduler -> hand outputs to the OutputProcessor.
With nothing to do it sleeps on its mailbox; it never spins.

When the executor fails (a worker died, hung or raised), the core asks its
WorkerSupervisor for a new one and requeues every live request for recompute;
the failed step's tokens are dropped, so no stream sees a token twice. Without a
supervisor, or once it gives up, the failure ends this actor (the engine dies).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from aiolm.actors import Actor
from aiolm.core.outputs import EngineCoreOutput, ModelRunnerOutput
from aiolm.core.scheduler import Scheduler
from aiolm.engine.messages import AbortRequests, AddRequests, CoreMessage, StepOutputs, WorkerFailed
from aiolm.engine.output import OutputProcessor
from aiolm.engine.recovery import WorkerSupervisor
from aiolm.executor.base import Executor, ExecutorError
from aiolm.metrics import EngineMetrics
from aiolm.params import ParamError

log = logging.getLogger(__name__)


COST_PARTS = ("schedule", "ipc", "prepare", "forward", "sample", "update", "output",
              "ipc_send", "ipc_reply")  # the last two: the legs of ipc, for diagnosis
OVERHEAD_PARTS = ("schedule", "ipc", "prepare", "update", "output")  # all but forward and sampling


@dataclass
class CostSums:
    steps: int = 0
    requests: int = 0
    parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COST_PARTS, 0.0))

    def add(self, costs: dict[str, float], reqs: int) -> None:
        self.steps += 1
        self.requests += reqs
        for k, v in costs.items():
            self.parts[k] += v

    def mean_ms(self) -> dict[str, float]:
        """Average milliseconds per step for each part, the engine ``overhead`` and batch size."""
        n = max(1, self.steps)
        out = {k: 1e3 * v / n for k, v in self.parts.items()}
        out["overhead"] = sum(out[k] for k in OVERHEAD_PARTS)
        out["steps"] = self.steps
        out["mean_requests"] = self.requests / n
        return out


@dataclass
class StepTimes:
    """Per-step cost accounting in seconds, summed over all steps and over pure-decode steps.

    schedule and update run in the engine core; prepare (input tensors), forward and
    sample are rank 0's own clock; ipc is the rest of the executor round trip (rings,
    codec, wake-ups), of which ipc_send runs from the engine's send to rank 0's read and
    ipc_reply from rank 0's reply to the engine resuming; output is detokenizing and streaming a step's results, which
    the output processor does while the next step runs.
    """

    all: CostSums = field(default_factory=CostSums)
    decode: CostSums = field(default_factory=CostSums)

    @property
    def steps(self) -> int:
        return self.all.steps

    def add(self, costs: dict[str, float], reqs: int, tokens: int) -> None:
        self.all.add(costs, reqs)
        if tokens == reqs:
            self.decode.add(costs, reqs)

    def summary(self) -> dict[str, dict[str, float]]:
        return {"all_steps": self.all.mean_ms(), "decode_steps": self.decode.mean_ms()}


class EngineCore(Actor[CoreMessage]):
    name = "engine-core"

    def __init__(self, scheduler: Scheduler, executor: Executor, output: OutputProcessor,
                 log_steps: bool = False, supervisor: WorkerSupervisor | None = None,
                 metrics: EngineMetrics | None = None) -> None:
        super().__init__()
        self.metrics = metrics
        self.scheduler = scheduler
        self.executor = executor
        self.supervisor = supervisor
        self._failure: BaseException | None = None  # reported by the monitor, handled before the next step
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
        elif isinstance(msg, WorkerFailed):
            if msg.executor is self.executor and self._failure is None:
                self._failure = ExecutorError(msg.reason)

    async def _recover(self, error: BaseException) -> None:
        """Replace the executor and requeue every live request; raises when that is not allowed."""
        self._failure = None
        if self.supervisor is None:
            raise error
        self.executor = await self.supervisor.replace(self.executor, error)
        # Adds and aborts that queued up meanwhile, before the requeue so aborts free now.
        for msg in self.mailbox.drain():
            self._handle(msg)
        self._failure = None  # reports about the old executor only
        self.scheduler.reset_workers(self.executor.num_blocks)

    async def run(self) -> None:
        sched = self.scheduler
        while True:
            if not sched.has_unfinished_requests():
                self._handle(await self.mailbox.receive())
            for msg in self.mailbox.drain():
                self._handle(msg)
            if self._failure is not None:
                await self._recover(self._failure)
            if not sched.has_unfinished_requests():
                continue
            t0 = time.perf_counter()
            out = sched.schedule()
            t1 = time.perf_counter()
            try:
                result = await self.executor.execute(out)
            except ExecutorError as e:
                await self._recover(e)
                # Outputs the scheduler finished by itself in schedule() still go out.
                outputs = sched.update_from_output(out, None)
                if outputs:
                    self.output.send(StepOutputs(outputs))
                continue
            t2 = time.perf_counter()
            # Aborts that arrived during the step: apply before update so their blocks free now.
            for msg in self.mailbox.drain():
                self._handle(msg)
            outputs = sched.update_from_output(out, result)
            t3 = time.perf_counter()
            if outputs:
                self.output.send(StepOutputs(outputs, time.monotonic()))
            if not out.is_empty:  # an empty step only waits for grammars (see the scheduler)
                if self.metrics is not None:
                    self.metrics.iteration_tokens.observe(out.total_num_scheduled_tokens)
                self._account(out.total_num_scheduled_tokens, len(out.num_scheduled_tokens), result,
                              t0, t1, t2, t3)

    def _account(self, tokens: int, reqs: int, result: ModelRunnerOutput | None,
                 t0: float, t1: float, t2: float, t3: float) -> None:
        worker = result.worker_times if result is not None else []
        prepare, forward, sample = worker if len(worker) == 3 else (0.0, 0.0, 0.0)
        clock = result.worker_clock if result is not None else []
        sent, replied = (clock[0] - t1, t2 - clock[1]) if len(clock) == 2 else (0.0, 0.0)
        output = self.output.take_busy_time()  # the previous step's outputs, processed during this one
        costs = {"schedule": t1 - t0, "ipc": max(0.0, (t2 - t1) - prepare - forward - sample),
                 "prepare": prepare, "forward": forward, "sample": sample, "update": t3 - t2,
                 "output": output, "ipc_send": max(0.0, sent), "ipc_reply": max(0.0, replied)}
        self.times.add(costs, reqs, tokens)
        if self.log_steps:
            log.info("step %d: %d reqs %d tokens | %s | overhead %.3f ms", self.times.steps, reqs, tokens,
                     " ".join(f"{k} {1e3 * v:.3f}" for k, v in costs.items()),
                     1e3 * sum(costs[k] for k in OVERHEAD_PARTS))
