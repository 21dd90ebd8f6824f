"""The memory planner: fits the budget, is optimal on small cases, explains when nothing fits."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from lightning_pipe.planning.cost_model import MicrobatchShape
from lightning_pipe.planning.memory_model import MemoryPlan, StageMemory, predict_memory
from lightning_pipe.planning.memory_planner import (
    MemoryBudgetError,
    _problem,
    plan_memory,
    profile_cost_model,
    step_seconds,
)
from lightning_pipe.schedules import SplitBackward, resolve_schedule
from tests.planning.test_memory_model import toy_profile


def _budget_between(program, boundaries, shapes, profile, fraction=0.5):
    none = max(predict_memory(program, boundaries, shapes, MemoryPlan(), profile).peak_bytes)
    full = max(predict_memory(program, boundaries, shapes, MemoryPlan.from_options("full"), profile).peak_bytes)
    return full + fraction * (none - full), none


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved_1f1b", "zb_h1"])
@pytest.mark.parametrize("method", ["milp", "greedy"])
def test_plans_fit_the_budget(schedule, method):
    family = resolve_schedule(schedule)
    program = family.build(4, 8)
    blocks = 2 * program.num_stages
    profile = toy_profile(num_blocks=blocks)
    boundaries = tuple(range(0, blocks + 1, 2))
    shapes = [MicrobatchShape.from_lengths([100 * (m % 3 + 1)]) for m in range(8)]
    budget, none_peak = _budget_between(program, boundaries, shapes, profile)
    result = plan_memory(program, boundaries, shapes, profile, budget, method=method, options=("full", "keep_attention"))
    assert none_peak > budget
    assert result.prediction.fits(budget) and result.method == method
    assert not result.plan.is_empty and result.recompute_seconds > 0
    if schedule == "zb_h1":  # selective checkpointing allows one backward pass: never chosen with I/W
        assert not result.plan.uses("keep_attention")


def _exhaustive_best(problem, program, boundaries, shapes, profile, budget) -> float | None:
    """The fastest step over every count of fully recomputed blocks (2 stages x 3 microbatches) that fits."""
    best = None
    for counts in itertools.product(range(3), repeat=6):
        plan = MemoryPlan(microbatches={(s, m): StageMemory(full=counts[3 * s + m]) for s in range(2) for m in range(3)})
        if not predict_memory(program, boundaries, shapes, plan, profile).fits(budget):
            continue
        full = np.array(counts, dtype=float).reshape(2, 3)
        seconds = problem.step_seconds({"full": full, "keep_attention": 0 * full, "offload": 0 * full})
        best = seconds if best is None else min(best, seconds)
    return best


def test_milp_makespan_is_optimal_on_a_small_case():
    """Exhaustive search over every count of fully recomputed blocks agrees with the MILP."""
    program = resolve_schedule("1f1b").build(2, 3)
    profile = toy_profile(num_blocks=4)
    boundaries = (0, 2, 4)
    shapes = [MicrobatchShape.from_lengths([n]) for n in (300, 100, 200)]
    budget, _ = _budget_between(program, boundaries, shapes, profile, fraction=0.4)
    problem = _problem(program, boundaries, shapes, profile, budget, None, ("full",), 25e9, None, None)
    best = _exhaustive_best(problem, program, boundaries, shapes, profile, budget)
    result = plan_memory(program, boundaries, shapes, profile, budget, options=("full",))
    assert best is not None and result.step_seconds == pytest.approx(best, rel=1e-9)
    greedy = plan_memory(program, boundaries, shapes, profile, budget, options=("full",), method="greedy")
    assert greedy.step_seconds >= result.step_seconds - 1e-15


def test_milp_makespan_is_optimal_with_a_measured_split_backward():
    """With zero-bubble's I and W priced as measured (each pass recomputes its blocks), the MILP's
    step time is still the exhaustive optimum, and the split's price is in it."""
    program = resolve_schedule("zb_h1").build(2, 3)
    profile = toy_profile(num_blocks=4)
    boundaries = (0, 2, 4)
    shapes = [MicrobatchShape.from_lengths([n]) for n in (300, 100, 200)]
    model = dataclasses.replace(profile_cost_model(profile), split_backward=SplitBackward.measured(0.8, 0.45, 1.0))
    budget, _ = _budget_between(program, boundaries, shapes, profile, fraction=0.4)
    problem = _problem(program, boundaries, shapes, profile, budget, model, ("full",), 25e9, None, None)
    best = _exhaustive_best(problem, program, boundaries, shapes, profile, budget)
    result = plan_memory(program, boundaries, shapes, profile, budget, options=("full",), cost_model=model)
    assert best is not None and result.step_seconds == pytest.approx(best, rel=1e-9)
    halves = plan_memory(program, boundaries, shapes, profile, budget, options=("full",), cost_model=profile_cost_model(profile))
    assert result.step_seconds > halves.step_seconds


