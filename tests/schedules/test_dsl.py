"""The schedule DSL: presets are the families, text/dict forms, rules, instructions."""

from __future__ import annotations

import pytest

from lightning_pipe.schedules import (
    ActionCosts,
    Instruction,
    RuleContext,
    Schedule,
    ScheduleError,
    ScheduleSpec,
    parse_spec,
    register_instruction,
    register_rule,
    resolve_schedule,
    simulate,
    validate,
)
from lightning_pipe.schedules.instructions import unregister_instruction
from lightning_pipe.schedules.ir import ActionType
from lightning_pipe.schedules.text import format_csv, parse_csv

SIZES = [(p, m) for p in (1, 2, 3, 4, 6) for m in (1, 2, 3, 4, 5, 6, 8, 12)]


@pytest.mark.parametrize(
    ("preset", "family", "stages_per_rank"),
    [
        ("gpipe", "gpipe", 1),
        ("1f1b", "1f1b", 1),
        ("interleaved_1f1b", "interleaved_1f1b", 2),
        ("interleaved_1f1b", "interleaved_1f1b", 3),
        ("looped_bfs", "looped_bfs", 2),
    ],
)
def test_families_are_built_from_their_presets(preset, family, stages_per_rank):
    # One source: the registered family is the preset (golden tables in test_families.py pin the orders).
    spec = ScheduleSpec.preset(preset, stages_per_rank=stages_per_rank)
    for p, m in ((2, 3), (4, 6), (3, 8)):
        assert Schedule(family, stages_per_rank).build(p, m) == spec.build(p, m)
    assert Schedule(family, stages_per_rank).build(4, 6) is Schedule(family, stages_per_rank).build(4, 6)  # cached


def test_specs_with_rules_are_not_cached():
    calls = []

    def count(context: RuleContext) -> bool:
        calls.append(context.step)
        return True

    spec = ScheduleSpec.preset("1f1b", rules=(count,))
    spec.build(2, 2)
    first = len(calls)
    spec.build(2, 2)
    assert first > 0 and len(calls) == 2 * first


def test_zero_bubble_presets_beat_1f1b_at_same_or_1f1b_peak_memory():
    p, m = 4, 8
    costs = ActionCosts.uniform(p, m)
    base = simulate(Schedule("1f1b").build(p, m), costs)
    zb = simulate(ScheduleSpec.preset("zb").build(p, m), costs)
    assert zb.makespan < base.makespan and max(zb.max_in_flight) <= p
    v = simulate(ScheduleSpec.preset("v_zb").build(p, m), ActionCosts.uniform(2 * p, m, forward=0.5, backward=1.0))
    assert v.makespan < zb.makespan and max(v.max_in_flight) <= 2 * p


EXAMPLE = {
    "placement": "circular",
    "stages_per_rank": 2,
    "priority": "backward_first",
    "traversal": "depth_first",
    "max_in_flight": 4,
}
EXAMPLE_TEXT = "placement=circular stages_per_rank=2 priority=backward_first traversal=depth_first max_in_flight=4"


def test_text_and_dict_forms_are_equivalent():
    from_dict, from_text = parse_spec(EXAMPLE), parse_spec(EXAMPLE_TEXT)
    assert from_dict == from_text
    assert (from_dict.forward_traversal, from_dict.backward_traversal) == ("depth_first", "depth_first")
    assert (
        parse_spec(
            "placement=circular, stages_per_rank=2; priority=backward_first traversal=depth_first max_in_flight=4"
        )
        == from_text
    )


def test_paper_spellings_are_accepted():
    spec = parse_spec("placement=one-to-one priority=bwdpass-first traversal=breadth-first")
    assert (spec.placement, spec.priority, spec.forward_traversal) == ("one_to_one", "backward_first", "breadth_first")
    assert parse_spec({"placement": "V-shape", "stages_per_rank": 2, "traversal": "dfs"}).placement == "v_shape"


