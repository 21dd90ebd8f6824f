"""Regrouping between layouts as plain data: data per replica, routes, groups, moves, gradient sums."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_pipe.planning import random_partition
from lightning_pipe.planning.layout import Layout, unit_holders
from lightning_pipe.planning.regroup import (
    activation_route,
    apply_gradient_moves,
    plan_regroup,
    replica_groups,
    replica_microbatches,
)

LAYOUTS_OF_FOUR = [
    Layout((0, 2, 4, 6, 8), (1, 1, 1, 1)),
    Layout((0, 4, 8), (2, 2)),
    Layout((0, 8), (4,)),
    Layout((0, 3, 8), (3, 1)),
    Layout((0, 2, 5, 8), (1, 2, 1)),
]


def _random_layout(rng: np.random.Generator, num_blocks: int, num_devices: int) -> Layout:
    num_stages = int(rng.integers(1, min(num_blocks, num_devices) + 1))
    cuts = sorted(rng.choice(np.arange(1, num_devices), size=num_stages - 1, replace=False).tolist())
    widths = tuple(b - a for a, b in zip([0, *cuts], [*cuts, num_devices], strict=True))
    return Layout(random_partition(num_blocks, num_stages, rng), widths)


@pytest.mark.parametrize("layout", LAYOUTS_OF_FOUR, ids=lambda layout: layout.describe())
def test_every_microbatch_passes_every_stage_once(layout: Layout) -> None:
    for num_microbatches in (1, 3, 4, 7):
        for stage in range(layout.num_stages):
            seen = [
                m
                for replica in range(layout.widths[stage])
                for m in replica_microbatches(layout, stage, replica, num_microbatches)
            ]
            assert sorted(seen) == list(range(num_microbatches))


def test_activation_routes_connect_the_replicas_that_run_the_microbatch() -> None:
    layout = Layout((0, 2, 5, 8), (1, 2, 1))
    assert [activation_route(layout, 0, m) for m in range(4)] == [(0, 1), (0, 2), (0, 1), (0, 2)]
    assert [activation_route(layout, 1, m) for m in range(4)] == [(1, 3), (2, 3), (1, 3), (2, 3)]
    with pytest.raises(ValueError, match="sends no activation"):
        activation_route(layout, 2, 0)
    with pytest.raises(ValueError, match="no replica 2 of stage 1"):
        replica_microbatches(layout, 1, 2, 4)


def test_replica_groups_cover_every_layout_once_in_one_order() -> None:
    groups = replica_groups(LAYOUTS_OF_FOUR)
    assert groups == ((0, 1), (1, 2), (2, 3), (0, 1, 2), (0, 1, 2, 3))
    assert replica_groups(list(reversed(LAYOUTS_OF_FOUR))) == groups


def test_moves_give_every_new_holder_its_units(rng: np.random.Generator) -> None:
    for _ in range(50):
        old, new = _random_layout(rng, 8, 4), _random_layout(rng, 8, 4)
        plan = plan_regroup(old, new, 8)
        before, after = unit_holders(old, 8), unit_holders(new, 8)
        holds = {(u, r) for u, ranks in enumerate(before) for r in ranks}
        for move in plan.moves:
            assert move.source in before[move.unit]
            # the keeper ends up with the total: it is the summing source or receives from it
            assert move.gradient_keeper == move.source or move.gradient_keeper in move.destinations
            assert move.gradient_keeper in after[move.unit]
            holds |= {(move.unit, d) for d in move.destinations}
        assert all((u, r) in holds for u, ranks in enumerate(after) for r in ranks)
        # every send has its receive, in the same order on both sides
        for rank in range(4):
            for unit, destination in plan.sends(rank):
                assert (unit, rank) in plan.receives(destination)


def test_regrouping_inside_an_accumulation_window_keeps_every_gradient_sum(rng: np.random.Generator) -> None:
    for _ in range(50):
        old, new = _random_layout(rng, 8, 4), _random_layout(rng, 8, 4)
        plan = plan_regroup(old, new, 8)
        holders = unit_holders(old, 8)
        partial = {(u, r): float(rng.normal()) for u, ranks in enumerate(holders) for r in ranks}
        after = apply_gradient_moves(plan, partial)
        new_holders = unit_holders(new, 8)
        for unit in range(10):
            assert {r for (u, r) in after if u == unit} == set(new_holders[unit])
            total_before = sum(v for (u, _), v in partial.items() if u == unit)
            total_after = sum(v for (u, _), v in after.items() if u == unit)
            assert total_after == pytest.approx(total_before, abs=1e-12)


def test_identical_layouts_move_nothing() -> None:
    assert plan_regroup(LAYOUTS_OF_FOUR[1], LAYOUTS_OF_FOUR[1], 8).moves == ()
    with pytest.raises(ValueError, match="expected 8 blocks on 4 devices"):
        plan_regroup(LAYOUTS_OF_FOUR[1], Layout((0, 8), (3,)), 8)
