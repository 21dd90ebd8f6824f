"""Sequence grouping (InfiniPipe §3.3.2): consecutive sliced 1F1B pipelines and the dynamic program of Eq. 14."""

from __future__ import annotations

import math

import pytest

from lightning_pipe.planning.chunking import PlannedChunks, chunk_batch, chunk_program
from lightning_pipe.planning.cost_model import LinearCost
from lightning_pipe.planning.gpt import gpt_cost_model
from lightning_pipe.planning.grouping import group_sequences
from lightning_pipe.planning.joint import memory_profile_from_cost_model
from lightning_pipe.planning.memory_model import MemoryPlan, predict_memory
from lightning_pipe.planning.memory_planner import MemoryBudgetError, step_seconds
from lightning_pipe.planning.plan import PipelinePlan
from lightning_pipe.schedules import simulate, validate
from lightning_pipe.schedules.families.sliced_1f1b import sliced_1f1b

CHUNK_COST = LinearCost(per_token=1.0, per_squared_length=0.05)
LENGTHS = [24, 3, 14, 18, 8, 20, 23, 15]  # chunk counts 4, 4, 3, 3, 2, 2, 1 with N = 4
BOUNDARIES = (0, 2, 4)


def _setup():
    cost = gpt_cost_model(4, 16, 2, 64)
    chunks = PlannedChunks.from_plan(chunk_batch(LENGTHS, 4, CHUNK_COST), LENGTHS)
    profile = memory_profile_from_cost_model(cost)
    program = sliced_1f1b(2, chunks.num_microbatches, chunks.slices)
    peak = lambda plan: max(predict_memory(program, BOUNDARIES, chunks.shapes, plan, profile).peak_bytes)
    return cost, chunks, profile, peak(MemoryPlan()), peak(MemoryPlan.from_options("full"))


def _program(chunks: PlannedChunks):
    return chunk_program(PipelinePlan(BOUNDARIES, "1f1b", chunks.num_microbatches, chunks=chunks), 2)


def test_consecutive_pipelines_run_one_after_the_other():
    """The pipelines' programs concatenated per rank: valid, a flush between them (the step's
    simulated time is the sum of the pipelines'), and each with its own in-flight window (Eq. 7)."""
    cost, chunks, _, _, _ = _setup()
    slices = chunks.slices
    grouped = sliced_1f1b(2, sum(slices), slices, pipelines=(2, 5))
    validate(grouped)
    costs = cost.stage_costs(BOUNDARIES, chunks.shapes)
    first, second = sum(slices[:2]), sum(slices[2:])
    parts = [
        simulate(sliced_1f1b(2, first, slices[:2]), cost.stage_costs(BOUNDARIES, chunks.shapes[:first])).makespan,
        simulate(sliced_1f1b(2, second, slices[2:]), cost.stage_costs(BOUNDARIES, chunks.shapes[first:])).makespan,
    ]
    assert simulate(grouped, costs).makespan == pytest.approx(sum(parts), rel=1e-12)
    # rank 0 finishes every backward of pipeline 1 before the first forward of pipeline 2
    actions = [a for a in grouped.actions[0] if a.type.name in ("FORWARD", "BACKWARD")]
    last_backward = max(i for i, a in enumerate(actions) if a.type.name == "BACKWARD" and a.microbatch < first)
    first_forward = min(i for i, a in enumerate(actions) if a.type.name == "FORWARD" and a.microbatch >= first)
    assert last_backward < first_forward
    with pytest.raises(ValueError, match="pipelines"):
        sliced_1f1b(2, sum(slices), slices, pipelines=(2, 2))
    with pytest.raises(ValueError, match="pipelines"):
        PlannedChunks(chunks.pieces, chunks.slices, chunks.sequence_lengths, (3, 3))


