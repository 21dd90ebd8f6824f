"""The validator: each rule is caught, named, and shown on the step x rank grid."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_pipe.schedules import Program, Schedule, ScheduleError, forward_only, validate
from lightning_pipe.schedules.ir import B, F, I, W, Action, ActionType
from lightning_pipe.schedules.lowering import build_program
from lightning_pipe.schedules.text import parse_action


def with_rank(program: Program, rank: int, tokens: str) -> Program:
    actions = list(program.actions)
    actions[rank] = tuple(parse_action(t) for t in tokens.split())
    return replace(program, actions=tuple(actions))


@pytest.fixture
def one_f_one_b() -> Program:
    # rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0F2 0SEND_F2 0RECV_B1 0B1 0RECV_B2 0B2
    # rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1RECV_F2 1F2 1B2 1SEND_B2
    return Schedule("1f1b").build(2, 3)


def test_valid_program_is_returned(one_f_one_b):
    assert validate(one_f_one_b) is one_f_one_b


def test_missing_backward(one_f_one_b):
    bad = with_rank(one_f_one_b, 0, "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0F2 0SEND_F2 0RECV_B1 0B1 0RECV_B2")
    with pytest.raises(ScheduleError, match=r"\[exactly_once\] rank 0: stage 0 microbatch 2: B \(or I and W\) missing"):
        validate(bad)


def test_duplicate_forward_names_rank_step_and_marks_grid(one_f_one_b):
    bad = with_rank(one_f_one_b, 0, "0F0 0SEND_F0 0F0 0F1 0SEND_F1 0RECV_B0 0B0 0F2 0SEND_F2 0RECV_B1 0B1 0RECV_B2 0B2")
    with pytest.raises(ScheduleError) as info:
        validate(bad)
    error = info.value
    assert (error.rule, error.rank, error.step, str(error.action)) == ("exactly_once", 0, 2, "0F0")
    assert "step 2 : 0F1" not in str(error)
    marked = [line for line in str(error).splitlines() if line.endswith("<-- here")]
    assert marked == ["step 2 : [0F0]    1B0  <-- here"]


def test_backward_before_forward(one_f_one_b):
    bad = with_rank(one_f_one_b, 1, "1RECV_F0 1B0 1F0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1RECV_F2 1F2 1B2 1SEND_B2")
    with pytest.raises(ScheduleError, match=r"\[dependency\] rank 1, step 1: 1B0 runs before 1F0 \(its own forward\)"):
        validate(bad)


def test_forward_before_receive(one_f_one_b):
    bad = with_rank(one_f_one_b, 1, "1F0 1RECV_F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1RECV_F2 1F2 1B2 1SEND_B2")
    with pytest.raises(ScheduleError, match=r"rank 1, step 0: 1F0 runs before 1RECV_F0"):
        validate(bad)


def test_missing_send(one_f_one_b):
    bad = with_rank(one_f_one_b, 1, "1RECV_F0 1F0 1B0 1RECV_F1 1F1 1B1 1SEND_B1 1RECV_F2 1F2 1B2 1SEND_B2")
    with pytest.raises(ScheduleError, match=r"\[communication\] rank 1, step 2: 1B0 needs 1SEND_B0 after it"):
        validate(bad)


def test_communication_between_stages_on_the_same_rank():
    program = Schedule("zbv", 2).build(2, 3)  # stages 1 and 2 both on rank 1
    tokens = " ".join(str(a) for a in program.actions[1])
    bad = with_rank(program, 1, tokens.replace("1F0 ", "1F0 1SEND_F0 ", 1))
    with pytest.raises(ScheduleError, match=r"1SEND_F0 crosses no rank boundary \(stages 1->2\)"):
        validate(bad)


def test_receives_out_of_order_between_two_ranks(one_f_one_b):
    bad = with_rank(one_f_one_b, 1, "1RECV_F1 1RECV_F0 1F0 1B0 1SEND_B0 1F1 1B1 1SEND_B1 1RECV_F2 1F2 1B2 1SEND_B2")
    with pytest.raises(
        ScheduleError,
        match=r"\[matching\] rank 1, step 0: receive #0 from rank 0 is 1RECV_F1 but that rank's send #0 is 0SEND_F0",
    ):
        validate(bad)


def test_deadlock_is_reported_with_every_blocked_rank(one_f_one_b):
    bad = with_rank(one_f_one_b, 0, "0RECV_B0 0F0 0SEND_F0 0F1 0SEND_F1 0B0 0F2 0SEND_F2 0RECV_B1 0B1 0RECV_B2 0B2")
    with pytest.raises(
        ScheduleError, match=r"\[deadlock\].*rank 0 waits at step 0 on 0RECV_B0, rank 1 waits at step 0 on 1RECV_F0"
    ):
        validate(bad)


def test_w_before_i():
    program = build_program("zb", 1, (0,), [[F(0, 0), W(0, 0), I(0, 0)]])
    with pytest.raises(ScheduleError, match=r"0W0 runs before 0I0 \(W needs its I first\)"):
        validate(program)


def test_b_and_i_for_the_same_pair():
    program = build_program("mixed", 1, (0,), [[F(0, 0), B(0, 0), I(0, 0), W(0, 0)]])
    with pytest.raises(ScheduleError, match="has both B and I/W"):
        validate(program)


def test_action_on_the_wrong_rank(one_f_one_b):
    bad = with_rank(one_f_one_b, 0, " ".join(str(a) for a in one_f_one_b.actions[0]) + " 1F0")
    with pytest.raises(ScheduleError, match=r"\[structure\] rank 0, step 12: 1F0: stage 1 is placed on rank 1"):
        validate(bad)


def test_microbatch_out_of_range(one_f_one_b):
    bad = with_rank(one_f_one_b, 0, " ".join(str(a) for a in one_f_one_b.actions[0]) + " 0F9")
    with pytest.raises(ScheduleError, match=r"0F9: microbatch 9 outside 0..2"):
        validate(bad)


def test_schedule_error_is_a_value_error():
    assert issubclass(ScheduleError, ValueError)


def test_forward_only_programs_validate_and_reject_backwards(one_f_one_b):
    fwd = forward_only(one_f_one_b)
    assert validate(fwd) is fwd
    bad = with_rank(fwd, 1, "1RECV_F0 1F0 1B0 1RECV_F1 1F1 1RECV_F2 1F2")
    with pytest.raises(ScheduleError, match="1B0 in a forward-only program"):
        validate(bad, forward_only=True)


def test_long_programs_show_a_window_of_the_grid():
    program = Schedule("1f1b").build(2, 40)
    actions = list(program.actions)
    actions[0] = actions[0][:-1]  # drop the last backward
    with pytest.raises(ScheduleError) as info:
        validate(replace(program, actions=tuple(actions)))
    assert "exactly_once" in str(info.value)
    bad = list(program.actions[1])
    bad[100], bad[101] = bad[101], bad[100]
    actions = [program.actions[0], tuple(bad)]
    with pytest.raises(ScheduleError) as info:
        validate(replace(program, actions=tuple(actions)))
    lines = str(info.value).splitlines()
    assert any(line.startswith("...") for line in lines) and len(lines) < 40


def test_an_action_without_microbatch_is_refused():
    program = Schedule("1f1b").build(2, 2)
    actions = [rank + (Action(r, ActionType.FORWARD),) for r, rank in enumerate(program.actions)]
    with pytest.raises(ScheduleError, match="0F: microbatch None outside 0..1"):
        validate(replace(program, actions=tuple(actions)))


def test_memory_actions_follow_their_forward():
    program = build_program("mem", 1, (0,), [[Action(0, ActionType.RECOMPUTE, 0), F(0, 0), B(0, 0)]])
    with pytest.raises(ScheduleError, match=r"0RECOMPUTE0 runs before 0F0 \(recompute after the forward"):
        validate(program)
    program = build_program("mem", 1, (0,), [[F(0, 0), Action(0, ActionType.RELOAD, 0), B(0, 0)]])
    with pytest.raises(ScheduleError, match=r"0RELOAD0 runs before 0OFFLOAD0 \(reload after offload\)"):
        validate(program)
    ok = [F(0, 0), Action(0, ActionType.OFFLOAD, 0), Action(0, ActionType.RELOAD, 0), B(0, 0)]
    validate(build_program("mem", 1, (0,), [ok]))
