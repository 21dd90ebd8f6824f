import dataclasses
import itertools

import numpy as np
import pytest

from lightning_pipe.planning import (
    MicrobatchShape,
    evaluate_partition,
    gpt_cost_model,
    plan_partition,
    uniform_partition,
)
from lightning_pipe.schedules import SplitBackward, resolve_schedule, simulate
from tests.planning.helpers import random_cost_model, random_microbatches


def all_partitions(num_blocks: int, num_stages: int):
    for cuts in itertools.combinations(range(1, num_blocks), num_stages - 1):
        yield (0, *cuts, num_blocks)


def brute_force(model, batch, program, memory_limit=None):
    """Smallest simulated step over every partition that fits, by simulating each one."""
    best = (np.inf, None)
    for bounds in all_partitions(model.num_blocks, program.num_stages):
        result = simulate(program, model.stage_costs(bounds, batch))
        if memory_limit is not None and max(result.peak_memory) > memory_limit:
            continue
        best = min(best, (result.makespan, bounds))
    return best


CASES = [("1f1b", 3), ("1f1b", 4), ("gpipe", 3), ("interleaved_1f1b", 2), ("zb_h1", 3), ("zbv", 2)]


@pytest.mark.parametrize(("schedule", "num_ranks"), CASES)
@pytest.mark.parametrize("seed", range(3))
def test_plan_is_the_brute_force_optimum(schedule, num_ranks, seed):
    rng = np.random.default_rng(seed)
    num_microbatches = int(rng.integers(2, 6))
    program = resolve_schedule(schedule).build(num_ranks, num_microbatches)
    model = random_cost_model(rng, num_blocks=int(rng.integers(program.num_stages + 1, 9)))
    batch = random_microbatches(rng, num_microbatches)
    plan = plan_partition(model, batch, schedule, num_ranks)
    best, _ = brute_force(model, batch, program)
    assert plan.step_seconds == pytest.approx(best, rel=1e-9)
    assert plan.proven_optimal
    assert plan.step_seconds == simulate(program, model.stage_costs(plan.boundaries, batch)).makespan


@pytest.mark.parametrize(("schedule", "num_ranks"), [("zb_h1", 3), ("zbv", 2)])
@pytest.mark.parametrize("seed", range(3))
def test_plan_is_the_brute_force_optimum_with_a_measured_split_backward(schedule, num_ranks, seed):
    """I and W priced as measured (dearer than one backward, the first stage's I empty) move the
    optimum; the search still finds the simulator's best."""
    rng = np.random.default_rng(100 + seed)
    num_microbatches = int(rng.integers(2, 6))
    program = resolve_schedule(schedule).build(num_ranks, num_microbatches)
    model = random_cost_model(rng, num_blocks=int(rng.integers(program.num_stages + 1, 9)))
    model = dataclasses.replace(model, split_backward=SplitBackward.measured(0.8, 0.45, 1.0))
    batch = random_microbatches(rng, num_microbatches)
    plan = plan_partition(model, batch, schedule, num_ranks)
    best, _ = brute_force(model, batch, program)
    assert plan.step_seconds == pytest.approx(best, rel=1e-9)
    assert plan.proven_optimal
    halves = simulate(program, dataclasses.replace(model, split_backward=None).stage_costs(plan.boundaries, batch))
    assert plan.step_seconds > halves.makespan  # the measured split is dearer: the tables are in use


