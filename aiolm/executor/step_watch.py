"""How long a step may take before its workers count as hung.

A fixed limit cannot tell a slow legitimate step from a hang: a prompt chunk of
thousands of tokens on a large model may take minutes, a decode step of a few
requests milliseconds. So the limit follows the step's size: a floor (for the
fixed costs and the noise of a shared machine) plus ``FACTOR`` times what the
measured rate predicts for the step's tokens. The rate is the workers' own
seconds per scheduled token (``ModelRunnerOutput.worker_clock``), averaged over
recent steps. Until a step has been measured there is nothing to scale by, and
the first steps of a process pay one-time costs (kernel builds, warm caches), so
they get ``unmeasured_s``. One StepWatch lives as long as its engine, so a worker
set started by recovery inherits the rate its predecessor measured.
"""

from __future__ import annotations

FACTOR = 10.0  # a step may run this many times longer than the rate predicts
_WEIGHT = 0.2  # of the newest step in the running average


class StepWatch:
    def __init__(self, floor_s: float, unmeasured_s: float) -> None:
        self.floor_s = floor_s
        self.unmeasured_s = max(unmeasured_s, floor_s)
        self.seconds_per_token: float | None = None

    def predict(self, tokens: int) -> float | None:
        """Seconds a step of ``tokens`` should take at the measured rate; None before any."""
        if self.seconds_per_token is None:
            return None
        return max(tokens, 1) * self.seconds_per_token

    def limit(self, tokens: int) -> float:
        """Seconds a step of ``tokens`` scheduled tokens may take."""
        predicted = self.predict(tokens)
        if predicted is None:
            return self.unmeasured_s
        return self.floor_s + FACTOR * predicted

    def observe(self, tokens: int, seconds: float) -> None:
        """A step of ``tokens`` took the workers ``seconds``."""
        if seconds <= 0:
            return
        rate = seconds / max(tokens, 1)
        old = self.seconds_per_token
        self.seconds_per_token = rate if old is None else old + _WEIGHT * (rate - old)
