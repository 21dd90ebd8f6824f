"""HelixPipe and SPipe beside the other families: the gallery, the DSL (what it cannot express), the
auto-scheduler (opt-in, priced from per-rank costs) and the joint planner (priced as fixed placements a
run starts with, never moved into)."""

from __future__ import annotations

import dataclasses

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


def test_joint_planner_prices_split_placement_and_picks_helix_only_at_long_sequences():
    """HelixPipe's claim (its §5): attention, quadratic in the length, leaves the bubble, so it wins at long
    sequences and not at short ones. The joint planner must reproduce the ordering from the cost model."""
    from lightning_pipe.planning import gpt_7b
    from lightning_pipe.planning.cost_model import MicrobatchShape
    from lightning_pipe.planning.joint import PLACED, JointConfig, plan_joint
    from lightning_pipe.planning.split_costs import split_placement_costs

    model = gpt_7b()
    config = JointConfig(families=("1f1b", "zb_h1", "helix", "spipe"), microbatch_counts=(16,), microbatching=("even",))
    chosen = {}
    for length in (4096, 131072):
        joint = plan_joint(model, [length] * 16, 8, None, config=config)
        chosen[length] = joint.plan.schedule.name
        placed = {c.plan.schedule.name: c for c in joint.candidates if c.origin == PLACED}
        assert set(placed) == {"helix", "spipe"}
        for name, candidate in placed.items():  # each is one simulation of the program that runs
            program = split_program(candidate.plan.schedule, 8, 16, model.num_blocks)
            costs = split_placement_costs(model, candidate.plan.schedule, program, [MicrobatchShape.from_lengths([length])] * 16)
            assert candidate.step_seconds == pytest.approx(simulate(program, costs).makespan, rel=1e-12)
            assert candidate.lower_bound_seconds == candidate.step_seconds  # nothing to search: its own bound
        assert joint.lower_bound_seconds <= joint.step_seconds
    assert chosen == {4096: "zb_h1", 131072: "helix"}


def test_split_placement_costs_cut_the_model_without_changing_its_work():
    from lightning_pipe.planning import gpt_cost_model
    from lightning_pipe.planning.cost_model import MicrobatchShape
    from lightning_pipe.planning.split_costs import split_placement_costs

    model = gpt_cost_model(num_layers=8, hidden=256, heads=4, vocab=1000, flash_attention=False)
    shapes = [MicrobatchShape.from_lengths([64, 200]), MicrobatchShape.from_lengths([512])]
    whole = model.tables(shapes)
    for name in ("helix", "spipe"):
        schedule = resolve_schedule(name)
        program = split_program(schedule, 2, 2 * 2, 8) if name == "helix" else split_program(schedule, 2, 4, 8)
        costs = split_placement_costs(model, schedule, program, shapes * (program.num_microbatches // 2))
        for mb in range(2):
            for table, reference in ((costs.forward, whole.forward), (costs.backward, whole.backward),
                                     (costs.saved_bytes, whole.saved_bytes)):
                assert sum(row[mb] for row in table) == pytest.approx(reference[:, mb].sum(), rel=1e-12), name
        assert sum(costs.static_bytes) == pytest.approx(whole.static_bytes.sum(), rel=1e-12)
    helix = split_placement_costs(model, resolve_schedule("helix"), split_program(resolve_schedule("helix"), 2, 4, 8), shapes * 2)
    block = model.units[1]
    for mb, shape in enumerate(shapes):  # attention stages get exactly the quadratic terms
        assert helix.forward[1][mb] == pytest.approx(block.forward.per_squared_length * shape.sum_squared_lengths)
        assert helix.saved_bytes[1][mb] > block.saved_bytes.per_squared_length * shape.sum_squared_lengths > 0


def test_joint_planner_never_moves_a_run_into_or_out_of_split_placement():
    from lightning_pipe.planning import gpt_7b
    from lightning_pipe.planning.joint import JointConfig, plan_joint, plan_migration_seconds
    from lightning_pipe.planning.plan import PipelinePlan

    model = gpt_7b()
    running = PipelinePlan((0, 8, 16, 24, 32), "zb_h1", 8)
    config = JointConfig(families=("zb_h1", "helix"), microbatch_counts=(8,), microbatching=("even",))
    free = plan_joint(model, [131072] * 8, 4, None, config=config)
    assert free.plan.schedule.name == "helix"  # faster when the run could start with it ...
    held = plan_joint(model, [131072] * 8, 4, None, config=config, current=running,
                      migration=lambda plan: plan_migration_seconds(model, running, plan, 4))
    assert held.plan.schedule.name == "zb_h1"  # ... but a running zb_h1 is never moved into it
    assert plan_migration_seconds(model, free.plan, free.plan, 4) == 0.0


def test_a_split_placement_that_does_not_fit_is_not_chosen():
    from lightning_pipe.planning import gpt_7b
    from lightning_pipe.planning.joint import JointConfig, plan_joint

    model = gpt_7b()
    config = JointConfig(families=("1f1b", "helix"), microbatch_counts=(8,), microbatching=("even",))
    unlimited = plan_joint(model, [131072] * 8, 4, None, config=config)
    helix = next(c for c in unlimited.candidates if c.plan.schedule.name == "helix")
    assert unlimited.plan.schedule.name == "helix"
    budget = 0.5 * max(simulate(split_program(helix.plan.schedule, 4, 8, 32), _helix_costs(model, 131072)).peak_memory)
    limited = plan_joint(model, [131072] * 8, 4, budget, config=dataclasses.replace(config, memory_options=("full", "offload")))
    assert limited.plan.schedule.name == "1f1b" and limited.plan.memory is not None  # recomputes to fit instead
    assert all(c.step_seconds == float("inf") for c in limited.candidates if c.plan.schedule.name == "helix")


def test_auto_planner_refuses_split_placement_families_before_training():
    from lightning_pipe.callbacks import AutoPlanner

    with pytest.raises(ValueError, match="cannot switch a run into or out of split placement"):
        AutoPlanner(families=("1f1b", "helix"))


def _helix_costs(model, length):
    from lightning_pipe.planning.cost_model import MicrobatchShape
    from lightning_pipe.planning.split_costs import split_placement_costs

    schedule = resolve_schedule("helix")
    return split_placement_costs(model, schedule, split_program(schedule, 4, 8, 32), [MicrobatchShape.from_lengths([length])] * 8)


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
