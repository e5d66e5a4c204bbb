"""EngineCore actor: the step loop that keeps the workers busy.

drain mailbox (adds, aborts) -> schedule -> execute on the executor (awaited, the
loop stays free) -> update the scheduler -> hand outputs to the OutputProcessor.
With nothing to do it sleeps on its mailbox; it never spins.

One loop runs both pipeline depths. At depth 1 each step is scheduled, run and
applied before the next is scheduled. At depth 2, overlap scheduling
(``--async-scheduling``), the core submits step N+1 before it awaits step N, so
scheduling, IPC, the update and output processing run while the workers compute
(aiolm/core/scheduler.py describes the placeholders that make this possible).

When the executor fails (a worker died, hung or raised), the core asks its
WorkerSupervisor for a new one and requeues every live request for recompute;
the failed step's tokens are dropped, so no stream sees a token twice. Without a
supervisor, or once it gives up, the failure ends this actor (the engine dies).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from aiolm.actors import Actor
from aiolm.core.scheduler import Scheduler
from aiolm.core.step import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from aiolm.engine.messages import AbortRequests, AddRequests, CoreMessage, StepOutputs, WorkerFailed
from aiolm.engine.output_processor import OutputProcessor
from aiolm.engine.recovery import WorkerSupervisor
from aiolm.executor.base import Executor, ExecutorError
from aiolm.metrics import EngineMetrics
from aiolm.params import ParamError

log = logging.getLogger(__name__)
_SUSPECT_FAILURES = 2  # worker failures a request's steps may be in before it is failed


COST_PARTS = (
    "schedule",
    "ipc",
    "prepare",
    "forward",
    "sample",
    "update",
    "output",
    "ipc_send",
    "ipc_reply",  # the legs of ipc, for diagnosis
    "idle",  # rank 0 waiting between its previous step's reply and reading this step
)
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
    the output processor does while the next step runs. idle is the gap rank 0 spends
    between answering one step and reading the next: without overlap it pays for
    ipc, update and schedule; with overlap those run while rank 0 computes, and ipc
    counts only the transport (a step waiting in the ring behind the previous one is not
    ipc), so idle is what the forward pass still waits for.
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


@dataclass
class InFlight:
    """A submitted step: its decisions, the executor's handle and the engine's clock."""

    step: SchedulerOutput
    handle: Any  # the executor's, for result(); None when the submit itself failed
    t_schedule: float  # schedule() started
    t_sent: float  # schedule() returned; the step was handed to the executor right after


class EngineCore(Actor[CoreMessage]):
    name = "engine-core"

    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        output: OutputProcessor,
        log_steps: bool = False,
        supervisor: WorkerSupervisor | None = None,
        metrics: EngineMetrics | None = None,
        overlap: bool = False,
        pipeline_depth: int = 1,
    ) -> None:
        super().__init__()
        self.metrics = metrics
        # Steps in flight at once. Two (overlap) needs the scheduler's placeholders and the
        # workers appending their own tokens (SchedulerConfig/RunnerConfig.async_scheduling):
        # the engine sets all three.
        # A pipeline of P stages keeps P steps in flight, each with other requests (the
        # scheduler's pipeline_depth), so that every stage has a step to run.
        self.depth = max(2 if overlap else 1, pipeline_depth)
        self._last_reply = 0.0  # rank 0's clock when it answered the previous step
        self.scheduler = scheduler
        self.executor = executor
        self.supervisor = supervisor
        self._failed_in: dict[str, list[float]] = {}  # live request id -> when the failures its steps were in came
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

    async def run(self) -> None:
        """The step loop. Up to ``depth`` steps are in flight: at depth 2 the next step is
        scheduled and submitted before the previous one is awaited."""
        sched = self.scheduler
        depth = self.depth
        inflight: deque[InFlight] = deque()
        while True:
            if not inflight and not sched.has_unfinished_requests():
                self._last_reply = 0.0  # an idle engine is no step's cost
                self._handle(await self.mailbox.receive())
            for msg in self.mailbox.drain():
                self._handle(msg)
            if self._failure is not None:
                await self._recover(self._failure, inflight)
                continue
            submitted = False
            if len(inflight) < depth and sched.has_unfinished_requests():
                t0 = time.perf_counter()
                step = sched.schedule()
                t1 = time.perf_counter()
                # A step with nothing to run still goes out when the pipeline is empty (its
                # outputs are the requests schedule() finished by itself) or when it carries
                # finished requests, grammars or KV transfers (the workers drop, compile or move them).
                if (
                    not inflight
                    or step.total_num_scheduled_tokens
                    or step.finished_req_ids
                    or step.grammars
                    or step.kv_ops is not None
                ):
                    try:
                        handle = await self.executor.submit(step)
                    except ExecutorError as e:
                        inflight.append(InFlight(step, None, t0, t1))
                        await self._recover(e, inflight)
                        continue
                    inflight.append(InFlight(step, handle, t0, t1))
                    submitted = True
                else:
                    # Every running request waits for a token in flight: nothing to run, but
                    # requests schedule() finished by itself still go out.
                    self._send_outputs(sched.update_from_output(step, None))
            if not inflight or (submitted and len(inflight) < depth):
                continue  # fill the pipeline before waiting on it
            flight = inflight.popleft()
            t_wait = time.perf_counter()
            try:
                runner_output = await self.executor.result(flight.handle)
            except ExecutorError as e:
                inflight.appendleft(flight)
                await self._recover(e, inflight)
                continue
            t2 = time.perf_counter()
            for msg in self.mailbox.drain():  # aborts first, so their blocks free now
                self._handle(msg)
            outputs = sched.update_from_output(flight.step, runner_output)
            t3 = time.perf_counter()
            self._send_outputs(outputs)
            step = flight.step
            if not step.is_empty:  # an empty step only waits for grammars (see the scheduler)
                if self.metrics is not None:
                    self.metrics.iteration_tokens.observe(step.total_num_scheduled_tokens)
                self._account(
                    step.total_num_scheduled_tokens,
                    len(step.num_scheduled_tokens),
                    runner_output,
                    flight.t_schedule,
                    flight.t_sent,
                    t2,
                    t3,
                    t_wait if depth > 1 else None,
                )

    async def _recover(self, error: BaseException, inflight: deque[InFlight]) -> None:
        """Replace the executor and requeue every live request (raises when that is not
        allowed), then close the books of every step that was in flight: their tokens are
        lost with the workers (the requests recompute them)."""
        lost = list(inflight)
        inflight.clear()
        for flight in lost:
            if flight.handle is not None:
                self.executor.abandon(flight.handle)
        self._failure = None
        if self.supervisor is None:
            raise error
        self.executor = await self.supervisor.replace(self.executor, error)
        # Adds and aborts that queued up meanwhile, before the requeue so aborts free now.
        for msg in self.mailbox.drain():
            self._handle(msg)
        self._failure = None  # reports about the old executor only
        self._last_reply = 0.0  # the restart is no step's idle time
        self.scheduler.reset_workers(self.executor.num_blocks)
        for flight in lost:
            self._send_outputs(self.scheduler.update_from_output(flight.step, None))
        self._fail_suspects({rid for flight in lost for rid in flight.step.num_scheduled_tokens}, error)

    def _fail_suspects(self, stepped: set[str], error: BaseException) -> None:
        """A request whose steps were in ``_SUSPECT_FAILURES`` worker failures within the restart
        budget's window is failed, not requeued again: whatever in it breaks the workers (an
        input no check foresaw) would spend the budget and end the engine for every request,
        later ones too. The requests that shared both steps with it fail with it (they would
        have failed with the engine anyway): the engine serves on."""
        live, now = self.scheduler.requests, time.monotonic()
        window = self.supervisor.window if self.supervisor is not None else 0.0  # the restart budget's
        self._failed_in = {
            rid: [t for t in times if now - t <= window] for rid, times in self._failed_in.items() if rid in live
        }
        for rid in stepped & live.keys():
            self._failed_in.setdefault(rid, []).append(now)
        suspects = [rid for rid, times in self._failed_in.items() if len(times) >= _SUSPECT_FAILURES]
        if suspects:
            log.error("failing request(s) %s: in the steps of %d worker failures", suspects, _SUSPECT_FAILURES)
            why = f"its steps were in {_SUSPECT_FAILURES} worker failures (the last: {error})"
            self._send_outputs(self.scheduler.abort_requests(suspects, error=why))
            for rid in suspects:
                self._failed_in.pop(rid, None)

    def _send_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        if outputs:
            self.output.send(StepOutputs(outputs, time.monotonic()))

    def _account(
        self,
        tokens: int,
        reqs: int,
        runner_output: ModelRunnerOutput | None,
        t0: float,
        t1: float,
        t2: float,
        t3: float,
        t_wait: float | None = None,
    ) -> None:
        """One step's costs; ``t_wait`` (depth 2 only) is when the core began awaiting it."""
        worker = runner_output.worker_times if runner_output is not None else []
        prepare, forward, sample = worker if len(worker) == 3 else (0.0, 0.0, 0.0)
        clock = runner_output.worker_clock if runner_output is not None else []
        idle = 0.0
        if len(clock) == 2:
            if self._last_reply:
                idle = max(0.0, clock[0] - self._last_reply)
            if t_wait is None:
                sent, replied = clock[0] - t1, t2 - clock[1]
            else:  # a step queued behind the previous one, or a reply the core was busy to read, is no ipc
                sent, replied = clock[0] - max(t1, self._last_reply), t2 - max(clock[1], t_wait)
            self._last_reply = clock[1]
        else:
            sent = replied = 0.0
        sent, replied = max(0.0, sent), max(0.0, replied)
        ipc = max(0.0, (t2 - t1) - prepare - forward - sample) if t_wait is None else sent + replied
        output = self.output.take_busy_time()  # the previous step's outputs, processed during this one
        costs = {
            "schedule": t1 - t0,
            "ipc": ipc,
            "prepare": prepare,
            "forward": forward,
            "sample": sample,
            "update": t3 - t2,
            "output": output,
            "ipc_send": sent,
            "ipc_reply": replied,
            "idle": idle,
        }
        self.times.add(costs, reqs, tokens)
        if self.log_steps:
            log.info(
                "step %d: %d reqs %d tokens | %s | overhead %.3f ms",
                self.times.steps,
                reqs,
                tokens,
                " ".join(f"{k} {1e3 * v:.3f}" for k, v in costs.items()),
                1e3 * sum(costs[k] for k in OVERHEAD_PARTS),
            )
