"""Random joint plans every step (partition, family, microbatch sizes, memory plan) stay exact."""

from __future__ import annotations

import json

import lightning as L
import pytest

from lightning_pipe import ElasticPipelineStrategy
from tests.helpers.callbacks import RandomJointPlans
from tests.helpers.loop import rank_files
from tests.helpers.models import PaddedLM, padded_batches
from tests.helpers.training import START_METHOD, assert_same_parameters, fit, reference_batches

COUNTED = [[8, 1, 1, 2, 8, 1, 3, 8], [2, 8, 8, 1, 1, 1, 8, 4], [5, 5, 1, 8, 2, 7, 1, 1]]
FAMILIES = {2: ["1f1b", "gpipe", "zb_h1", "interleaved_1f1b", "zbv"], 4: ["1f1b", "gpipe", "interleaved_1f1b"]}


class RecordRuns(L.Callback):
    """Every rank writes the plan each step ran with and the samples of its microbatches."""

    def __init__(self, directory) -> None:
        self.directory = directory

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        strategy = trainer.strategy
        row = {"plan": strategy.plan.describe(), "sizes": strategy.split_batch(batch).plan.sizes}
        with open(self.directory / f"rank{strategy.layout.pipeline_rank}.txt", "a") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")


@pytest.mark.parametrize("pp", [2, 4])
def test_random_joint_plans_parity(tmp_path, pp):
    batches = padded_batches(6, batch_size=8, length=8, counted=COUNTED)
    make = lambda: PaddedLM(layers=8).double()  # noqa: E731
    strategy = ElasticPipelineStrategy(pipeline_parallel_size=pp, num_microbatches=4, start_method=START_METHOD)
    callbacks = [RandomJointPlans(FAMILIES[pp], seed=pp), RecordRuns(tmp_path)]
    pipelined = fit(make, batches, strategy, devices=pp, steps=3, accumulate_grad_batches=2, callbacks=callbacks)
    reference = fit(make, reference_batches(batches, 1), steps=3, accumulate_grad_batches=2)
    assert_same_parameters(pipelined, reference, atol=1e-10)
    rows = [json.loads(line) for line in rank_files(tmp_path)[0].splitlines()]
    assert len(rows) == 6
    assert len({json.dumps(r["plan"], sort_keys=True) for r in rows}) == 6  # a different joint plan every step
    assert all(r["sizes"] == r["plan"]["microbatch_sizes"] for r in rows)  # the uneven sizes ran
    assert any(len(set(r["sizes"])) > 1 for r in rows) and any(r["plan"]["memory"]["microbatches"] for r in rows)