@pytest.mark.parametrize(
    "spec",
    [
        ScheduleSpec(),
        ScheduleSpec.preset("interleaved_1f1b"),
        ScheduleSpec(placement="circular", stages_per_rank=3, max_in_flight=(9, 8, 7), split_backward=True),
        parse_spec("zb max_in_flight=none"),
    ],
)
def test_text_round_trip(spec):
    assert parse_spec(spec.to_text()) == spec
    assert parse_spec(spec.to_dict()) == spec


def test_preset_with_overrides_in_text():
    spec = parse_spec("1f1b max_in_flight=2")
    assert spec == ScheduleSpec.preset("1f1b", max_in_flight=2)
    assert max(simulate(spec.build(4, 8), ActionCosts.uniform(4, 8)).max_in_flight) == 2


def test_resolve_schedule_accepts_dsl_text_dict_and_spec():
    for spec in (EXAMPLE, EXAMPLE_TEXT, parse_spec(EXAMPLE), {"name": "dsl", **EXAMPLE}):
        schedule = resolve_schedule(spec)
        assert (schedule.name, schedule.stages_per_rank) == ("dsl", 2)
        assert schedule.build(4, 8).actions == parse_spec(EXAMPLE).build(4, 8).actions


def test_schedule_of_a_spec_is_hashable_and_rebuilds():
    schedule = ScheduleSpec.preset("1f1b").to_schedule()
    assert hash(schedule) == hash(ScheduleSpec.preset("1f1b").to_schedule())
    assert schedule.build(3, 4).actions == Schedule("1f1b").build(3, 4).actions


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"placement": "diagonal"}, r"placement='diagonal' is not one of one_to_one, circular, v_shape"),
        ({"priority": "whatever"}, "priority='whatever' is not one of backward_first"),
        ({"placment": "circular"}, r"unknown schedule spec keys \['placment'\]; valid keys: preset, traversal"),
        ({"placement": "v_shape"}, "placement=v_shape needs stages_per_rank=2"),
        ({"stages_per_rank": 2}, "placement=one_to_one needs stages_per_rank=1"),
        ({"forward_interval": 0}, "forward_interval must be >= 1"),
        ({"preset": "chimera"}, "unknown preset 'chimera'; presets: 1f1b"),
        ("placement=circular garbage", "cannot read 'garbage'"),
        ({"split_backward": "maybe"}, "split_backward must be true or false"),
        ({"rules": ["not_registered_rule"]}, "unknown rule 'not_registered_rule'"),
    ],
)
def test_spec_errors_name_the_argument(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_spec(spec)


def test_in_flight_list_must_match_ranks():
    with pytest.raises(ValueError, match="max_in_flight lists 2 ranks, the pipeline has num_ranks=4"):
        parse_spec({"max_in_flight": [2, 2]}).build(4, 8)


def test_deadlocking_spec_is_reported():
    # strict depth-first forwards start at the rank's last chunk, which waits on its own first chunk
    spec = parse_spec("placement=circular stages_per_rank=2 forward_traversal=depth_first forward_interval=2")
    with pytest.raises(
        ScheduleError, match=r"deadlocks at scheduling step 0: .*rank 0: 0 in flight \(max_in_flight=4\)"
    ):
        spec.build(2, 4)


def test_in_flight_limit_alone_cannot_deadlock_circular_placements():
    # the example of the docs: 4 microbatches per rank, even on 8 ranks with 2 chunks each
    spec = parse_spec(EXAMPLE)
    for p, m in ((2, 4), (4, 8), (8, 32)):
        result = simulate(spec.build(p, m), ActionCosts.uniform(2 * p, m))
        assert max(result.max_in_flight) <= 4


@pytest.mark.parametrize("limit", [1, 2, 3])
def test_in_flight_limit_is_respected(limit):
    result = simulate(ScheduleSpec(max_in_flight=limit).build(4, 8), ActionCosts.uniform(4, 8))
    assert max(result.max_in_flight) == limit


def test_user_rule_vetoes_actions():
    seen: list[RuleContext] = []

    def late_start(context: RuleContext) -> bool:
        seen.append(context)
        return not (context.action.type is ActionType.FORWARD and context.action.stage == 0 and context.step < 3)

    program = ScheduleSpec(rules=(late_start,)).build(2, 2)
    validate(program)
    # rank 0 is idle for three scheduling steps: the whole pipeline shifts but stays 1F1B
    assert program.actions == Schedule("1f1b").build(2, 2).actions
    assert min(c.step for c in seen if c.action.stage == 0 and c.step >= 3) == 3
    assert all(c.num_ranks == 2 and c.stage_to_rank == (0, 1) for c in seen)


def test_registered_rule_by_name_in_text():
    def forwards_in_order_of_completion(context: RuleContext) -> bool:
        # FlexPipe's example rule: an action may run only a step after its predecessor finished
        action = context.action
        if action.type is not ActionType.FORWARD or action.stage == 0:
            return True
        before = context.step_of(action.__class__(action.stage - 1, ActionType.FORWARD, action.microbatch))
        return before is not None and before < context.step

    register_rule("strictly_after", forwards_in_order_of_completion)
    spec = parse_spec("1f1b rules=[strictly_after]")
    assert spec.rules == ("strictly_after",)
    assert spec.build(3, 4).actions == Schedule("1f1b").build(3, 4).actions
    assert parse_spec(spec.to_text()) == spec


def test_registered_instruction_is_placed_validated_simulated_and_printed():
    register_instruction(
        Instruction("SYNC", "tests.sync:gather", after=ActionType.FORWARD, stages=(-1,), every=2, seconds=0.5),
        overwrite=True,
    )
    try:
        spec = parse_spec("1f1b instructions=SYNC")
        program = spec.build(2, 4)
        last_rank = [str(a) for a in program.actions[1]]
        assert [t for t in last_rank if "SYNC" in t] == ["1SYNC1", "1SYNC3"]
        assert last_rank[last_rank.index("1F1") + 1] == "1SYNC1"
        base = simulate(Schedule("1f1b").build(2, 4), ActionCosts.uniform(2, 4))
        with_sync = simulate(program, ActionCosts.uniform(2, 4))
        assert with_sync.busy[1] == pytest.approx(base.busy[1] + 1.0)
        assert parse_csv(format_csv(program)).actions == program.actions
        custom = next(a for a in program.actions[1] if a.type is ActionType.CUSTOM)
        assert (custom.name, custom.stage, custom.microbatch) == ("SYNC", 1, 1)
    finally:
        unregister_instruction("SYNC")


def test_unknown_instruction_is_rejected():
    with pytest.raises(ValueError, match="unknown instruction 'NOPE'"):
        parse_spec("instructions=NOPE").build(2, 2)
    with pytest.raises(ValueError, match="must be upper-case letters"):
        Instruction("sync2", "x:y")
    with pytest.raises(ValueError, match="not a built-in token"):
        Instruction("SEND_F", "x:y")


def test_dict_with_dsl_keys_and_a_name_is_a_dsl_spec():
    schedule = resolve_schedule({"preset": "1f1b", "name": "mine", "max_in_flight": 2})
    assert schedule.name == "dsl" and schedule.build(4, 8).name == "mine"
    assert (
        resolve_schedule(ScheduleSpec.preset("1f1b").to_dict()).build(3, 4).actions
        == Schedule("1f1b").build(3, 4).actions
    )
    family = resolve_schedule({"family": "interleaved_1f1b", "stages_per_rank": 3})
    assert (family.name, family.stages_per_rank) == ("interleaved_1f1b", 3)


def test_interleaved_priority_with_units_of_two():
    # by hand: the last rank takes two forwards, then (strictly, once started) two backwards, ...
    program = parse_spec("priority=interleaved forward_unit=2 backward_unit=2 max_in_flight=none").build(2, 4)
    rows = [" ".join(str(a) for a in rank if a.type.is_compute) for rank in program.actions]
    assert rows == ["0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3", "1F0 1F1 1B0 1B1 1F2 1F3 1B2 1B3"]