def test_grouping_splits_the_batch_under_tight_memory_and_its_plans_fit():
    """Halfway between the full-recompute and no-recompute peaks, Eq. 14 chooses several pipelines (less
    recompute for the short sequences than behind the longest ones); the pipelines' plans combined
    fit the budget on the grouped program; with no binding budget it keeps one pipeline."""
    cost, chunks, profile, none, full = _setup()
    budget = (none + full) / 2
    found = group_sequences(chunks, BOUNDARIES, profile, budget, cost_model=cost, options=("full",))
    assert found.num_pipelines > 1 and found.memory is not None
    counts = sorted(set(chunks.slices))
    assert found.solves == len(counts) * (len(counts) + 1) // 2  # §3.3.4: n (n + 1) / 2 solves
    assert found.seconds == pytest.approx(sum(found.pipeline_seconds))
    assert found.chunks.slices == tuple(sorted(chunks.slices, reverse=True))
    program = _program(found.chunks)
    assert predict_memory(program, BOUNDARIES, found.chunks.shapes, found.memory, profile).fits(budget)
    # no better split: one pipeline, or each chunk count alone, costs at least as much
    one = group_sequences(chunks, BOUNDARIES, profile, budget, cost_model=cost, options=("full",), max_pipelines=1)
    assert one.num_pipelines == 1 and one.solves == 1 and found.seconds <= one.seconds
    free = group_sequences(chunks, BOUNDARIES, profile, math.inf, cost_model=cost, options=("full",))
    assert free.num_pipelines == 1 and free.memory is None
    with pytest.raises(MemoryBudgetError, match="No grouping"):
        group_sequences(chunks, BOUNDARIES, profile, full / 2, cost_model=cost, options=("full",))


def test_makespan_objective_is_the_grouped_steps_simulated_time():
    """With ``objective='makespan'`` the dynamic program's value is the simulated step of the grouped
    program under the combined memory plan (pipelines are flushed one after the other), and no
    single pipeline is faster."""
    cost, chunks, profile, none, full = _setup()
    budget = (none + full) / 2
    found = group_sequences(chunks, BOUNDARIES, profile, budget, cost_model=cost, objective="makespan", options=("full",))
    program = _program(found.chunks)
    simulated = step_seconds(program, BOUNDARIES, found.chunks.shapes, profile, found.memory or MemoryPlan(), cost_model=cost)
    assert simulated == pytest.approx(found.seconds, rel=1e-9)
    one = group_sequences(
        chunks, BOUNDARIES, profile, budget, cost_model=cost, objective="makespan", options=("full",), max_pipelines=1
    )
    assert found.seconds <= one.seconds * (1 + 1e-12)


def test_groups_are_reordered_longest_first():
    cost, chunks, profile, _, _ = _setup()
    groups, start = [], 0
    for count in chunks.slices:
        groups.append(chunks.pieces[start : start + count])
        start += count
    shuffled = groups[::-1]  # shortest first
    mixed = PlannedChunks(tuple(g for group in shuffled for g in group), tuple(len(g) for g in shuffled), LENGTHS)
    found = group_sequences(mixed, BOUNDARIES, profile, math.inf, cost_model=cost)
    assert found.chunks.slices == tuple(sorted(chunks.slices, reverse=True))
    assert [mixed.pieces[m] for m in found.order] == list(found.chunks.pieces)


def test_stated_gap_bounds_the_grouping_and_parallel_solves_agree():
    """With a relative gap per memory plan the grouping costs at least the exact one (solved one at a
    time to HiGHS's tolerance) and at most ``1 / (1 - gap)`` times it; solving the plans on several
    threads finds the same grouping as one at a time."""
    cost, chunks, profile, none, full = _setup()
    budget = (none + full) / 2
    args = (chunks, BOUNDARIES, profile, budget)
    exact = group_sequences(*args, cost_model=cost, options=("full",), relative_gap=0.0, workers=1)
    loose = group_sequences(*args, cost_model=cost, options=("full",), relative_gap=0.05, workers=4)
    parallel = group_sequences(*args, cost_model=cost, options=("full",), relative_gap=0.0, workers=4)
    assert exact.gap <= 1e-6 and 0.0 <= loose.gap <= 0.05
    assert exact.seconds <= loose.seconds * (1 + 1e-12) <= exact.seconds / (1 - loose.gap) * (1 + 1e-9)
    assert (parallel.chunks, parallel.memory, parallel.seconds) == (exact.chunks, exact.memory, exact.seconds)
