"""Callbacks propose, the strategy applies one merged plan per step: order-independent, exact."""

from __future__ import annotations

import json

import lightning as L

from lightning_pipe import ElasticPipelineStrategy
from lightning_pipe.callbacks import MemoryPlanner, ScheduleSwitch
from tests.helpers.loop import rank_files
from tests.helpers.models import TinyGPT
from tests.helpers.training import START_METHOD, assert_same_parameters, fit, reference_batches, token_batches
from tests.strategies.test_memory_plans import MICROBATCHES, _budget, _recomputed


class RecordApplications(L.Callback):
    """Every rank appends per step: the plan that ran, who won each part, how often ``apply_plan`` ran."""

    def __init__(self, directory) -> None:
        self.directory = directory
        self.applied = 0

    def setup(self, trainer, pl_module, stage) -> None:
        strategy = trainer.strategy
        apply_plan = strategy.apply_plan

        def counting(plan):
            self.applied += 1
            return apply_plan(plan)

        strategy.apply_plan = counting

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        strategy = trainer.strategy
        application = strategy.last_application
        row = {
            "plan": strategy.plan.describe(),
            "winners": application.merged.winners,
            "applied": self.applied,
        }
        self.applied = 0
        with open(self.directory / f"rank{strategy.layout.pipeline_rank}.txt", "a") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")


def test_schedule_switch_and_memory_planner_in_either_order(tmp_path):
    """The family switch no longer drops the memory plan; order of callbacks does not matter; exact."""
    batches = token_batches(2, batch_size=4, lengths=[16, 16])
    budget, none_peak = _budget(batches[0])
    assert none_peak > budget
    make = lambda: TinyGPT(layers=4).double()  # noqa: E731
    runs = {}
    for name, order in (("switch_first", 0), ("planner_first", 1)):
        callbacks = [ScheduleSwitch({0: "1f1b", 1: "gpipe"}), MemoryPlanner(budget=budget)]
        if order:
            callbacks.reverse()
        directory = tmp_path / name
        directory.mkdir()
        strategy = ElasticPipelineStrategy(
            pipeline_parallel_size=2, num_microbatches=MICROBATCHES, partition="uniform", start_method=START_METHOD
        )
        model = fit(make, batches, strategy, devices=2, steps=2, callbacks=[*callbacks, RecordApplications(directory)])
        runs[name] = (model, {rank: text.splitlines() for rank, text in rank_files(directory).items()})
    reference = fit(make, reference_batches(batches, 1), steps=2)
    assert runs["switch_first"][1] == runs["planner_first"][1]  # the same plans ran, byte for byte
    for model, _ in runs.values():
        assert_same_parameters(model, reference, atol=1e-10)
    rows = [json.loads(line) for line in runs["switch_first"][1][0]]
    assert [row["plan"]["schedule"] for row in rows] == ["1f1b", "gpipe"]
    for row in rows:
        assert _recomputed(row["plan"]["memory"]) > 0  # the planner's plan survives every family switch
        assert row["winners"] == {"memory": "MemoryPlanner", "schedule": "ScheduleSwitch"}
        assert row["applied"] <= 1  # one plan applied per step
