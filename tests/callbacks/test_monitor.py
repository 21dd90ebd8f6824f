"""PipelineMonitor logs real measurements and draws the real step."""

from __future__ import annotations

import json

import lightning as L
import matplotlib.image
import pytest

from lightning_pipe import ElasticPipelineStrategy, PipelinePlan
from lightning_pipe.callbacks import PipelineMonitor
from lightning_pipe.callbacks.monitor import RankReport, measured_costs, measured_step
from lightning_pipe.schedules import ActionCosts, B, F, TimedAction, render_png, resolve_schedule, simulate
from tests.helpers.models import TinyGPT
from tests.helpers.training import START_METHOD, fit, logged, token_batches


def test_measured_bubble_counts_receive_waits_as_idle():
    reports = [
        RankReport(0, [TimedAction(0, F(0, 0), 10.0, 11.0), TimedAction(0, B(0, 0), 13.0, 14.0)], 0, 0),
        RankReport(1, [TimedAction(1, F(1, 0), 11.0, 12.0), TimedAction(1, B(1, 0), 12.0, 13.0)], 0, 0),
    ]
    events, makespan, busy = measured_step(reports)
    assert makespan == 4.0 and busy == [2.0, 2.0]
    assert min(e.start for e in events) == 0.0


def test_monitor_logs_and_draws_a_real_run(tmp_path):
    batches = token_batches(4, batch_size=4, lengths=[9, 5, 13, 7])
    strategy = ElasticPipelineStrategy(pipeline_parallel_size=2, num_microbatches=4, schedule="1f1b", start_method=START_METHOD)
    monitor = PipelineMonitor(log_every_n_steps=1, timeline_every_n_steps=2)
    fit(lambda: TinyGPT(layers=4).double(), batches, strategy, devices=2, steps=4, log_dir=tmp_path, callbacks=[monitor])

    bubbles = logged(tmp_path, "pipeline/bubble_ratio")
    assert len(bubbles) == 4 and all(0.0 <= b < 1.0 for b in bubbles)
    simulated = logged(tmp_path, "pipeline/simulated_bubble_ratio")
    # the schedule's own idle time, from this step's compute (the ranks' clocks are aligned only to
    # within a few ms, so the measured step is not compared action by action here)
    assert len(simulated) == 4 and all(0.0 < s < 1.0 for s in simulated)
    names = ("compute", "wait", "send", "between_actions", "apply", "prepare", "share_outcome", "gradient_sync", "optimizer",
             "outside_program")
    parts = {p: logged(tmp_path, f"pipeline/time/{p}_s") for p in names}
    step_s = logged(tmp_path, "pipeline/step_s")
    for k in range(4):  # the parts of the first rank's step add up to the step
        assert sum(values[k] for values in parts.values()) == pytest.approx(step_s[k], rel=1e-6)
    assert all(c > 0 for c in parts["compute"]) and all(o > 0 for o in parts["outside_program"])
    assert all(t > 0 for p in ("prepare", "share_outcome", "optimizer") for t in parts[p])
    stages = [a + b for a, b in zip(logged(tmp_path, "pipeline/stage0_compute_s"), logged(tmp_path, "pipeline/stage1_compute_s"))]
    assert all(t > 0 for t in logged(tmp_path, "pipeline/stage0_compute_s") + logged(tmp_path, "pipeline/stage1_compute_s"))
    forward, backward = logged(tmp_path, "pipeline/compute/F_s"), logged(tmp_path, "pipeline/compute/B_s")
    assert all(f > 0 and b > 0 for f, b in zip(forward, backward))
    assert [f + b for f, b in zip(forward, backward)] == pytest.approx(stages, rel=1e-9)  # the same actions, by kind
    assert all(t > 0 for t in logged(tmp_path, "pipeline/tokens_per_s"))
    assert logged(tmp_path, "pipeline/rank1_peak_memory_bytes")[0] > 0
    steps = [json.loads(line) for line in (tmp_path / "pipeline_steps.jsonl").read_text().splitlines()]
    assert [s["schedule"] for s in steps] == ["1f1b"] * 4 and steps[0]["boundaries"] == [0, 2, 4]
    pictures = sorted(p.name for p in tmp_path.glob("pipeline_timeline_step*.png"))
    assert pictures == ["pipeline_timeline_step2.png", "pipeline_timeline_step4.png"]
    assert (tmp_path / pictures[0]).stat().st_size > 10_000


