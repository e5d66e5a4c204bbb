"""What a step costs, learned from the steps that ran: the scheduler's guide for
``--max-step-ms``.

Every running stream waits for the whole step that carries its next token, so a step with
a long prefill chunk stalls them all (on a small CPU a 2,048-token chunk takes seconds).
A step's time is close to linear in the tokens it carries: a fixed part (reading the
weights, per-layer dispatch, sampling) plus a part per token (the matmul rows, attention).
``StepCost`` fits ``seconds = fixed + per_token * tokens`` by least squares over the
recent steps, older ones weighing less, and answers how many tokens fit in a time limit.

Until it has seen steps of two different sizes it cannot split the two parts, and assumes
the fixed part is zero: that overstates the per-token cost, so the first limit it gives is
too tight rather than too loose, and the step it allows tells it the rest.
"""

from __future__ import annotations

_FORGET = 0.95  # each step's weight in the sums decays by this much per newer step
_SPREAD = 1e-6  # relative variance of the sizes below which they count as all one size


class StepCost:
    """An online least-squares fit of step seconds against scheduled tokens."""

    def __init__(self) -> None:
        # weighted sums over steps: 1, tokens, tokens^2, seconds, tokens * seconds
        self._w = self._n = self._nn = self._t = self._nt = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        """A step of ``tokens`` scheduled tokens took the workers ``seconds``."""
        if tokens <= 0 or not seconds > 0:
            return
        f = _FORGET
        self._w = f * self._w + 1.0
        self._n = f * self._n + tokens
        self._nn = f * self._nn + tokens * tokens
        self._t = f * self._t + seconds
        self._nt = f * self._nt + tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None before any step."""
        if self._w == 0.0:
            return None
        mean_n, mean_t = self._n / self._w, self._t / self._w
        var = self._nn / self._w - mean_n * mean_n
        if var > _SPREAD * mean_n * mean_n:
            slope = (self._nt / self._w - mean_n * mean_t) / var
            fixed = mean_t - slope * mean_n
            if slope > 0:
                # a line through zero below the mean (bigger steps cost more per token, as
                # attention does): the fitted slope alone, an overestimate at every size
                return max(fixed, 0.0), slope
        return 0.0, mean_t / mean_n  # one size only: all of it counted per token (an upper bound)

    def max_tokens(self, seconds: float) -> int | None:
        """The most tokens a step may carry to take at most ``seconds``; None before any step."""
        fitted = self.fit()
        if fitted is None:
            return None
        fixed, per_token = fitted
        return max(0, int((seconds - fixed) / per_token))
