"""HBSA (FlexPipe Algorithm 1): bounds, bounded search against brute force, FMOP decisions."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from lightning_pipe.planning import MicrobatchShape, gpt_1_3b
from lightning_pipe.planning.depth_estimators import AggregateDepthEstimator, CostModelDepthEstimator
from lightning_pipe.planning.hbsa import (
    brute_force_layouts,
    decide_depth,
    minimum_stages,
    search_bounds,
    search_layouts,
)
from lightning_pipe.planning.layout import Layout, uniform_layout
from lightning_pipe.planning.layout_simulation import simulate_layout

GB = 1e9


def test_minimum_stages_uses_a_strict_comparison() -> None:
    assert minimum_stages(140 * GB, 80 * GB, 8) == 2
    assert minimum_stages(160 * GB, 80 * GB, 8) == 3  # Algorithm 1, line 4: M_peak < i M
    assert minimum_stages(1000 * GB, 80 * GB, 8) == 8  # nothing holds it: the deepest, a plan must help
    with pytest.raises(ValueError, match="device_memory"):
        minimum_stages(1.0, 0.0, 8)


def test_bounds_match_the_papers_examples() -> None:
    # notes, section 3.6: BERT96 on 7 stages of 8 GPUs, GPT-3.35B (16 layers) on 5 stages of 16 GPUs
    bert = search_bounds(96, 8, 7, 96)
    assert bert.blocks == (13, 18) and bert.devices == (1, 2)
    gpt = search_bounds(16, 16, 5, 16)
    assert gpt.blocks == (3, 4) and gpt.devices == (3, 4)
    assert search_bounds(96, 8, 7, 15).blocks == (13, 15)  # n_max^l caps the upper bound
    with pytest.raises(ValueError, match="num_stages"):
        search_bounds(4, 8, 5, 4)


@pytest.mark.parametrize(("num_blocks", "num_devices", "num_stages"), [(12, 6, 3), (10, 8, 4), (9, 5, 2), (7, 7, 1)])
def test_search_is_exact_within_its_bounds(num_blocks: int, num_devices: int, num_stages: int) -> None:
    rng = np.random.default_rng(num_blocks * 100 + num_devices)
    weights = rng.uniform(0.5, 1.5, num_blocks)

    def price(layout: Layout) -> float | None:
        times = [weights[a:b].sum() / w for a, b, w in zip(layout.boundaries, layout.boundaries[1:], layout.widths)]
        return None if max(layout.widths) > 3 and layout.num_stages > 1 else max(times) + 0.01 * sum(times)

    bounds = search_bounds(num_blocks, num_devices, num_stages, num_blocks)
    found = search_layouts(num_blocks, num_devices, bounds, price)

    def within(layout: Layout) -> bool:
        return all(bounds.blocks[0] <= b <= bounds.blocks[1] for b in layout.blocks_per_stage()) and all(
            bounds.devices[0] <= w <= bounds.devices[1] for w in layout.widths
        )

    def reached(layout: Layout) -> bool:
        # Algorithm 1 line 19 recurses only while *both* remainders exceed their upper bounds
        if not within(layout) or layout.num_stages < 2:
            return within(layout) and num_stages == 1
        for k in range(1, layout.num_stages - 1):
            rest_blocks = num_blocks - layout.boundaries[k]
            rest_devices = num_devices - sum(layout.widths[:k])
            if not (rest_blocks > bounds.blocks[1] and rest_devices > bounds.devices[1]):
                return False
        return True

    # every layout the recursion reaches, of any depth, priced by brute force
    bounded = []
    for depth in range(1, min(num_blocks, num_devices) + 1):
        everything: list[Layout] = []
        brute_force_layouts(num_blocks, num_devices, depth, lambda layout, seen=everything: seen.append(layout))
        bounded += [layout for layout in everything if reached(layout)]
    values = [(price(layout), layout) for layout in bounded]
    feasible = [value for value, _ in values if value is not None]
    assert found.num_candidates == len(bounded)
    assert found.value == pytest.approx(min(feasible))
    assert within(found.layout)


def test_brute_force_counts_every_layout() -> None:
    result = brute_force_layouts(6, 4, 3, lambda layout: float(sum(layout.widths)))
    assert result.num_candidates == math.comb(5, 2) * math.comb(3, 2)


def _aggregate(peak_gb: float, **options: float) -> AggregateDepthEstimator:
    values = {
        "num_blocks": 16,
        "num_devices": 8,
        "device_memory": 80 * GB,
        "batch_peak_memory": peak_gb * GB,
        "block_seconds": 0.01,
        "num_microbatches": 8,
        "block_gradient_bytes": 1e8,
        "block_state_bytes": 1e9,
        "reconfiguration_overhead": 0.05,
        "static_bytes": 20 * GB,
    }
    values.update(options)
    return AggregateDepthEstimator(**values)


def test_decisions_follow_the_four_cases() -> None:
    two = uniform_layout(16, 8, 2)
    # A and N == |S'|: keep without searching
    keep = decide_depth(_aggregate(150), two)
    assert keep.action == "keep" and keep.layout == two and keep.num_candidates == 0
    # a short batch on a deep, unbalanced layout: shrink when it pays its reconfiguration
    deep = Layout((0, 4, 8, 12, 16), (1, 1, 1, 5))
    shrink = decide_depth(_aggregate(70), deep)
    assert shrink.action == "shrink" and shrink.layout.num_stages < 4
    assert shrink.predicted_seconds < decide_depth(_aggregate(70), deep, allow_memory_plan=False).current_seconds
    # ... but not when reconfiguring costs more than it saves
    assert decide_depth(_aggregate(70, reconfiguration_overhead=100.0), deep).action == "keep"
    # not A, small gap: a memory plan on the current layout; its r + s closes the gap exactly
    plan = decide_depth(_aggregate(170), two)
    assert plan.action == "memory_plan" and plan.layout == two
    assert plan.memory_plan.recompute_bytes + plan.memory_plan.offload_bytes == pytest.approx(10 * GB)
    # not A, gap beyond what a plan may save: grow
    grow = decide_depth(_aggregate(230), two)
    assert grow.action == "grow" and grow.layout.num_stages == 3 and grow.memory_plan.empty
    # Flex w/o M: no memory plans, the small gap grows too
    assert decide_depth(_aggregate(170), two, allow_memory_plan=False).action == "grow"
    with pytest.raises(ValueError, match="No layout of 16 blocks on 8 devices holds the batch"):
        decide_depth(_aggregate(2000), two)


def test_brute_force_is_never_worse_and_prices_more_layouts() -> None:
    current = uniform_layout(16, 8, 2)
    for peak in (70, 150, 170, 230, 330):
        bounded = decide_depth(_aggregate(peak), current)
        full = decide_depth(_aggregate(peak), current, search="brute_force")
        # brute force searches a superset of the same depths: never worse, always more candidates
        assert full.predicted_seconds <= bounded.predicted_seconds * (1 + 1e-9)
        assert bounded.num_candidates <= full.num_candidates


def test_cost_model_estimator_decisions_are_simulated_correctly() -> None:
    model = gpt_1_3b()
    short = [MicrobatchShape.from_lengths([512] * 4)] * 8
    long = [MicrobatchShape.from_lengths([16384] * 2)] * 8
    deep = uniform_layout(24, 8, 8)
    estimator = CostModelDepthEstimator(model, short, 8, 80 * 2**30)
    # one step's gain does not pay for moving every unit (Eq. 4) ...
    assert decide_depth(estimator, deep, deeper=1).action == "keep"
    # ... sixteen steps' gains do
    decision = decide_depth(estimator, deep, deeper=1, migration_horizon=16)
    assert decision.action == "shrink" and decision.layout.num_stages < 8
    # the simulator agrees that the shallower layout is faster on the short batch
    assert (
        simulate_layout(model, short, decision.layout).step_seconds < simulate_layout(model, short, deep).step_seconds
    )
    tight = CostModelDepthEstimator(model, long, 8, 24 * 2**30)
    grown = decide_depth(tight, decision.layout, deeper=1, migration_horizon=16)
    assert grown.action in ("grow", "memory_plan")
    if grown.action == "grow":
        assert max(tight.memory(grown.layout)) <= tight.device_memory or grown.memory_plan.recompute_stages


def test_layouts_in_the_search_cover_all_devices() -> None:
    bounds = search_bounds(10, 7, 3, 10)
    seen: list[Layout] = []
    search_layouts(10, 7, bounds, lambda layout: seen.append(layout))
    assert seen and all(layout.num_devices == 7 and layout.num_blocks == 10 for layout in seen)
    assert len(set(seen)) == len(seen)
    assert any(layout.widths != tuple(sorted(layout.widths)) for layout in seen)
    assert all(isinstance(b, int) for layout in seen for b in itertools.chain(layout.boundaries, layout.widths))