@pytest.mark.parametrize(("schedule", "merge", "kinds_run"), [("zb_h1", False, "FIW"), ("zbv", True, "FBIW")])
def test_monitor_logs_what_a_split_backward_costs(tmp_path, schedule, merge, kinds_run):
    """Under zero-bubble the compute splits into F, I and W, plus B for the pairs the strategy merged into
    one backward (``merge_split_backward``), and adds up to the stages' compute."""
    batches = token_batches(2, batch_size=4, lengths=[9, 13])
    strategy = ElasticPipelineStrategy(
        pipeline_parallel_size=2, num_microbatches=4, schedule=schedule, merge_split_backward=merge,
        start_method=START_METHOD,
    )
    monitor = PipelineMonitor(log_every_n_steps=1, timeline_every_n_steps=0)
    fit(lambda: TinyGPT(layers=4).double(), batches, strategy, devices=2, steps=2, log_dir=tmp_path, callbacks=[monitor])

    kinds = {kind: logged(tmp_path, f"pipeline/compute/{kind}_s") for kind in "FBIW"}
    assert all(len(kinds[k]) == 2 and all(t > 0 for t in kinds[k]) for k in kinds_run)
    assert all(kinds[k] == [] for k in set("FBIW") - set(kinds_run))
    per_stage = [logged(tmp_path, f"pipeline/stage{s}_compute_s") for s in range(4)]  # zbv: 4 stages, zb_h1: 2
    stages = [sum(step) for step in zip(*(values for values in per_stage if values))]
    totals = [sum(kinds[k][step] for k in kinds_run) for step in range(2)]
    assert totals == pytest.approx(stages, rel=1e-9)


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1", "zbv"])
def test_measured_costs_reproduce_the_measured_step(schedule):
    """Simulating a program with the durations of one of its steps gives that step back; delays
    that are not compute (waiting, transfers) only make the measured step longer."""
    program = resolve_schedule(schedule).build(2, 4)
    uneven = ActionCosts(
        forward=((1.0, 2.0, 1.5, 1.0), (2.0, 1.0, 1.0, 3.0), (1.0, 1.0, 1.0, 1.0), (0.5, 2.0, 1.0, 1.0))[: program.num_stages],
        backward=((2.0, 4.0, 3.0, 2.0), (4.0, 2.0, 2.0, 6.0), (2.0, 2.0, 2.0, 2.0), (1.0, 4.0, 2.0, 2.0))[: program.num_stages],
    )
    measured = simulate(program, uneven)
    again = simulate(program, measured_costs(measured.events, program))
    assert again.makespan == pytest.approx(measured.makespan)
    delayed = [TimedAction(e.rank, e.action, e.start + 0.5 * e.rank, e.end + 0.5 * e.rank) for e in measured.events]
    assert simulate(program, measured_costs(delayed, program)).makespan == pytest.approx(measured.makespan)


