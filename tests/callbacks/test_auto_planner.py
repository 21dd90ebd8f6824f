"""AutoPlanner: one joint plan per batch, exact, under the budget, explained in the logs."""

from __future__ import annotations

import pytest
import torch

from lightning_pipe import ElasticPipelineStrategy
from lightning_pipe.callbacks import AutoPlanner
from tests.helpers.models import PaddedLM, padded_batches
from tests.helpers.training import START_METHOD, assert_same_parameters, fit, logged, reference_batches

COUNTED = [[8, 1, 1, 2, 8, 1, 3, 8], [2, 8, 8, 1, 1, 1, 8, 4]]


def _counted(batch):
    return (batch["labels"] != -100).sum(1).tolist()


def test_auto_planner_parity_and_logs(tmp_path):
    batches = padded_batches(4, batch_size=8, length=8, counted=COUNTED)
    make = lambda: PaddedLM(layers=4).double()  # noqa: E731
    planner = AutoPlanner(
        families=("1f1b", "gpipe", "interleaved_1f1b"), microbatch_counts=(2, 4), lengths_fn=_counted, calibrate=True
    )
    strategy = ElasticPipelineStrategy(pipeline_parallel_size=2, num_microbatches=4, start_method=START_METHOD)
    pipelined = fit(make, batches, strategy, devices=2, steps=4, callbacks=[planner], log_dir=tmp_path / "pipe")
    reference = fit(make, reference_batches(batches, 1), steps=4)
    assert_same_parameters(pipelined, reference, atol=1e-10)
    predicted = logged(tmp_path / "pipe", "auto/predicted_step_s")
    measured = logged(tmp_path / "pipe", "auto/measured_step_s")
    gaps = logged(tmp_path / "pipe", "auto/gap")
    assert len(predicted) == len(measured) == 4 and all(p > 0 for p in predicted) and all(m > 0 for m in measured)
    assert all(g == pytest.approx(0.0, abs=1e-9) for g in gaps)  # no budget: proven optimal
    assert logged(tmp_path / "pipe", "auto/looked_ahead")[1:] == [1.0, 1.0, 1.0]
    assert len(logged(tmp_path / "pipe", "auto/bought_microbatching_s")) == 4
    # calibration: batch 0 (probes, warm-up) is not measured, and batch 2 was planned while batch 1
    # ran, so batch 3 is the first priced with a measured factor: batch 1's measured over predicted
    # step (its own family's, or optimistically at most 1 for a family not measured yet)
    scales = logged(tmp_path / "pipe", "auto/scale")
    ratio = measured[1] / predicted[1]
    assert scales[:3] == [1.0, 1.0, 1.0]
    assert scales[3] == pytest.approx(ratio, rel=1e-6) or scales[3] == pytest.approx(min(1.0, ratio), rel=1e-6)


def test_calibration_prices_each_family_at_its_measured_ratio_and_explores_the_rest():
    """A family's factor is the median of its measured over predicted steps; one not measured yet
    gets the smallest of 1 and the measured factors; the family the run started with is explored
    until measured twice."""
    from collections import deque

    planner = AutoPlanner(families=("1f1b", "interleaved_1f1b", "gpipe"), calibrate=True)
    planner._baseline = "1f1b"  # what setup takes from the strategy's schedule
    assert planner._calibration() == ((), ())  # nothing measured: the model as it is
    planner.ratios["interleaved_1f1b"] = deque([1.2, 1.0, 1.1])
    planner.ratios["1f1b"] = deque([0.8])
    scale, unexplored = planner._calibration()
    assert dict(scale) == {"1f1b": 0.8, "interleaved_1f1b": pytest.approx(1.1), "gpipe": 0.8}
    assert unexplored == ("1f1b",)
    planner.ratios["1f1b"].append(0.9)
    assert planner._calibration()[1] == ()
    uncalibrated = AutoPlanner(families=("1f1b",))  # the default
    uncalibrated.ratios["1f1b"] = deque([0.8, 0.9])
    assert uncalibrated._calibration() == ((), ())
    with pytest.raises(ValueError, match="explore_within"):
        AutoPlanner(explore_within=-1)


def test_auto_planner_rejects_other_strategies():
    import lightning as L

    from tests.helpers.models import TinyGPT

    with pytest.raises(TypeError, match="needs `strategy='elastic_pipe'`"):
        trainer = L.Trainer(accelerator="cpu", devices=1, callbacks=[AutoPlanner()], max_steps=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(TinyGPT(layers=2), torch.utils.data.DataLoader([torch.randint(0, 32, (2, 5))], batch_size=None))
    with pytest.raises(ValueError, match="'even' and/or 'balanced'"):
        AutoPlanner(microbatching=("sorted",))


def test_auto_planner_under_a_binding_budget(tmp_path):
    """Long batches need recomputation: the joint plan carries a memory plan, the accounted bytes stay
    under the budget (the strategy enforces it), and the result is exact."""
    from tests.helpers.models import TinyGPT
    from tests.helpers.training import token_batches
    from tests.strategies.test_memory_plans import _budget

    batches = token_batches(2, batch_size=4, lengths=[16, 16])
    budget, none_peak = _budget(batches[0])
    assert none_peak > budget
    make = lambda: TinyGPT(layers=4).double()  # noqa: E731
    planner = AutoPlanner(budget=budget, families=("1f1b", "gpipe"), microbatch_counts=(4,))
    strategy = ElasticPipelineStrategy(pipeline_parallel_size=2, num_microbatches=4, start_method=START_METHOD)
    pipelined = fit(make, batches, strategy, devices=2, steps=2, callbacks=[planner], log_dir=tmp_path / "pipe")
    reference = fit(make, reference_batches(batches, 1), steps=2)
    assert_same_parameters(pipelined, reference, atol=1e-10)
    assert logged(tmp_path / "pipe", "auto/memory_plan") == [1.0, 1.0]
    assert all(g >= 0 for g in logged(tmp_path / "pipe", "auto/gap"))