def test_long_batch_gets_more_recompute_than_short():
    program = resolve_schedule("1f1b").build(2, 4)
    profile = toy_profile(num_blocks=4)
    boundaries = (0, 2, 4)
    long = [MicrobatchShape.from_lengths([400])] * 4
    short = [MicrobatchShape.from_lengths([100])] * 4
    budget, _ = _budget_between(program, boundaries, long, profile)

    def recomputed(result):
        return sum((c.full or 0) + (c.keep_attention or 0) for c in result.plan.microbatches.values())

    on_long = plan_memory(program, boundaries, long, profile, budget, options=("full", "keep_attention"))
    on_short = plan_memory(program, boundaries, short, profile, budget, options=("full", "keep_attention"))
    assert recomputed(on_long) > recomputed(on_short) == 0
    assert on_short.method == "none" and on_short.plan.is_empty


def test_recompute_objective_and_diagonals():
    """InfiniPipe's objective (total recompute) and its diagonal variables also give fitting plans."""
    program = resolve_schedule("1f1b").build(4, 8)
    profile = toy_profile(num_blocks=8)
    boundaries = (0, 2, 4, 6, 8)
    shapes = [MicrobatchShape.from_lengths([100 * (m % 4 + 1)]) for m in range(8)]
    budget, _ = _budget_between(program, boundaries, shapes, profile)
    makespan = plan_memory(program, boundaries, shapes, profile, budget, options=("full",))
    recompute = plan_memory(program, boundaries, shapes, profile, budget, options=("full",), objective="recompute")
    tied = plan_memory(
        program, boundaries, shapes, profile, budget, options=("full",), objective="recompute", tie_diagonals=True
    )
    for result in (makespan, recompute, tied):
        assert result.prediction.fits(budget)
    assert makespan.step_seconds <= recompute.step_seconds + 1e-15
    assert recompute.recompute_seconds <= makespan.recompute_seconds + 1e-15
    assert recompute.recompute_seconds <= tied.recompute_seconds + 1e-15  # tying only removes freedom


def test_offload_is_chosen_when_transfers_hide_behind_compute():
    program = resolve_schedule("1f1b").build(2, 4)
    profile = toy_profile(num_blocks=4)
    shapes = [MicrobatchShape.from_lengths([400])] * 4
    budget, _ = _budget_between(program, (0, 2, 4), shapes, profile)
    free = plan_memory(program, (0, 2, 4), shapes, profile, budget, host_bandwidth=1e30)
    no_plan = step_seconds(program, (0, 2, 4), shapes, profile, MemoryPlan())
    assert free.plan.uses("offload") and free.step_seconds == pytest.approx(no_plan)  # transfers hidden: no slowdown
    slow = plan_memory(program, (0, 2, 4), shapes, profile, budget, host_bandwidth=1.0)
    assert not slow.plan.uses("offload")


def test_nothing_fits_says_what_would():
    program = resolve_schedule("1f1b").build(2, 4)
    profile = toy_profile(num_blocks=4)
    shapes = [MicrobatchShape.from_lengths([400])] * 4
    with pytest.raises(MemoryBudgetError, match=r"budget of at least .* would fit") as info:
        plan_memory(program, (0, 2, 4), shapes, profile, 5000, options=("full",))
    assert "pipeline rank" in str(info.value) and "never recomputed" in str(info.value)
    with pytest.raises(ValueError, match="method='fast'"):
        plan_memory(program, (0, 2, 4), shapes, profile, 5000, method="fast")
