"""A memory plan written into a program as RECOMPUTE/OFFLOAD/RELOAD actions and read back from it."""

from __future__ import annotations

import pytest

from lightning_pipe.planning.bounds import rank_chain
from lightning_pipe.planning.memory_lowering import has_memory_actions, lower_memory_plan, read_memory_plan
from lightning_pipe.planning.memory_model import MemoryPlan, StageMemory
from lightning_pipe.schedules import ActionCosts, Schedule, simulate, validate
from lightning_pipe.schedules.action_rules import check_executable
from lightning_pipe.schedules.ir import ActionType
from lightning_pipe.schedules.text import format_table, parse_table

MIXED = MemoryPlan(
    default=StageMemory(full=1, mlp_chunk_size=8),
    stages={1: StageMemory(keep_attention=None, offload=1, every=2)},
    microbatches={(2, 1): StageMemory(offload=None), (0, 3): StageMemory()},
)


def _boundaries(num_stages: int) -> tuple[int, ...]:
    return tuple(3 * s for s in range(num_stages + 1))  # three blocks per stage


@pytest.mark.parametrize(("family", "v"), [("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 2), ("gpipe", 1)])
def test_plan_round_trips_through_the_program(family, v):
    program = Schedule(family, v).build(2, 4)
    boundaries = _boundaries(program.num_stages)
    plan = MIXED if program.num_stages > 2 else MemoryPlan(default=MIXED.default, stages={1: MIXED.stages[1]})
    lowered = validate(lower_memory_plan(program, plan, boundaries))
    assert has_memory_actions(lowered) and not has_memory_actions(program)
    back = read_memory_plan(lowered)
    for stage in range(program.num_stages):
        for mb in range(program.num_microbatches):
            want = plan.choice(stage, mb)
            blocks = boundaries[stage + 1] - boundaries[stage]
            assert back.choice(stage, mb).block_modes(blocks) == want.block_modes(blocks)
            if not want.is_default:
                assert back.choice(stage, mb) == want  # every field, mlp_chunk_size included
    per_stage = MemoryPlan(stages={s: StageMemory(full=s % 2, offload=1) for s in range(program.num_stages)})
    assert read_memory_plan(lower_memory_plan(program, per_stage, boundaries)) == per_stage


def test_actions_sit_after_the_forward_and_before_the_first_backward():
    program = Schedule("zb_h1").build(2, 3)
    plan = MemoryPlan(default=StageMemory(full=1, offload=1))
    lowered = lower_memory_plan(program, plan, _boundaries(2))
    for row in lowered.actions:
        tokens = [str(a) for a in row]
        for action in row:
            if action.type is ActionType.FORWARD:
                s, mb = action.stage, action.microbatch
                assert tokens[tokens.index(f"{s}F{mb}") + 1] == f"{s}OFFLOAD{mb}"
                first_backward = tokens.index(f"{s}I{mb}")  # split backward: before I, not before W
                assert tokens[first_backward - 2 : first_backward] == [f"{s}RELOAD{mb}", f"{s}RECOMPUTE{mb}"]
    assert [a for row in lowered.actions for a in row if a.type.is_compute] == [
        a for row in program.actions for a in row if a.type.is_compute
    ]


def test_empty_plans_and_choices_without_effect_write_nothing():
    program = Schedule("1f1b").build(2, 2)
    assert lower_memory_plan(program, MemoryPlan(), _boundaries(2)) is program
    chunk_only = MemoryPlan(default=StageMemory(mlp_chunk_size=4))  # MLP chunking saves and moves nothing
    assert lower_memory_plan(program, chunk_only, _boundaries(2)) is program
    no_blocks = MemoryPlan(stages={0: StageMemory(full=None)})
    assert lower_memory_plan(program, no_blocks, (0, 0, 3)) is program  # stage 0 has no block


def test_lowering_refuses_what_it_cannot_write():
    program = Schedule("1f1b").build(2, 2)
    lowered = lower_memory_plan(program, MemoryPlan.from_options("full"), _boundaries(2))
    with pytest.raises(ValueError, match="holds memory actions already"):
        lower_memory_plan(lowered, MemoryPlan.from_options("full"), _boundaries(2))
    with pytest.raises(ValueError, match="3 boundaries for a program of 4 stages; expected 5"):
        lower_memory_plan(Schedule("interleaved_1f1b", 2).build(2, 2), MemoryPlan(), (0, 1, 2))
    with pytest.raises(ValueError, match="written by the strategy from its memory plan"):
        check_executable(lowered)  # a schedule may not carry them into the strategy


def test_simulator_and_bounds_price_the_written_plan():
    p, m = 2, 4
    program = Schedule("1f1b").build(p, m)
    costs = ActionCosts.uniform(p, m, forward=1.0, backward=2.0, saved_bytes=10.0)
    plain = simulate(program, costs)
    lowered = lower_memory_plan(program, MemoryPlan(stages={0: StageMemory(full=None)}), _boundaries(p))
    recomputed = simulate(lowered, costs)
    assert recomputed.busy[0] == pytest.approx(plain.busy[0] + m)  # one forward more per microbatch of stage 0
    assert recomputed.busy[1] == pytest.approx(plain.busy[1])
    # planning's bounds read the same table: rank 0's chain runs each of its forwards twice
    assert (rank_chain(lowered, 0).forward[0] - rank_chain(program, 0).forward[0]).tolist() == [1.0] * m
    offloaded = simulate(lower_memory_plan(program, MemoryPlan(default=StageMemory(offload=None)), _boundaries(p)), costs)
    assert max(offloaded.peak_memory) < max(plain.peak_memory)


def test_a_program_read_from_text_reads_back_as_whole_pairs():
    program = Schedule("1f1b").build(2, 2)
    plan = MemoryPlan(stages={1: StageMemory(full=1, offload=1)})
    lowered = lower_memory_plan(program, plan, _boundaries(2))
    parsed = parse_table(format_table(lowered))
    assert read_memory_plan(parsed) == MemoryPlan(stages={1: StageMemory(full=None, offload=None)})