class AlternatePartitions(L.Callback):
    """Blocks [1, 3] on even batches, [3, 1] on odd ones."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        strategy = trainer.strategy
        boundaries = (0, 1, 4) if batch_idx % 2 == 0 else (0, 3, 4)
        strategy.apply_plan(PipelinePlan(boundaries, strategy.schedule, strategy.num_microbatches))


def test_monitor_draws_partitions_simulation_and_memory_summary(tmp_path):
    batches = token_batches(4, batch_size=4, lengths=[9, 5, 13, 7])
    strategy = ElasticPipelineStrategy(
        pipeline_parallel_size=2, num_microbatches=4, recompute="full", start_method=START_METHOD
    )
    monitor = PipelineMonitor(log_every_n_steps=1, timeline_every_n_steps=4, simulated_beside=True)
    callbacks = [AlternatePartitions(), monitor]
    fit(lambda: TinyGPT(layers=4).double(), batches, strategy, devices=2, steps=4, log_dir=tmp_path, callbacks=callbacks)

    assert logged(tmp_path, "pipeline/recomputed_blocks") == [16.0] * 4  # 4 blocks x 4 microbatches
    assert logged(tmp_path, "pipeline/offloaded_blocks") == [0.0] * 4
    assert logged(tmp_path, "pipeline/boundary1") == [1.0, 3.0, 1.0, 3.0]
    partitions = matplotlib.image.imread(tmp_path / "pipeline_partitions.png")
    assert partitions.shape[1] > 500
    single = render_png(simulate(resolve_schedule("1f1b").build(2, 4), ActionCosts.uniform(2, 4)), tmp_path / "one.png")
    stacked = matplotlib.image.imread(tmp_path / "pipeline_timeline_step4.png")
    assert stacked.shape[0] == 2 * matplotlib.image.imread(single).shape[0]  # measured over simulated


def test_monitor_refuses_other_strategies():
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)
    with pytest.raises(TypeError, match="needs `strategy='elastic_pipe'`"):
        PipelineMonitor().setup(trainer, TinyGPT(), "fit")


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1", "zbv", "interleaved_1f1b"])
def test_message_latency_is_read_back_from_a_step(schedule):
    """A step whose messages took 0.25 s each is simulated back with that latency, to its makespan."""
    from lightning_pipe.callbacks.monitor import measured_latency, simulate_measured

    program = resolve_schedule(schedule).build(2, 4)
    stages = program.num_stages
    costs = ActionCosts(
        forward=tuple((1.0, 2.0, 1.5, 1.0) for _ in range(stages)),
        backward=tuple((2.0, 3.0, 2.5, 2.0) for _ in range(stages)),
        latency=0.25,
    )
    step = simulate(program, costs)
    assert measured_latency(step.events) == pytest.approx(0.25)
    assert simulate_measured(step.events, program).makespan == pytest.approx(step.makespan)
    assert measured_latency([]) == 0.0


def test_message_latency_of_a_real_step_comes_from_arrivals():
    """A real forward starts before its receive (it runs the code before its first block); the latency
    is read from when its message arrived, not from its start."""
    import dataclasses

    from lightning_pipe.callbacks.monitor import measured_latency
    from lightning_pipe.schedules.ir import ActionType

    program = resolve_schedule("1f1b").build(2, 4)
    step = simulate(program, ActionCosts.uniform(2, 4, latency=0.25))
    consumers = (ActionType.FORWARD, ActionType.BACKWARD)
    real = [
        dataclasses.replace(e, start=e.start - 0.1, arrival=e.start)
        if e.action.type in consumers and not (e.action.type is ActionType.FORWARD and e.action.stage == 0)
        and not (e.action.type is ActionType.BACKWARD and e.action.stage == 1)
        else e
        for e in step.events
    ]
    assert measured_latency(real) == pytest.approx(0.25)
    without_arrivals = [dataclasses.replace(e, arrival=None) for e in real]
    assert measured_latency(without_arrivals) == pytest.approx(0.15)  # the bound from starts alone


def test_step_breakdown_sums_to_the_step_with_work_inside_the_program():
    """A part the strategy measured between the program's actions (the outcome as a side task) is
    its own entry, taken out of the executor's time between actions, not out of what is outside."""
    from lightning_pipe.callbacks.monitor import step_breakdown
    from lightning_pipe.runtime import ActionRecord
    from lightning_pipe.schedules import Action, ActionType

    records = [
        ActionRecord(Action(0, ActionType.FORWARD, 0), 0.0, 1.0),
        ActionRecord(Action(0, ActionType.BACKWARD, 0), 1.5, 4.0, wait=1.0),  # the task ran at 1.0-1.5
    ]
    parts = {"share_outcome": 0.7}  # 0.5 of it inside the program
    plain = step_breakdown(records, 5.0, parts)
    inside = step_breakdown(records, 5.0, parts, inside=0.5)
    assert sum(plain.values()) == pytest.approx(5.0) and sum(inside.values()) == pytest.approx(5.0)
    assert inside["between_actions"] == pytest.approx(0.0) and plain["between_actions"] == pytest.approx(0.5)
    assert inside["outside_program"] == pytest.approx(0.8) and plain["outside_program"] == pytest.approx(0.3)
    assert inside["compute"] == pytest.approx(2.5) and inside["wait"] == pytest.approx(1.0)
