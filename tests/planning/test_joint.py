"""The joint planner: fits the budget, never slower than one lever alone, states its gap."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_pipe.planning import MemoryBudgetError, gpt_cost_model, plan_partition
from lightning_pipe.planning.joint import JointConfig, evaluate_plan, memory_profile_from_cost_model, plan_joint
from lightning_pipe.planning.memory_model import MemoryPlan, predict_memory
from lightning_pipe.planning.microbatching import even_microbatch_sizes, microbatch_shapes
from lightning_pipe.planning.plan import PipelinePlan

RANKS = 2
LENGTHS = [4096, 256, 300, 128, 2048, 96, 64, 1024]  # long-tailed: balanced sizes help


def _model():
    return gpt_cost_model(8, 1024, 8, 8000)


def _config(**kwargs):
    return JointConfig(families=("1f1b", "gpipe", "interleaved_1f1b"), microbatch_counts=(2, 4), **kwargs)


def _static(model, budget):
    """1F1B, 4 even microbatches, the best partition for this batch, the best memory plan for it."""
    shapes = microbatch_shapes(LENGTHS, even_microbatch_sizes(len(LENGTHS), 4))
    boundaries = plan_partition(model, shapes, "1f1b", RANKS).boundaries
    return evaluate_plan(model, LENGTHS, PipelinePlan(boundaries, "1f1b", 4), RANKS, budget)


def _peak(plan, profile):
    shapes = microbatch_shapes(LENGTHS, plan.microbatch_sizes or even_microbatch_sizes(len(LENGTHS), plan.num_microbatches))
    program = plan.schedule.build(RANKS, len(shapes))
    return max(predict_memory(program, plan.boundaries, shapes, plan.memory or MemoryPlan(), profile).peak_bytes)


def test_without_a_binding_budget_the_plan_is_proven_optimal():
    model = _model()
    joint = plan_joint(model, LENGTHS, RANKS, None, config=_config())
    assert joint.gap == pytest.approx(0.0, abs=1e-12)
    assert joint.step_seconds == pytest.approx(min(c.step_seconds for c in joint.candidates))
    assert joint.plan.memory is None
    assert joint.step_seconds <= _static(model, None)[0]
    # the levers: holding the microbatching even costs time on this long-tailed batch
    assert joint.best_where(microbatching="even") > joint.step_seconds


def test_a_binding_budget_is_met_and_the_gap_is_stated():
    model = _model()
    profile = memory_profile_from_cost_model(model)
    unlimited = plan_joint(model, LENGTHS, RANKS, None, config=_config())
    budget = 0.8 * _peak(unlimited.plan, profile)
    joint = plan_joint(model, LENGTHS, RANKS, budget, config=_config())
    assert _peak(joint.plan, profile) <= budget
    assert joint.lower_bound_seconds <= joint.step_seconds
    assert joint.gap == pytest.approx(joint.step_seconds / joint.lower_bound_seconds - 1)
    assert joint.step_seconds >= unlimited.step_seconds  # the budget costs time, never saves it
    static_seconds, _ = _static(model, budget)
    assert joint.step_seconds <= static_seconds


def test_nothing_fits():
    with pytest.raises(MemoryBudgetError, match="No plan fits"):
        plan_joint(_model(), LENGTHS, RANKS, 1.0, config=_config())


def test_partition_time_limit_returns_the_best_found():
    model = _model()
    shapes = microbatch_shapes(LENGTHS, even_microbatch_sizes(len(LENGTHS), 4))
    exact = plan_partition(model, shapes, "1f1b", RANKS)
    stopped = plan_partition(model, shapes, "1f1b", RANKS, time_limit=0.0)
    assert exact.proven_optimal and not stopped.proven_optimal
    assert stopped.step_seconds >= exact.step_seconds


def test_pruning_and_the_cache_keep_the_plan_and_the_bound_is_valid():
    """Branch and bound over the groups, cutoffs and the cache change how fast, not what can be chosen:
    everything skipped has a bound at or above the chosen step, the choice is the best priced, a repeated
    batch is planned from the cache, and a time limit on the whole search states a bound that still holds."""
    from lightning_pipe.planning.joint import BOUNDED, PRUNED, JointCache

    model = _model()
    profile = memory_profile_from_cost_model(model)
    unlimited = plan_joint(model, LENGTHS, RANKS, None, config=_config())
    budget = 0.8 * _peak(unlimited.plan, profile)
    cache = JointCache()
    joint = plan_joint(model, LENGTHS, RANKS, budget, config=_config(), cache=cache)
    priced = [c for c in joint.candidates if c.origin not in (PRUNED, BOUNDED)]
    skipped = [c for c in joint.candidates if c.origin in (PRUNED, BOUNDED)]
    # what was not priced could not have won: its bound is above the chosen plan's step
    assert all(c.lower_bound_seconds >= joint.step_seconds * (1 - 1e-9) for c in skipped)
    assert joint.step_seconds == min(c.step_seconds for c in priced)
    for c in priced:  # every priced candidate is what evaluate_plan says (the cache returns the same)
        assert evaluate_plan(model, LENGTHS, c.plan, RANKS, budget, plan_memory_too=False)[0] == pytest.approx(c.step_seconds)
    misses = cache.misses
    again = plan_joint(model, LENGTHS, RANKS, budget, config=_config(), cache=cache)
    assert again.plan == joint.plan and cache.misses == misses and cache.hits > 0
    hurried = plan_joint(model, LENGTHS, RANKS, budget, config=_config(time_limit=0.0))
    assert hurried.lower_bound_seconds <= joint.step_seconds + 1e-12  # a bound of the optimum, never above it
    assert hurried.step_seconds >= joint.lower_bound_seconds - 1e-12


def test_padded_batches_are_priced_as_they_run():
    """A padded batch's microbatches run at their longest sample; a plan without sizes runs length-grouped."""
    model, mixed = _model(), [900, 40, 40, 40, 600, 40, 40, 40]  # two long sequences among short ones
    boundaries = plan_partition(model, microbatch_shapes(mixed, (2, 2, 2, 2)), "1f1b", RANKS).boundaries
    plan = PipelinePlan(boundaries, "1f1b", 4)

    def price(**flags):
        return evaluate_plan(model, mixed, plan, RANKS, None, config=JointConfig(**flags), plan_memory_too=False)[0]

    own, padded, grouped = price(), price(padded=True), price(padded=True, grouped=True)
    assert padded > 1.5 * own  # even pairs in batch order: (900, 40) runs as two 900s
    assert grouped < 0.7 * padded  # longest first, padded-sized: 900 and 600 each alone, the short ones together
    best = plan_joint(model, mixed, RANKS, None, config=_config(padded=True, grouped=True, microbatching=("even",)))
    assert best.plan.microbatch_sizes is None and best.step_seconds <= grouped * (1 + 1e-9)


