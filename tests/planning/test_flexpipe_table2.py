"""Reproduction of FlexPipe's Table 2 (ATC'25) with HBSA and the paper's aggregate memory model."""

from __future__ import annotations

import pytest

from lightning_pipe.planning.flexpipe_reference import DEVICE_MEMORY, TABLE_2, table2_estimator
from lightning_pipe.planning.hbsa import DepthDecision, decide_depth
from lightning_pipe.planning.layout import Layout, uniform_layout


def _replay() -> list[DepthDecision]:
    """Table 2's rows in order, each planned from the previous row's layout (two stages at first)."""
    decisions: list[DepthDecision] = []
    current: Layout | None = None
    for row in TABLE_2:
        if current is None or current.num_blocks != row.model.num_blocks:
            current = uniform_layout(row.model.num_blocks, row.model.num_devices, 2)
        decision = decide_depth(table2_estimator(row.model, row.max_length, row.peak_gb), current)
        decisions.append(decision)
        current = decision.layout
    return decisions


@pytest.fixture(scope="module")
def decisions() -> list[DepthDecision]:
    return _replay()


@pytest.mark.parametrize("index", range(len(TABLE_2)))
def test_stage_counts_and_widths(decisions: list[DepthDecision], index: int) -> None:
    row, decision = TABLE_2[index], decisions[index]
    assert decision.layout.num_stages == len(row.widths)
    # the widths as a multiset: which stage gets the odd device is a tie of Eq. 1 (see docs)
    assert sorted(decision.layout.widths) == sorted(row.widths)
    assert decision.layout.num_devices == row.model.num_devices


@pytest.mark.parametrize("index", range(len(TABLE_2)))
def test_memory_plan_closes_the_gap_exactly(decisions: list[DepthDecision], index: int) -> None:
    row, decision = TABLE_2[index], decisions[index]
    plan = decision.memory_plan
    total = (plan.recompute_bytes + plan.offload_bytes) / 1e9
    # r + s = M_peak - 80 |S| where the paper plans memory, 0 elsewhere
    assert total == pytest.approx(sum(row.plan_gb), abs=1e-9)
    assert total == pytest.approx(max(row.peak_gb - DEVICE_MEMORY / 1e9 * len(row.widths), 0.0), abs=1e-9)


def test_hysteresis_at_the_same_peak_memory(decisions: list[DepthDecision]) -> None:
    after_2048, after_3072 = decisions[7], decisions[9]
    assert TABLE_2[7].peak_gb == TABLE_2[9].peak_gb
    assert after_2048.action == "memory_plan" and after_2048.layout.num_stages == 4
    assert after_3072.action == "keep" and after_3072.layout.num_stages == 5


def test_outcomes_name_the_four_cases(decisions: list[DepthDecision]) -> None:
    assert [d.action for d in decisions] == [
        "keep", "memory_plan", "grow", "grow", "grow",  # BERT96 from (4, 4)
        "memory_plan", "grow", "memory_plan", "grow", "keep",  # GPT-3.35B from (8, 8)
    ]  # fmt: skip


def test_the_search_prices_far_fewer_layouts_than_brute_force() -> None:
    row = TABLE_2[5]  # GPT-3.35B at mu=512 from (8, 8): searches 3 and 2 stages
    current = uniform_layout(row.model.num_blocks, row.model.num_devices, 2)
    estimator = table2_estimator(row.model, row.max_length, row.peak_gb)
    bounded = decide_depth(estimator, current)
    full = decide_depth(estimator, current, search="brute_force")
    assert bounded.action == full.action == "memory_plan"
    assert full.predicted_seconds <= bounded.predicted_seconds * (1 + 1e-9)
    assert full.num_candidates > 100 * bounded.num_candidates, (full.num_candidates, bounded.num_candidates)
