"""HelixPipe and SPipe beside the other families: the gallery, the DSL (what it cannot express), the
auto-scheduler (opt-in, priced from per-rank costs) and the joint planner (refused, with why)."""

from __future__ import annotations

import pytest

from lightning_pipe.schedules import ActionCosts, auto_schedule, resolve_schedule, simulate, split_program
from lightning_pipe.schedules.auto import split_candidates
from lightning_pipe.schedules.gallery import PICTURES, simulate_picture
from lightning_pipe.schedules.split_schedules import split_share_costs


def test_gallery_pictures_are_the_families_programs():
    pictures = {p.filename: p for p in PICTURES}
    helix = split_program(resolve_schedule("helix"), 4, 8, pictures["helix.png"].num_blocks)
    spipe = split_program(resolve_schedule("spipe"), 4, 4, pictures["spipe.png"].num_blocks)
    assert helix.num_stages == 2 * 8 + 1 and spipe.num_stages == 16
    for picture, program in ((pictures["helix.png"], helix), (pictures["spipe.png"], spipe)):
        costs = split_share_costs(program, 4)
        # a rank's share of the model costs 1 forward, as in the other pictures: a microbatch's forwards sum to p
        assert sum(row[0] for row in costs.forward) == pytest.approx(4.0)
        assert simulate_picture(picture).makespan == pytest.approx(simulate(program, costs).makespan)


def test_the_dsl_says_it_cannot_express_split_placement():
    for name in ("helix", "spipe"):
        with pytest.raises(ValueError, match="not a DSL preset: the DSL places every stage whole on one rank"):
            resolve_schedule(f"preset={name} max_in_flight=2")


def test_auto_scheduler_prices_split_placement_only_when_told_the_blocks():
    costs = ActionCosts.uniform(4, 8, forward=1.0, backward=2.0)
    default = {row.label for row in auto_schedule(costs, 4)}
    assert not {label for label in default if label.startswith(("helix", "spipe"))}  # ScheduleSwitch must not pick them
    rows = {row.label: row for row in auto_schedule(costs, 4, num_blocks=16, attention_share=0.3)}
    assert {"helix", "spipe:v=1", "spipe:v=2"} <= set(rows)
    assert rows["helix"].schedule.name == "helix" and rows["spipe:v=2"].schedule.options["stages_per_rank"] == 2
    # each rank's work is cut, not changed: the finer stages' forwards of a microbatch sum to the ranks'
    from lightning_pipe.schedules.auto import _split_costs

    for label in ("helix", "spipe:v=2"):
        program = split_program(rows[label].schedule, 4, 8, 16)
        cut = _split_costs(rows[label].schedule, program, costs, 0.3)
        assert sum(row[0] for row in cut.forward) == pytest.approx(4.0), label
    without_helix = {row.label for row in auto_schedule(costs, 4, num_blocks=16)}
    assert "helix" not in without_helix and "spipe:v=1" in without_helix  # helix needs the attention share
    assert [label for label, _ in split_candidates(False)] == ["spipe:v=1", "spipe:v=2"]


def test_joint_planner_refuses_split_placement_families():
    from lightning_pipe.planning import gpt_cost_model
    from lightning_pipe.planning.joint import JointConfig, plan_joint

    model = gpt_cost_model(num_layers=4, hidden=256, heads=4, vocab=1000)
    with pytest.raises(ValueError, match="cannot switch into or out of split placement"):
        plan_joint(model, [64, 32, 16, 8], 2, None, config=JointConfig(families=("1f1b", "helix")))


def test_planners_that_price_whole_stages_refuse_split_programs():
    from lightning_pipe.planning import gpt_cost_model
    from lightning_pipe.planning.cost_model import MicrobatchShape
    from lightning_pipe.planning.memory_model import MemoryPlan, predict_memory
    from lightning_pipe.planning.partition import plan_partition

    program = split_program(resolve_schedule("helix"), 2, 4, 4)
    shapes = [MicrobatchShape(1, 64, 64.0**2)] * 4
    with pytest.raises(ValueError, match="the partition planner prices stages placed whole"):
        plan_partition(gpt_cost_model(num_layers=4, hidden=64, heads=4, vocab=100), shapes, program, 2)
    with pytest.raises(ValueError, match="the memory model prices stages placed whole"):
        predict_memory(program, list(range(5)), shapes, MemoryPlan(), profile=None)  # refused before anything is read