def test_chunkings_are_a_lever_and_the_better_one_is_chosen():
    """With Algorithm 1's chunkings as candidates (packing, and slicing the longest sequence into 2 or
    4 slices), the joint planner picks a chunking when one is faster under the model than every padded
    microbatching (this long-tailed batch: the 4096-token sequence dominates a padded microbatch), and
    the step it states is what ``evaluate_plan`` prices for the plan (sliced 1F1B over the pieces)."""
    model = _model()
    padded = plan_joint(model, LENGTHS, RANKS, None, config=_config())
    joint = plan_joint(model, LENGTHS, RANKS, None, config=_config(chunkings=(1, 2, 4)))
    assert joint.plan.chunks is not None and joint.step_seconds < padded.step_seconds
    assert joint.step_seconds == pytest.approx(
        evaluate_plan(model, LENGTHS, joint.plan, RANKS, None, plan_memory_too=False)[0], rel=1e-12
    )
    chunked = [c for c in joint.candidates if c.microbatching.startswith("chunks") and c.origin not in ("pruned", "bounded")]
    for c in chunked:
        assert evaluate_plan(model, LENGTHS, c.plan, RANKS, None, plan_memory_too=False)[0] == pytest.approx(c.step_seconds)
    # a chunking no faster than the padded plan is not chosen: holding the chunking at N = 1 costs more here
    assert joint.best_where(microbatching="chunks(N=1)") >= joint.step_seconds
    # under a budget the chosen chunks fit too (memory planned on the sliced program)
    profile = memory_profile_from_cost_model(model)
    budget = 0.8 * _peak(padded.plan, profile)
    fitted = plan_joint(model, LENGTHS, RANKS, budget, config=_config(chunkings=(1, 2, 4)))
    program = fitted.plan.schedule.build(RANKS, fitted.plan.num_microbatches)
    if fitted.plan.chunks is not None:
        from lightning_pipe.planning.chunking import chunk_program

        program = chunk_program(fitted.plan, RANKS)
        shapes = fitted.plan.chunks.shapes
    else:
        shapes = microbatch_shapes(LENGTHS, fitted.plan.microbatch_sizes or even_microbatch_sizes(len(LENGTHS), fitted.plan.num_microbatches))
    memory = fitted.plan.memory or MemoryPlan()
    assert max(predict_memory(program, fitted.plan.boundaries, shapes, memory, profile).peak_bytes) <= budget


