"""StepWatch: a step's time limit is a floor plus a multiple of what the measured rate predicts."""

from __future__ import annotations

import pytest

from aiolm.executor.step_watch import FACTOR, StepWatch


def test_unmeasured_steps_get_the_allowance_then_the_limit_scales_with_tokens():
    w = StepWatch(floor_s=2.0, unmeasured_s=600.0)
    assert w.predict(100) is None and w.limit(1) == w.limit(4096) == 600.0
    w.observe(100, 0.5)  # 5 ms a token
    assert w.predict(2000) == pytest.approx(10.0)
    assert w.limit(2000) == pytest.approx(2.0 + FACTOR * 10.0)
    assert w.limit(0) == pytest.approx(2.0 + FACTOR * 0.005)  # an empty step: the floor, nearly
    assert w.limit(4000) > w.limit(2000) > w.limit(10)


def test_the_rate_is_a_running_average_that_follows_new_steps():
    w = StepWatch(floor_s=1.0, unmeasured_s=1.0)
    w.observe(10, 0.1)
    for _ in range(50):
        w.observe(10, 1.0)  # ten times slower now (a longer context, a busier machine)
    assert w.seconds_per_token == pytest.approx(0.1, rel=1e-3)
    w.observe(10, 0.0)  # no time measured: ignored
    assert w.seconds_per_token == pytest.approx(0.1, rel=1e-3)


def test_the_allowance_is_never_below_the_floor():
    assert StepWatch(floor_s=900.0, unmeasured_s=600.0).limit(1) == 900.0
