"""Zero-bubble pairs merged into one B: which pairs may merge, what the merged program is, and that
the merge decision never makes the simulated step longer."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_pipe.schedules import (
    ActionCosts,
    ActionType,
    SplitBackward,
    auto_schedule,
    merge_backward_pairs,
    merge_decision_costs,
    measured_merge_costs,
    merge_split_backwards,
    mergeable_pairs,
    merged_if_split,
    merged_program,
    resolve_schedule,
    simulate,
    split_stages,
)

SENDS = {ActionType.SEND_F, ActionType.SEND_B}
SIZES = [("zbv", 2, 4), ("zbv", 2, 8), ("zbv", 4, 8), ("zb_h1", 2, 4), ("zb_h1", 4, 8), ({"preset": "v_zb"}, 2, 6)]
# what I and W cost on CPU (docs/schedules.md: a split pair 1.15-1.23x one B), and the ideal halves
MEASURED = SplitBackward(0.62, 0.58, 0.0, 1.0)


def _program(name, ranks, microbatches):
    return resolve_schedule(name).build(ranks, microbatches)


def _positions(program):
    return {(a.type, a.stage, a.microbatch): (rank, i) for rank, row in enumerate(program.actions) for i, a in enumerate(row)}


@pytest.mark.parametrize(("name", "ranks", "microbatches"), SIZES)
def test_mergeable_pairs_are_exactly_those_with_only_sends_between_their_i_and_w(name, ranks, microbatches):
    program = _program(name, ranks, microbatches)
    where = _positions(program)
    candidates = set(mergeable_pairs(program))
    for (kind, stage, mb), (rank, i) in where.items():
        if kind is not ActionType.BACKWARD_INPUT:
            continue
        w_rank, j = where[(ActionType.BACKWARD_WEIGHT, stage, mb)]
        between = program.actions[rank][i + 1 : j]
        only_sends = w_rank == rank and j > i and all(a.type in SENDS for a in between)
        assert ((stage, mb) in candidates) == only_sends, (stage, mb, between)


def test_a_merged_pair_is_one_b_where_its_i_was_and_everything_else_keeps_its_order():
    program = _program("zbv", 2, 4)
    pairs = mergeable_pairs(program)[::2]
    merged = merge_backward_pairs(program, pairs)
    for before, after in zip(program.actions, merged.actions):
        expected = [
            dataclasses.replace(a, type=ActionType.BACKWARD) if a.type is ActionType.BACKWARD_INPUT and (a.stage, a.microbatch) in pairs else a
            for a in before
            if not (a.type is ActionType.BACKWARD_WEIGHT and (a.stage, a.microbatch) in pairs)
        ]
        assert list(after) == expected
    assert sum(a.type is ActionType.BACKWARD for row in merged.actions for a in row) == len(pairs)


def test_merging_a_pair_with_a_receive_between_is_refused():
    program = _program("zbv", 2, 4)
    all_pairs = {(a.stage, a.microbatch) for row in program.actions for a in row if a.type is ActionType.BACKWARD_INPUT}
    blocked = sorted(all_pairs - set(mergeable_pairs(program)))
    assert blocked
    with pytest.raises(ValueError, match="only pairs whose W follows their I"):
        merge_backward_pairs(program, blocked[:1])


@pytest.mark.parametrize("split", [None, MEASURED], ids=["ideal", "measured"])
@pytest.mark.parametrize(("name", "ranks", "microbatches"), SIZES)
def test_the_merge_decision_never_makes_the_simulated_step_longer_nor_holds_more(name, ranks, microbatches, split):
    program = _program(name, ranks, microbatches)
    costs = merge_decision_costs(program, split)
    merged = merge_split_backwards(program, costs)
    before, after = simulate(program, costs), simulate(merged, costs)
    assert after.makespan <= before.makespan * (1 + 1e-9)
    assert all(a <= b + 1e-9 for a, b in zip(after.peak_memory, before.peak_memory))
    assert merge_split_backwards(program, costs) == merged  # every rank builds the same program
    if split is None:  # ideal halves: merges only where nothing waits longer
        assert after.makespan == pytest.approx(before.makespan)


def test_where_a_split_costs_more_than_b_merging_shortens_zbv_and_keeps_the_bubble_fillers():
    """The bench's shape (2 ranks, 4 microbatches): merged, the step is shorter, and some pairs stay
    split (the ones whose deferred W fills a wait), so it is not simply 1F1B on a V."""
    program = _program("zbv", 2, 4)
    costs = merge_decision_costs(program, MEASURED)
    merged = merge_split_backwards(program, costs)
    assert simulate(merged, costs).makespan < simulate(program, costs).makespan * 0.97
    assert merged.splits_backward
    everything = merge_backward_pairs(program, mergeable_pairs(program))
    assert simulate(merged, costs).makespan < simulate(everything, costs).makespan


def test_programs_without_a_split_backward_come_back_unchanged():
    program = _program("1f1b", 2, 4)
    assert merge_split_backwards(program) is program


def test_merged_program_is_the_decision_for_the_family_and_is_built_once():
    schedule = resolve_schedule("zbv")
    program = merged_program(schedule, 2, 4, MEASURED)
    built = schedule.build(2, 4)
    assert program == merge_split_backwards(built, merge_decision_costs(built, MEASURED))
    assert merged_program(schedule, 2, 4, MEASURED) is program


def test_auto_schedule_prices_the_merged_program_when_the_strategy_merges():
    """What ScheduleSwitch('auto') ranks with: the program the strategy will run, so a zero-bubble
    family is not priced at the split it no longer pays."""
    costs = ActionCosts.uniform(2, 4, forward=1.0, backward=2.0, backward_input=1.24, backward_weight=1.16)
    plain = {row.label: row for row in auto_schedule(costs, 2, candidates=["zbv", "1f1b"])}
    merged = {
        row.label: row
        for row in auto_schedule(costs, 2, candidates=["zbv", "1f1b"], merge_split_backward=True, split_backward=MEASURED)
    }
    schedule = resolve_schedule("zbv")
    expected = simulate(merged_program(schedule, 2, 4, MEASURED), split_stages(costs, 2)).makespan
    assert merged["zbv"].makespan == pytest.approx(expected)
    assert merged["zbv"].makespan < plain["zbv"].makespan
    assert merged["1f1b"].makespan == plain["1f1b"].makespan


def test_merged_if_split_is_the_merged_program_for_a_split_family_and_none_otherwise():
    assert merged_if_split(resolve_schedule("1f1b"), 2, 4) is None
    assert merged_if_split(resolve_schedule("zbv"), 2, 4, MEASURED) is merged_program(resolve_schedule("zbv"), 2, 4, MEASURED)


# seconds a ZB-V step of the benchmark GPT measured per stage at 2 ranks, partition [2, 1, 3, 2] (session 19):
# the first stage carries the embeddings, the last the head and the loss; stage 0's split is all W
MEASURED_FORWARD = {0: 7.78, 1: 4.37, 2: 10.92, 3: 9.96}
MEASURED_BACKWARD = {0: 12.16, 1: 5.3, 2: 15.94, 3: 13.43}
MEASURED_INPUT = {1: 4.36, 2: 12.04, 3: 8.79}
MEASURED_WEIGHT = {1: 1.99, 2: 5.59, 3: 4.32}


def test_measured_merge_costs_price_each_stage_and_the_split_as_measured():
    program = _program("zbv", 2, 4)
    costs = measured_merge_costs(program, MEASURED_FORWARD, MEASURED_BACKWARD, MEASURED_INPUT, MEASURED_WEIGHT)
    shares = SplitBackward.measured(sum(MEASURED_INPUT.values()), sum(MEASURED_WEIGHT.values()), 5.3 + 15.94 + 13.43)
    for stage in range(4):
        assert costs.forward[stage] == (MEASURED_FORWARD[stage],) * 4
        assert costs.backward[stage] == (MEASURED_BACKWARD[stage],) * 4
        i, w = shares.shares(stage)
        assert costs.backward_input[stage][0] == pytest.approx(i * MEASURED_BACKWARD[stage])
        assert costs.backward_weight[stage][0] == pytest.approx(w * MEASURED_BACKWARD[stage])
    assert costs.backward_input[0][0] == 0.0  # the first stage has no input gradient: its W is the whole backward
    # a stage that ran only split pairs is priced at its I + W over the split's shares
    only_split = dict(MEASURED_BACKWARD)
    del only_split[2]
    costs = measured_merge_costs(program, MEASURED_FORWARD, only_split, MEASURED_INPUT, MEASURED_WEIGHT)
    shares = SplitBackward.measured(4.36 + 8.79, 1.99 + 4.32, 5.3 + 13.43)  # from the stages that ran both
    assert costs.backward[2][0] == pytest.approx((12.04 + 5.59) / sum(shares.shares(2)))


def test_measured_merge_costs_are_none_where_the_measurement_cannot_price_the_program():
    program = _program("zbv", 2, 4)
    no_forward = {s: t for s, t in MEASURED_FORWARD.items() if s != 3}
    assert measured_merge_costs(program, no_forward, MEASURED_BACKWARD, MEASURED_INPUT, MEASURED_WEIGHT) is None
    assert measured_merge_costs(program, MEASURED_FORWARD, MEASURED_BACKWARD, {}, {}) is None  # no split measured
    no_backward = {s: t for s, t in MEASURED_BACKWARD.items() if s != 0}
    assert measured_merge_costs(program, MEASURED_FORWARD, no_backward, MEASURED_INPUT, MEASURED_WEIGHT) is None


def test_merges_decided_on_measured_costs_are_never_slower_there_than_the_uniform_decision():
    """What the strategy does once steps have measured: decide again, keep it where it is shorter."""
    program = _program("zbv", 2, 4)
    costs = measured_merge_costs(program, MEASURED_FORWARD, MEASURED_BACKWARD, MEASURED_INPUT, MEASURED_WEIGHT)
    uniform = merged_program(resolve_schedule("zbv"), 2, 4)
    measured = merge_split_backwards(program, costs)
    assert simulate(measured, costs).makespan < simulate(uniform, costs).makespan  # 174.3 against 177.5 here
    assert measured != uniform
