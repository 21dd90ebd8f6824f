"""The planner's machinery against the reference simulator: batch simulation, chain bounds, memory."""

import dataclasses

import numpy as np
import pytest

from lightning_pipe.planning import random_partition
from lightning_pipe.planning.batch_simulation import CompiledProgram
from lightning_pipe.planning.bounds import ProgramAnalysis, path_chain
from lightning_pipe.schedules import SplitBackward, resolve_schedule, simulate
from tests.planning.helpers import random_cost_model, random_microbatches

FAMILIES = [("1f1b", 3), ("gpipe", 2), ("interleaved_1f1b", 2), ("zb_h1", 3), ("zbv", 2), ("looped_bfs", 2)]
# I and W as measured on CPU: dearer together than one backward, and the first stage's I empty
MEASURED_SPLIT = SplitBackward.measured(0.8, 0.45, 1.0)
SPLITS = pytest.mark.parametrize("split", [None, MEASURED_SPLIT], ids=["halves", "measured"])


def chain_seconds(chain, costs, split=None):
    """A chain's length under ``costs`` (``I``/``W`` as their shares of a backward, as the simulator
    charges the tables ``stage_costs`` writes for the same split)."""
    forward, backward = np.array(costs.forward), np.array(costs.backward)
    transfer = np.array(
        [[costs.transfer(s, m) for m in range(costs.num_microbatches)] for s in range(costs.num_stages)]
    )
    return float(
        (chain.forward * forward).sum()
        + (chain.backward_counts(split) * backward).sum()
        + (chain.transfer * transfer).sum()
    )


def sampled(family, num_ranks, seed, split=None):
    rng = np.random.default_rng(seed)
    program = resolve_schedule(family).build(num_ranks, 4)
    model = dataclasses.replace(random_cost_model(rng, num_blocks=9), split_backward=split)
    batch = random_microbatches(rng, 4)
    partitions = [random_partition(9, program.num_stages, rng) for _ in range(3)]
    return program, model, batch, partitions


@SPLITS
@pytest.mark.parametrize(("family", "num_ranks"), FAMILIES)
def test_batch_simulation_matches_simulate(family, num_ranks, split):
    program, model, batch, partitions = sampled(family, num_ranks, 7, split)
    compiled = CompiledProgram.of(program)
    costs = [model.stage_costs(p, batch) for p in partitions]

    def stacked(get):  # [stage, microbatch, N]
        return np.stack([np.array(get(c)) for c in costs], axis=-1)

    transfer = stacked(lambda c: [[c.transfer(s, m) for m in range(4)] for s in range(program.num_stages)])
    run = compiled.run(stacked(lambda c: c.forward), stacked(lambda c: c.backward), transfer, split)
    for column, cost in enumerate(costs):
        result = simulate(program, cost)
        assert run.makespans[column] == pytest.approx(result.makespan, rel=1e-12)
        assert tuple(run.critical_path(column)) == result.critical_path


@SPLITS
@pytest.mark.parametrize(("family", "num_ranks"), FAMILIES)
def test_chains_bound_every_partition_and_are_tight_where_found(family, num_ranks, split):
    program, model, batch, partitions = sampled(family, num_ranks, 11, split)
    analysis = ProgramAnalysis.of(program)
    found = []
    for p in partitions:
        costs = model.stage_costs(p, batch)
        result = simulate(program, costs)
        critical = path_chain(program, result.critical_path)
        assert chain_seconds(critical, costs, split) == pytest.approx(result.makespan, rel=1e-12)
        found.append(critical)
    for p in partitions:  # every chain, from any partition, bounds every partition
        costs = model.stage_costs(p, batch)
        makespan = simulate(program, costs).makespan
        for chain in [*found, *analysis.rank_chains]:
            assert chain_seconds(chain, costs, split) <= makespan * (1 + 1e-12)


@pytest.mark.parametrize(("family", "num_ranks"), FAMILIES)
def test_program_order_memory_is_the_simulators(family, num_ranks):
    program, model, batch, partitions = sampled(family, num_ranks, 13)
    analysis = ProgramAnalysis.of(program)
    for p in partitions:
        costs = model.stage_costs(p, batch)
        result = simulate(program, costs)
        saved, static = np.array(costs.saved_bytes), np.array(costs.static_bytes)
        for rank in range(program.num_ranks):
            assert analysis.peak_memory(rank, saved, static) == pytest.approx(result.peak_memory[rank], rel=1e-12)
