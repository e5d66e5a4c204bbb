"""How long the engine's queue takes to drain: what a refused client is told to wait.

A 429's ``Retry-After`` should say when a retry would find room. With every seat and
queue place taken, the sequences waiting ahead must reach a seat first. Seats free
up at ``seats / service time`` per second (Little's law), where the service time is
how long a sequence holds its seat, from its first step to its end (a stop, a
length limit or an abort: any departure frees a seat). Averaging service times, not
counting departures per second, keeps the estimate right after a quiet spell: an
idle minute changes no sequence's service time.
"""

from __future__ import annotations

import math

_WEIGHT = 0.1  # of the newest departure in the running average
# Before any sequence has finished there is no service time: a guess, replaced by the first.
UNMEASURED_S = 5.0


class DrainEstimate:
    def __init__(self) -> None:
        self.service_s: float | None = None  # running average of a sequence's time in its seat

    def departed(self, service_s: float, sequences: int = 1) -> None:
        """``sequences`` left their seats after ``service_s`` seconds in them."""
        if service_s < 0 or sequences < 1:
            return
        for _ in range(min(sequences, 8)):  # n siblings count as n departures, boundedly
            old = self.service_s
            self.service_s = service_s if old is None else old + _WEIGHT * (service_s - old)

    def seconds_for(self, sequences: int, seats: int) -> float:
        """Seconds until ``sequences`` queued ahead have reached one of ``seats`` busy seats
        (whole seconds, at least one)."""
        if self.service_s is None or seats < 1:
            return UNMEASURED_S
        return max(1.0, math.ceil(sequences * self.service_s / seats))
