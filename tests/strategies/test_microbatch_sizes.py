"""Uneven microbatches sized by work: exact with token-averaged losses and gradient accumulation."""

from __future__ import annotations

import json

import lightning as L
import pytest

from lightning_pipe import ElasticPipelineStrategy
from tests.helpers.callbacks import BalancedMicrobatches
from tests.helpers.loop import rank_files
from tests.helpers.models import PaddedLM, padded_batches
from tests.helpers.training import START_METHOD, assert_same_parameters, fit, reference_batches

COUNTED = [[8, 1, 1, 2, 8, 1, 3, 8], [2, 8, 8, 1, 1, 1, 8, 4]]  # very unequal tokens per sample


class RecordSplits(L.Callback):
    def __init__(self, directory) -> None:
        self.directory = directory

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        strategy = trainer.strategy
        with open(self.directory / f"rank{strategy.layout.pipeline_rank}.txt", "a") as f:
            f.write(json.dumps(strategy.split_batch(batch).plan.sizes) + "\n")


@pytest.mark.parametrize("pp", [2, 4])
def test_balanced_microbatches_parity(tmp_path, pp):
    batches = padded_batches(4, batch_size=8, length=8, counted=COUNTED)
    make = lambda: PaddedLM(layers=4).double()  # noqa: E731
    strategy = ElasticPipelineStrategy(pipeline_parallel_size=pp, num_microbatches=4, start_method=START_METHOD)
    callbacks = [BalancedMicrobatches(4), RecordSplits(tmp_path)]
    pipelined = fit(make, batches, strategy, devices=pp, steps=2, accumulate_grad_batches=2, callbacks=callbacks)
    reference = fit(make, reference_batches(batches, 1), steps=2, accumulate_grad_batches=2)
    assert_same_parameters(pipelined, reference, atol=1e-10)
    splits = [json.loads(line) for line in rank_files(tmp_path)[0].splitlines()]
    assert len(splits) == 4 and all(split != [2, 2, 2, 2] and sum(split) == 8 for split in splits)  # uneven ran


def test_plan_microbatches_with_sizes():
    import torch

    from lightning_pipe.runtime.microbatch import plan_microbatches

    batch = {"x": torch.arange(10).view(10, 1), "names": [str(i) for i in range(10)]}
    plan = plan_microbatches(batch, 3, microbatch_sizes=[5, 1, 4])
    assert plan.sample_ranges == ((0, 5), (5, 6), (6, 10)) and plan.weights == (0.5, 0.1, 0.4)
    parts = plan.split(batch)
    assert parts[1]["x"].tolist() == [[5]] and parts[2]["names"] == ["6", "7", "8", "9"]
    with pytest.raises(ValueError, match="give 3 sizes >= 1 summing to 10"):
        plan_microbatches(batch, 3, microbatch_sizes=[5, 1, 3])


def test_sizes_of_another_batch_fall_back_to_an_even_split_with_a_warning():
    import warnings

    import torch

    strategy = ElasticPipelineStrategy()
    batch = {"x": torch.zeros(8, 3)}
    assert strategy._sizes_of(batch, (5, 1, 2), warn=True) == (5, 1, 2)
    with pytest.warns(UserWarning, match=r"sizes \[5, 1, 3\] sum to 9 samples but this training batch has 8"):
        assert strategy._sizes_of(batch, (5, 1, 3), warn=True) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per pair; never for a batch the step does not run
        assert strategy._sizes_of(batch, (5, 1, 3), warn=True) is None
        assert strategy._sizes_of(batch, (4, 4, 4), warn=False) is None
