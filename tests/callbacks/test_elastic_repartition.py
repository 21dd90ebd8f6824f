"""ElasticRepartition, partition='auto' and ScheduleSwitch('auto'): plans change, results do not."""

from __future__ import annotations

import csv
import json

import lightning as L
import pytest
import torch

from lightning_pipe import ElasticPipelineStrategy
from lightning_pipe.callbacks import ElasticRepartition, PipelineMonitor, ScheduleSwitch
from lightning_pipe.model import analyze_units, find_blocks
from lightning_pipe.planning import CostModel, LinearCost, MicrobatchShape, UnitCost, plan_partition
from lightning_pipe.profiling.estimate import estimate_costs
from tests.helpers.callbacks import RecordPlans, RecordSplit, read_plans, read_splits
from tests.helpers.models import TinyGPT
from tests.helpers.training import (
    START_METHOD,
    assert_same_parameters,
    fit,
    logged,
    reference_batches,
    replica_order,
    token_batches,
)

VOCAB = 1024  # a head worth a few blocks on short batches and less on long ones: the best partition moves


def _alternating_batches(num: int, data_parallel: int, short: int = 6, long: int = 60) -> list:
    """Short and long steps in turn; replicas of one step get batches of one length (the reference
    run concatenates them), whatever order the distributed sampler draws."""
    order = replica_order(num, data_parallel)
    lengths = [0] * num
    for position, index in enumerate(order):
        lengths[index] = short if (position // data_parallel) % 2 == 0 else long
    return token_batches(num, batch_size=4, lengths=lengths, vocab=VOCAB)


def _attention_heavy_model(num_blocks: int = 8) -> CostModel:
    """Blocks quadratic in length, a linear head: the best 4-stage partition differs per length."""
    block = UnitCost("block", LinearCost(0, 1e-6, 1e-7), LinearCost(0, 2e-6, 2e-7), parameter_bytes=1e4)
    pre = UnitCost("pre", LinearCost(0, 1e-7, 0), LinearCost(0, 1e-7, 0))
    post = UnitCost("post", LinearCost(0, 5e-6, 0), LinearCost(0, 1e-5, 0))
    return CostModel((pre, *[block] * num_blocks, post), latency=1e-5, bandwidth=1e9)


@pytest.mark.parametrize(
    ("pp", "dp", "optimizer", "accumulate", "given_model", "schedule"),
    [
        (2, 1, "adamw", 2, False, "1f1b"),  # the meta-device cost model, migrations inside accumulation windows
        (4, 1, "sgd", 1, True, "1f1b"),  # a JSON profile, momentum buffers migrate
        (2, 2, "sgd", 2, False, "1f1b"),  # replicas agree on one partition
        (2, 1, "adamw", 1, True, "zbv"),  # 4 stages, zero-bubble pairs merged: priced as the program that runs
    ],
)
def test_elastic_repartition_every_step_keeps_parity(tmp_path, pp, dp, optimizer, accumulate, given_model, schedule):
    steps = 3
    batches = _alternating_batches(steps * accumulate * dp, dp)
    cost_model = None
    if given_model:
        cost_model = tmp_path / "profile.json"
        _attention_heavy_model().save(cost_model)
    make = lambda: TinyGPT(layers=8, vocab=VOCAB, optimizer=optimizer).double()
    strategy = ElasticPipelineStrategy(
        pipeline_parallel_size=pp, num_microbatches=4, schedule=schedule, start_method=START_METHOD
    )
    callbacks = [
        ElasticRepartition(cost_model=cost_model, trigger="always"),
        RecordPlans(str(tmp_path / "plans.jsonl")),
    ]
    pipelined = fit(
        make,
        batches,
        strategy,
        devices=pp * dp,
        steps=steps,
        accumulate_grad_batches=accumulate,
        callbacks=callbacks,
        log_dir=tmp_path,
    )
    reference = fit(make, reference_batches(batches, dp), steps=steps, accumulate_grad_batches=accumulate)
    assert_same_parameters(pipelined, reference, atol=1e-10)
    partitions = [tuple(plan["boundaries"]) for plan in read_plans(tmp_path / "plans.jsonl")]
    assert len(partitions) == steps * accumulate and len(set(partitions)) >= 2  # the partition did change
    assert all(len(p) == pp * strategy.schedule.stages_per_rank + 1 for p in partitions)
    assert max(logged(tmp_path, "elastic/migrated_bytes")) > 0
    assert max(logged(tmp_path, "elastic/looked_ahead")) == 1.0  # later batches were planned in the background
    assert all(s >= 0 for s in logged(tmp_path, "elastic/planning_s"))
    waited, planned = logged(tmp_path, "elastic/planning_waited_s"), logged(tmp_path, "elastic/planning_s")
    assert len(waited) == len(planned) and min(waited) >= 0
    assert any(w < p for w, p in zip(waited, planned))  # planned behind the previous step: less was waited for


def test_planner_metrics_are_logged_on_the_steps_lightning_writes(tmp_path):
    """``log_dict`` costs on every call, Lightning writes on-step metrics every ``log_every_n_steps``:
    the planner logs only then, on the same rows as the step's own loss."""
    steps = 5
    batches = _alternating_batches(steps, 1)
    strategy = ElasticPipelineStrategy(pipeline_parallel_size=2, num_microbatches=2, start_method=START_METHOD)
    make = lambda: TinyGPT(layers=4, vocab=VOCAB).double()
    fit(make, batches, strategy, devices=2, steps=steps, callbacks=[ElasticRepartition(trigger="always")],
        log_dir=tmp_path, log_every_n_steps=2)
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    loss_steps = [row["step"] for row in rows if row.get("train_loss")]
    planner_steps = [row["step"] for row in rows if row.get("elastic/measured_step_s")]
    assert planner_steps == loss_steps and 0 < len(planner_steps) < steps


def test_partition_auto_plans_the_longest_batch_once(tmp_path):
    lengths = [5, 9, 33, 7, 12, 6]
    batches = token_batches(len(lengths), batch_size=4, lengths=lengths, vocab=VOCAB)
    make = lambda: TinyGPT(layers=8, vocab=VOCAB).double()
    strategy = ElasticPipelineStrategy(
        pipeline_parallel_size=2, num_microbatches=4, partition="auto", start_method=START_METHOD
    )
    pipelined = fit(make, batches, strategy, devices=2, steps=3, callbacks=[RecordPlans(str(tmp_path / "plans.jsonl"))])
    reference = fit(make, reference_batches(batches, 1), steps=3)
    assert_same_parameters(pipelined, reference, atol=1e-10)

    # what the strategy must have planned: the meta-device model, the longest batch ([4, 34] ids)
    model = make()
    stack = find_blocks(model)
    estimate = estimate_costs(
        model, stack, analyze_units(model, stack), batches[2][:1], 34, 1, torch.device("cpu"), 2.0
    )
    expected = plan_partition(estimate.cost_model, [estimate.shape([34])] * 4, "1f1b", 2).boundaries
    assert [tuple(p["boundaries"]) for p in read_plans(tmp_path / "plans.jsonl")] == [expected] * 3


def test_schedule_switch_auto_moves_to_the_fastest_family(tmp_path):
    batches = token_batches(3, batch_size=8, lengths=[50, 63, 40], vocab=VOCAB)
    make = lambda: TinyGPT(layers=8, vocab=VOCAB).double()
    strategy = ElasticPipelineStrategy(
        pipeline_parallel_size=2, num_microbatches=4, schedule="gpipe", start_method=START_METHOD
    )
    switch = ScheduleSwitch("auto", candidates=["gpipe", "interleaved_1f1b"])
    callbacks = [switch, RecordPlans(str(tmp_path / "plans.jsonl")), PipelineMonitor(log_every_n_steps=1)]
    pipelined = fit(make, batches, strategy, devices=2, steps=3, callbacks=callbacks, log_dir=tmp_path)
    reference = fit(make, reference_batches(batches, 1), steps=3)
    assert_same_parameters(pipelined, reference, atol=1e-10)
    schedules = [p["schedule"] for p in read_plans(tmp_path / "plans.jsonl")]
    assert schedules == ["interleaved_1f1b"] * 3  # its smaller bubble simulates faster than GPipe for every batch
    background = logged(tmp_path, "pipeline/plan_background_s")  # batches 2 and 3 were ranked ahead
    assert background[0] == 0.0 and all(b > 0 for b in background[1:])


def test_split_families_are_priced_with_the_measured_split_backward(tmp_path):
    """A planner with zero-bubble candidates measures what I and W cost on the real stages once, and
    every rank prices them alike: the first stage's I empty and its W a whole backward, the others'
    I and W together at least one backward. Training stays exact whatever it picks."""
    batches = token_batches(3, batch_size=4, lengths=[9, 30, 14], vocab=VOCAB)
    make = lambda: TinyGPT(layers=8, vocab=VOCAB).double()
    strategy = ElasticPipelineStrategy(
        pipeline_parallel_size=2, num_microbatches=4, schedule="gpipe", start_method=START_METHOD
    )
    callbacks = [ScheduleSwitch("auto", candidates=["gpipe", "zb_h1"]), RecordPlans(str(tmp_path / "plans.jsonl")),
                 RecordSplit(tmp_path)]
    pipelined = fit(make, batches, strategy, devices=2, steps=3, callbacks=callbacks)
    reference = fit(make, reference_batches(batches, 1), steps=3)
    assert_same_parameters(pipelined, reference, atol=1e-10)
    shares = read_splits(tmp_path, 2)
    assert shares[0] == shares[1] and shares[0] is not None
    input_share, weight_share, first_input, first_weight = shares[0]
    assert (first_input, first_weight) == (0.0, 1.0)
    assert input_share > 0 and weight_share > 0 and input_share + weight_share >= 1.0
    assert {p["schedule"] for p in read_plans(tmp_path / "plans.jsonl")} <= {"gpipe", "zb_h1"}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"trigger": "sometimes"}, ValueError, "use 'auto', 'always', 'never' or an int"),
        ({"trigger": 0}, ValueError, "an interval must be >= 1"),
        ({"trigger": True}, TypeError, "takes 'auto', 'always', 'never' or an int"),
        ({"cost_model": 3.0}, TypeError, "takes None, a CostModel or a profile path"),
        ({"recent_steps": -1}, ValueError, "must be >= 0"),
        ({"memory_limit": "lots"}, ValueError, "Cannot read the size"),
    ],
)
def test_bad_arguments_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        ElasticRepartition(**kwargs)


