"""The step clock's parts: a part measured inside another is taken out of the enclosing one."""

from __future__ import annotations

import lightning_pipe.runtime.step_clock as step_clock
from lightning_pipe.runtime.step_clock import StepClock


class FakeTime:
    """``perf_counter`` that moves only when told."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_nested_part_is_taken_out_of_the_enclosing_one(monkeypatch):
    now = FakeTime()
    monkeypatch.setattr(step_clock.time, "perf_counter", now)
    clock = StepClock()
    clock.reset()
    with clock.measure("plan"):
        now.now += 2.0
        with clock.measure("data"):
            now.now += 3.0
        with clock.measure("plan"):  # the same part nested: counted once
            now.now += 1.0
    assert clock.parts == {"plan": 3.0, "data": 3.0}
    with clock.measure("data"):  # outside any other part: nothing taken out
        now.now += 1.0
    assert clock.parts == {"plan": 3.0, "data": 4.0}
    with clock.measure("optimizer"):
        now.now += 1.0
        with clock.aside():  # neither the optimizer's nor any part, except what is measured inside
            now.now += 5.0
            with clock.measure("gradient_sync"):
                now.now += 2.0
    assert clock.parts == {"plan": 3.0, "data": 4.0, "optimizer": 1.0, "gradient_sync": 2.0}
    clock.reset()
    assert clock.parts == {} and clock.fresh and clock.started == now.now
