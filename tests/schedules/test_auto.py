"""Auto-scheduler: ranking, memory limit, derived costs, speed print."""

from __future__ import annotations

import time

import pytest

from lightning_pipe.schedules import ActionCosts, Schedule, auto_schedule, format_auto_table, simulate, split_stages


def test_rows_are_ranked_fits_first_then_makespan():
    costs = ActionCosts.uniform(4, 8, saved_bytes=1.0)
    rows = auto_schedule(costs, 4, memory_limit=4.0)
    assert rows[0].fits
    fits = [r.fits for r in rows]
    assert fits == sorted(fits, reverse=True)
    fitting = [r.makespan for r in rows if r.fits]
    assert fitting == sorted(fitting)
    assert {r.label for r in rows} >= {"1f1b", "gpipe", "zb_h1", "zbv"}
    gpipe = next(r for r in rows if r.label == "gpipe")
    assert not gpipe.fits and gpipe.peak_memory == 8.0  # holds all 8 microbatches


def test_without_a_limit_the_fastest_wins_and_matches_its_own_simulation():
    costs = ActionCosts.uniform(4, 8)
    best = auto_schedule(costs, 4)[0]
    program = best.schedule.build(4, 8)
    again = simulate(program, split_stages(costs, best.schedule.stages_per_rank))
    assert again.makespan == pytest.approx(best.makespan)
    assert best.makespan <= simulate(Schedule("zbv").build(4, 8), split_stages(costs, 2)).makespan


def test_split_stages_keeps_totals_and_depth_profile():
    costs = ActionCosts(
        forward=((1.0, 1.0), (3.0, 3.0)),
        backward=((2.0, 2.0), (6.0, 6.0)),
        activation_bytes=((8.0, 8.0), (8.0, 8.0)),
        saved_bytes=((4.0, 4.0), (2.0, 2.0)),
        static_bytes=(10.0, 30.0),
    )
    split = split_stages(costs, 2)
    assert split.forward == ((0.5, 0.5), (0.5, 0.5), (1.5, 1.5), (1.5, 1.5))
    assert split.activation_bytes == ((8.0, 8.0),) * 4
    assert split.static_bytes == (5.0, 5.0, 15.0, 15.0)
    assert sum(r[0] for r in split.saved_bytes) == sum(r[0] for r in costs.saved_bytes)


def test_costs_function_and_candidates():
    rows = auto_schedule(lambda n: ActionCosts.uniform(n, 4), 2, num_microbatches=4, candidates=["1f1b", "gpipe"])
    assert [r.label for r in rows] == ["1f1b", "gpipe"]  # same makespan, 1F1B needs less memory


def test_argument_errors():
    with pytest.raises(ValueError, match="memory_limit lists 2 ranks, expected num_ranks=4"):
        auto_schedule(ActionCosts.uniform(4, 4), 4, memory_limit=[1.0, 2.0])
    with pytest.raises(ValueError, match="give costs for num_ranks=4 stages"):
        auto_schedule(ActionCosts.uniform(8, 4), 4)


def test_table_text():
    rows = auto_schedule(ActionCosts.uniform(2, 4), 2, memory_limit=2.0)
    text = format_auto_table(rows, limit=3)
    assert "schedule" in text and "makespan" in text and rows[0].label in text
    assert len([line for line in text.splitlines() if line.startswith("│")]) == 3


def test_speed_p8_m32(capsys):
    costs = ActionCosts.uniform(8, 32, saved_bytes=1.0)
    cpu = time.process_time()
    rows = auto_schedule(costs, 8, memory_limit=8.0)
    cpu = time.process_time() - cpu
    with capsys.disabled():
        print(f"\n[benchmark] auto_schedule p=8 m=32: {len(rows)} candidates in {cpu * 1e3:.0f} ms CPU (target < 1 s)")
    assert rows