def test_the_trigger_settings_reach_the_planner():
    assert ElasticRepartition(trigger=5).config.interval == 5
    callback = ElasticRepartition(trigger="auto", margin=0.5, horizon_steps=4, memory_limit="1GiB")
    assert (callback.config.mode, callback.config.margin, callback.config.horizon_steps) == ("auto", 0.5, 4)
    assert callback.memory_limit == 2**30


def test_schedule_switch_auto_refuses_other_texts_and_empty_candidates():
    with pytest.raises(ValueError, match="a text rule must be 'auto'"):
        ScheduleSwitch("fastest")
    with pytest.raises(ValueError, match="nothing to choose from"):
        ScheduleSwitch("auto", candidates=())


def test_the_attention_heavy_model_moves_the_four_stage_partition():
    """The premise of the 4-stage parity case: short and long batches (ids of 7 and 61) plan differently."""
    model = _attention_heavy_model()
    plans = {plan_partition(model, [MicrobatchShape.from_lengths([n])] * 4, "1f1b", 4).boundaries for n in (7, 61)}
    assert len(plans) == 2


def test_planner_state_survives_a_checkpoint():
    """Lightning saves a callback's `state_dict`: a resumed planner sees the same recent batches and
    time scale as the uninterrupted one, so it keeps planning the same way."""
    from lightning_pipe.planning.cost_model import MicrobatchShape

    planner = ElasticRepartition(recent_steps=3)
    for lengths in ([4, 9], [16], [2, 2, 7], [5]):
        planner._recent.append((MicrobatchShape.from_lengths(lengths),))
    planner._time_scale, planner._time_scale_count, planner._migration_seconds = 1.7, 5, [0.25]
    resumed = ElasticRepartition(recent_steps=3)
    resumed.load_state_dict(planner.state_dict())
    assert list(resumed._recent) == list(planner._recent) and len(resumed._recent) == 3
    assert (resumed._time_scale, resumed._time_scale_count, resumed._migration_seconds) == (1.7, 5, [0.25])