def test_chunkings_stay_within_the_time_limit():
    """With the whole search's time limit spent at once, only the most promising (family, microbatching)
    group is searched: the chunkings add candidates, not unbounded planning time; the bound stays valid."""
    from lightning_pipe.planning.joint import PRUNED

    model = _model()
    full = plan_joint(model, LENGTHS, RANKS, None, config=_config(chunkings=(1, 2, 4, 8)))
    hurried = plan_joint(model, LENGTHS, RANKS, None, config=_config(chunkings=(1, 2, 4, 8), time_limit=0.0))
    searched = {(c.plan.schedule.name, c.plan.num_microbatches, c.microbatching) for c in hurried.candidates if c.origin != PRUNED}
    assert len(searched) == 1
    assert any(c.microbatching.startswith("chunks") for c in hurried.candidates)
    assert hurried.lower_bound_seconds <= full.step_seconds + 1e-12
    assert hurried.step_seconds >= full.lower_bound_seconds - 1e-12


def test_a_family_scale_multiplies_that_familys_seconds_and_moves_the_choice():
    """``family_scale`` prices a family's plans at its factor times their simulated seconds: scaled
    down, the chosen family's plan costs that much less; scaled far up, the best of the other
    families is chosen, at exactly what a search of those families alone finds. The gap stays proven."""
    model = _model()
    config = JointConfig(families=("1f1b", "interleaved_1f1b"), microbatch_counts=(4,))
    unscaled = plan_joint(model, LENGTHS, RANKS, None, config=config)
    chosen = unscaled.plan.schedule.name
    other = next(f for f in config.families if f != chosen)
    cheaper = plan_joint(model, LENGTHS, RANKS, None, config=dataclasses.replace(config, family_scale=((chosen, 0.5),)))
    assert cheaper.plan.schedule.name == chosen
    assert cheaper.step_seconds == pytest.approx(0.5 * unscaled.step_seconds, rel=1e-12)
    dearer = plan_joint(model, LENGTHS, RANKS, None, config=dataclasses.replace(config, family_scale=((chosen, 10.0),)))
    alone = plan_joint(model, LENGTHS, RANKS, None, config=dataclasses.replace(config, families=(other,)))
    assert dearer.plan.schedule.name == other
    assert dearer.step_seconds == pytest.approx(alone.step_seconds, rel=1e-12)
    assert dearer.best_where(schedule=chosen) > dearer.step_seconds
    assert dearer.gap == pytest.approx(0.0, abs=1e-12)


def test_with_merged_pairs_a_zero_bubble_family_is_priced_as_the_strategy_runs_it():
    """``merge_split_backward``: ZB-V's plans are priced at the merged program the strategy runs. Where
    a split costs more than one backward and microbatches cost alike, that is shorter than as written;
    the joint search's choice is priced the same way as evaluating its plan."""
    from lightning_pipe.schedules import SplitBackward, merged_program, resolve_schedule

    model = dataclasses.replace(_model(), split_backward=SplitBackward(0.62, 0.58, 0.0, 1.0))
    merged_config = JointConfig(merge_split_backward=True)
    plan = PipelinePlan((0, 2, 4, 6, 8), "zbv", 4)
    alike = [1024] * 8
    written, _ = evaluate_plan(model, alike, plan, RANKS, None)
    merged, _ = evaluate_plan(model, alike, plan, RANKS, None, config=merged_config)
    assert merged < written * 0.99
    assert merged_program(resolve_schedule("zbv"), RANKS, 4, model.split_backward).splits_backward  # some stay split

    config = JointConfig(families=("zbv",), microbatch_counts=(4,), microbatching=("even",), merge_split_backward=True)
    for lengths in (alike, LENGTHS):
        searched = plan_joint(model, lengths, RANKS, None, config=config)
        again, _ = evaluate_plan(model, lengths, searched.plan, RANKS, None, config=merged_config, plan_memory_too=False)
        assert searched.step_seconds == pytest.approx(again, rel=1e-9)