@pytest.mark.parametrize(("schedule", "num_ranks"), [("1f1b", 3), ("interleaved_1f1b", 2)])
@pytest.mark.parametrize("seed", range(3))
def test_plan_respects_memory_limit_exactly(schedule, num_ranks, seed):
    rng = np.random.default_rng(100 + seed)
    program = resolve_schedule(schedule).build(num_ranks, 4)
    model = random_cost_model(rng, num_blocks=8)
    batch = random_microbatches(rng, 4)
    peaks = sorted(
        max(simulate(program, model.stage_costs(b, batch)).peak_memory) for b in all_partitions(8, program.num_stages)
    )
    limit = peaks[len(peaks) // 3]  # a third of the partitions fit
    plan = plan_partition(model, batch, schedule, num_ranks, memory_limit=limit)
    best, _ = brute_force(model, batch, program, memory_limit=limit)
    assert plan.step_seconds == pytest.approx(best, rel=1e-9)
    assert max(plan.peak_memory) <= limit
    assert plan.fits(limit)


def test_infeasible_memory_limit_says_what_is_needed(rng):
    model = random_cost_model(rng, num_blocks=6)
    batch = random_microbatches(rng, 4)
    program = resolve_schedule("1f1b").build(3, 4)
    needed = min(max(simulate(program, model.stage_costs(b, batch)).peak_memory) for b in all_partitions(6, 3))
    with pytest.raises(ValueError, match=r"`memory_limit`=.* GiB per rank is too small.*needs exactly") as error:
        plan_partition(model, batch, "1f1b", 3, memory_limit=needed * 0.99)
    assert f"{needed / 2**30:.2f} GiB" in str(error.value)
    assert "Raise `memory_limit`, use more pipeline ranks" in str(error.value)
    assert plan_partition(model, batch, "1f1b", 3, memory_limit=needed).fits(needed)


def test_identical_microbatches_on_gpt_balance_the_head():
    # 8 equal microbatches of short sequences: the LM head is worth about two blocks, so the last
    # stage gets fewer blocks than the uniform partition gives it, and the plan is faster.
    model = gpt_cost_model(24, hidden=2048, heads=16, vocab=50257)
    batch = [MicrobatchShape.from_lengths([512] * 4)] * 8
    plan = plan_partition(model, batch, "1f1b", 4)
    uniform = evaluate_partition(model, batch, "1f1b", 4, uniform_partition(24, 4))
    sizes = np.diff(plan.boundaries)
    assert sizes[-1] < 6 and plan.step_seconds < uniform.step_seconds


def test_candidates_do_not_change_the_result(rng):
    model = random_cost_model(rng, num_blocks=8)
    batch = random_microbatches(rng, 4)
    plain = plan_partition(model, batch, "1f1b", 3)
    hinted = plan_partition(model, batch, "1f1b", 3, candidates=[(0, 1, 2, 8), plain.boundaries])
    assert hinted.step_seconds == pytest.approx(plain.step_seconds, rel=1e-9)


def test_relative_gap_bounds_the_loss(rng):
    model = random_cost_model(rng, num_blocks=8)
    batch = random_microbatches(rng, 6)
    exact = plan_partition(model, batch, "1f1b", 4)
    loose = plan_partition(model, batch, "1f1b", 4, relative_gap=0.05)
    assert exact.step_seconds <= loose.step_seconds <= exact.step_seconds * 1.05
    assert not loose.proven_optimal


def test_evaluate_partition_is_one_simulation(rng):
    model = random_cost_model(rng, num_blocks=6)
    batch = random_microbatches(rng, 3)
    plan = evaluate_partition(model, batch, "gpipe", 2, [0, 4, 6])
    program = resolve_schedule("gpipe").build(2, 3)
    result = simulate(program, model.stage_costs([0, 4, 6], batch))
    assert (plan.step_seconds, plan.peak_memory) == (result.makespan, result.peak_memory)
    with pytest.raises(ValueError, match="expected 2"):
        evaluate_partition(model, batch, "gpipe", 2, [0, 2, 4, 6])


def test_plan_rejects_bad_arguments(rng):
    model = random_cost_model(rng, num_blocks=3)
    batch = random_microbatches(rng, 2)
    with pytest.raises(ValueError, match="needs 4 stages"):
        plan_partition(model, batch, "1f1b", 4)
    with pytest.raises(ValueError, match="`microbatches` is empty"):
        plan_partition(model, [], "1f1b", 2)
    with pytest.raises(ValueError, match="`memory_limit` must be > 0"):
        plan_partition(model, batch, "1f1b", 2, memory_limit=0)
    with pytest.raises(ValueError, match="unknown schedule"):
        plan_partition(model, batch, "nope", 2)
    program = resolve_schedule("1f1b").build(2, 3)
    with pytest.raises(ValueError, match="program for 2 ranks x 3 microbatches"):
        plan_partition(model, batch, program, 2)