class _HostReadGPT(TinyGPT):
    """Reads the loss on the host inside the step (``loss.item()``), as some users log it."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.print_value = loss.item()
        return loss


class _RecordEstimate(L.Callback):
    """Global rank 0 writes the source of the cost model planners used, and its blocks' saved bytes."""

    def __init__(self, path) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            estimate = trainer.strategy.costs.estimate
            blocks = estimate.cost_model.units[1:-1]
            saved = [unit.saved_bytes.evaluate(MicrobatchShape.from_lengths([16] * 2)) for unit in blocks]
            self.path.write_text(json.dumps({"source": estimate.source, "saved": saved}))


def test_a_step_the_meta_cost_probe_cannot_run_is_planned_with_measured_costs(tmp_path):
    """``loss.item()`` in the step: the planner measures the stages instead of failing; exact as before."""
    steps = 4
    batches = _alternating_batches(steps, 1)
    make = lambda: _HostReadGPT(layers=4, vocab=VOCAB).double()
    strategy = ElasticPipelineStrategy(pipeline_parallel_size=2, num_microbatches=2, start_method=START_METHOD)
    pipelined = fit(make, batches, strategy, devices=2, steps=steps,
                    callbacks=[ElasticRepartition(trigger="always"), _RecordEstimate(tmp_path / "estimate.json")])
    reference = fit(make, reference_batches(batches, 1), steps=steps)
    assert_same_parameters(pipelined, reference, atol=1e-10)
    recorded = json.loads((tmp_path / "estimate.json").read_text())
    assert recorded["source"] == "profile"  # timed and measured on the real stages
    assert all(saved > 0 for saved in recorded["saved"])  # bytes measured on both ranks' blocks


