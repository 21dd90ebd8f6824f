"""Where a rank runs its step's side task (the last stage's outcome): pure placement rules."""

from __future__ import annotations

from lightning_pipe.runtime.side_task import SideTaskPlacer, ready_index
from lightning_pipe.schedules import resolve_schedule
from lightning_pipe.schedules.ir import ActionType


def _zbv():
    return resolve_schedule("zbv").build(2, 4)


def test_ready_after_the_last_forward_of_the_last_stage():
    program = _zbv()  # rank 0 runs stages 0 and 3
    ready = ready_index(program, 0)
    actions = program.actions[0]
    assert actions[ready - 1].type is ActionType.FORWARD and actions[ready - 1].stage == 3
    assert not any(a.type is ActionType.FORWARD and a.stage == 3 for a in actions[ready:])
    assert ready_index(program, 1) is None  # rank 1 runs no forward of the last stage


def test_first_step_of_a_program_runs_the_task_after_it():
    assert SideTaskPlacer().point(_zbv()) is None


def test_the_longest_wait_after_ready_that_the_task_fits_in():
    program, placer = _zbv(), SideTaskPlacer()
    waits = [0.0] * len(program.actions[0])
    waits[2] = 9.0  # before ready: the outcome is not known yet
    waits[-1], waits[-3] = 0.004, 0.002
    placer.observe(program, 5, waits, None, 0.003)
    assert placer.point(program) == len(waits) - 1
    placer.observe(program, 5, waits, None, 0.005)  # a task longer than every wait: after the program
    assert placer.point(program) is None


def test_a_wait_the_task_filled_keeps_it_there():
    program, placer = _zbv(), SideTaskPlacer()
    waits = [0.0] * len(program.actions[0])
    waits[-1], waits[-3] = 0.001, 0.002  # the task ran before the last action and took 3 ms of its 4 ms wait
    placer.observe(program, 5, waits, len(waits) - 1, 0.003)
    assert placer.point(program) == len(waits) - 1


def test_placements_are_per_program_object_and_bounded():
    placer = SideTaskPlacer(capacity=2)
    programs = [_zbv(), resolve_schedule("zbv").build(2, 6), resolve_schedule("zbv").build(2, 8)]
    for program in programs:
        waits = [0.0] * len(program.actions[0])
        waits[-1] = 1.0
        placer.observe(program, 1, waits, None, 0.5)
    assert placer.point(programs[0]) is None  # evicted
    assert placer.point(programs[2]) == len(programs[2].actions[0]) - 1
    assert placer.point(_zbv()) is None  # an equal program built again is another object: no history
