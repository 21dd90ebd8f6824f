"""The one table of action rules: complete, and what the simulator, validator and planners read."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_pipe.planning.bounds import ProgramAnalysis, rank_chain
from lightning_pipe.schedules import (
    ActionCosts,
    ActionType,
    Program,
    ScheduleError,
    SplitBackward,
    resolve_schedule,
    simulate,
    validate,
)
from lightning_pipe.schedules.action_rules import ACTION_RULES, backward_share, instruction_seconds, saves_again
from lightning_pipe.schedules.ir import Action, B, F


def test_every_action_type_has_one_rule():
    assert set(ACTION_RULES) == set(ActionType)
    with pytest.raises(TypeError):
        ACTION_RULES[ActionType.FORWARD] = ACTION_RULES[ActionType.BACKWARD]  # read-only


def test_time_and_memory_columns():
    rules = ACTION_RULES
    assert {k for k, r in rules.items() if r.forward_share} == {ActionType.FORWARD, ActionType.RECOMPUTE}
    assert {k: r.backward_share for k, r in rules.items() if r.backward_share} == {
        ActionType.BACKWARD: 1.0,
        ActionType.BACKWARD_INPUT: 0.5,
        ActionType.BACKWARD_WEIGHT: 0.5,
    }
    assert {k for k, r in rules.items() if r.frees} == {ActionType.BACKWARD, ActionType.BACKWARD_WEIGHT}
    assert [k for k in ActionType if saves_again(k)] == [ActionType.RECOMPUTE]
    assert instruction_seconds(Action(0, ActionType.FORWARD, 0)) == 0.0


def test_simulator_and_bounds_charge_what_the_table_says():
    """One rank's busy time equals the chain the bounds build from the same table, for a zero-bubble program."""
    program = resolve_schedule("zb_h1").build(3, 4)
    costs = ActionCosts.uniform(3, 4, forward=1.0, backward=3.0)
    result = simulate(program, costs)
    for rank in range(3):
        busy = sum(ACTION_RULES[a.type].forward_share + 3.0 * ACTION_RULES[a.type].backward_share for a in program.actions[rank])
        assert result.busy[rank] == pytest.approx(busy)
        chain = rank_chain(program, rank)  # the rank's own actions plus the fill and drain it cannot hide
        assert float(chain.forward.sum() + 3.0 * chain.backward_counts().sum()) >= busy
    analysis = ProgramAnalysis.of(program)
    saved = np.ones((3, 4))
    for rank in range(3):
        assert analysis.peak_memory(rank, saved, np.zeros(3)) == pytest.approx(result.peak_memory[rank])


def test_validator_reads_the_order_column():
    program = resolve_schedule("zb_h1").build(2, 2)
    actions = [list(a) for a in program.actions]
    first_w = next(i for i, a in enumerate(actions[1]) if a.type is ActionType.BACKWARD_WEIGHT)
    w = actions[1].pop(first_w)
    first_i = next(i for i, a in enumerate(actions[1]) if a.type is ActionType.BACKWARD_INPUT and a.microbatch == w.microbatch)
    actions[1].insert(first_i, w)  # W before its I
    broken = Program(program.name, program.num_stages, program.num_microbatches, program.stage_to_rank, tuple(tuple(a) for a in actions))
    with pytest.raises(ScheduleError, match="W needs its I first"):
        validate(broken)


def test_simulation_only_kinds_and_schedule_memory_actions_are_refused_before_running():
    from lightning_pipe.schedules import build_program
    from lightning_pipe.schedules.action_rules import check_executable

    assert {k for k, r in ACTION_RULES.items() if not r.executed} == {  # CUSTOM runs its function
        ActionType.SEND_C,  # split placement (HelixPipe, SPipe): simulated only
        ActionType.RECV_C,
    }
    # run by the executor as markers, written only from a memory plan (planning.memory_lowering)
    assert {k for k, r in ACTION_RULES.items() if r.from_memory_plan} == {
        ActionType.RECOMPUTE,
        ActionType.OFFLOAD,
        ActionType.RELOAD,
    }
    plain = resolve_schedule("1f1b").build(2, 2)
    assert check_executable(plain) is plain
    recompute = build_program("mem", 2, (0,), [[F(0, 0), F(0, 1), B(0, 1), Action(0, ActionType.RECOMPUTE, 0), B(0, 0)]])
    with pytest.raises(ValueError, match=r"rank 0: 0RECOMPUTE0 \(RECOMPUTE\).*written by the strategy from its memory plan"):
        check_executable(validate(recompute))


def test_split_backward_shares_and_refusals():
    """I and W cost their measured shares; the first stage's I is empty and its W a whole backward;
    shares that would split a backward into less than one are refused (the planners' bounds need it)."""
    split = SplitBackward.measured(0.6, 0.3, 1.0)  # I+W under one B: timing noise, scaled up to one B
    assert split.shares(1) == pytest.approx((0.6 / 0.9, 0.3 / 0.9)) and split.shares(0) == (0.0, 1.0)
    assert backward_share(ActionType.BACKWARD_WEIGHT, 0, split) == 1.0
    assert backward_share(ActionType.BACKWARD_INPUT, 2, None) == 0.5 == ACTION_RULES[ActionType.BACKWARD_INPUT].backward_share
    assert backward_share(ActionType.BACKWARD, 2, split) == 1.0
    with pytest.raises(ValueError, match="add up to 0.6 backwards"):
        SplitBackward(0.3, 0.3)
    with pytest.raises(ValueError, match="must be > 0"):
        SplitBackward.measured(0.0, 0.0, 1.0)
