"""DrainEstimate: Retry-After from the average time a sequence holds its seat (Little's law)."""

from __future__ import annotations

import pytest

from aiolm.engine.drain import UNMEASURED_S, DrainEstimate


def test_before_any_departure_the_guess_then_sequences_times_service_over_seats():
    d = DrainEstimate()
    assert d.seconds_for(100, 4) == UNMEASURED_S
    d.departed(2.0)
    assert d.seconds_for(8, 4) == 4.0  # 8 ahead, 4 seats, 2 s each: two rounds
    assert d.seconds_for(9, 4) == 5.0  # whole seconds, rounded up
    assert d.seconds_for(1, 64) == 1.0  # never under one second
    assert d.seconds_for(8, 0) == UNMEASURED_S


def test_the_service_time_follows_recent_departures():
    d = DrainEstimate()
    d.departed(1.0)
    for _ in range(60):
        d.departed(10.0)
    assert d.service_s == pytest.approx(10.0, rel=0.01)
    d.departed(5.0, sequences=3)  # n siblings count as three departures
    assert d.service_s == pytest.approx(10 - 5 * (1 - 0.9**3), rel=0.01)
    d.departed(-1.0)  # a clock that went backwards: ignored
    assert d.service_s == pytest.approx(10 - 5 * (1 - 0.9**3), rel=0.01)
