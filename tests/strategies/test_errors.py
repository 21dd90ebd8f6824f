"""Clear errors, raised before training where the module or the settings suffice, and no hangs.

Errors that need only the settings are raised by ``ElasticPipelineStrategy(...)`` or ``Trainer(...)``;
those that need only the module by ``trainer.fit`` in the main process, before any process starts
(the tests make starting one fail loudly). Errors that need a batch are raised by the first step on
the ranks that see them; a failing rank must bring the whole run down with its own message.
"""

from __future__ import annotations

import time

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies.launchers import multiprocessing as lightning_multiprocessing
from torch import nn

from lightning_pipe import ElasticPipelineStrategy
from tests.helpers.loop import pipeline, run
from tests.helpers.models import TinyGPT
from tests.helpers.training import token_batches

BATCHES = token_batches(4, batch_size=4, lengths=8)


# --- settings: raised by the constructor or by Trainer(...) -----------------------------------------


def test_unknown_schedule_lists_the_valid_names():
    with pytest.raises(ValueError, match=r"unknown schedule 'zigzag'; valid names: 1f1b, .*gpipe.*zbv"):
        ElasticPipelineStrategy(schedule="zigzag")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pipeline_parallel_size": 0}, "`pipeline_parallel_size` must be at least 1, got 0"),
        ({"num_microbatches": 0}, "`num_microbatches` must be at least 1, got 0"),
        ({"partition": "even"}, r"`partition='even'`: use 'uniform', 'balanced'.* or a list of blocks per stage"),
        ({"loss_weights": "tokens"}, r"`loss_weights='tokens'`: use 'auto', 'samples', 'sum', or a callable"),
    ],
)
def test_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ElasticPipelineStrategy(**kwargs)


def test_pipeline_size_must_divide_the_process_count():
    strategy = ElasticPipelineStrategy(pipeline_parallel_size=2, start_method="spawn")
    with pytest.raises(ValueError, match=r"`pipeline_parallel_size=2` must divide the number of processes \(3 "):
        L.Trainer(accelerator="cpu", devices=3, strategy=strategy)


def test_float16_with_a_gradient_scaler_is_refused():
    """fp16 AMP needs loss scaling inside the pipelined step and overflow decisions agreed by all stages:
    refused without optimizer offload (with it, see tests/strategies/test_fp16_offload.py)."""
    scaled = MixedPrecision("16-mixed", "cpu")  # on GPUs `precision="16-mixed"` gives this plugin
    assert scaled.scaler is not None
    with pytest.raises(ValueError, match=r"supports `precision='16-mixed'`.*only with `optimizer_offload=True`.*Use `optimizer_offload=True` or `precision='bf16-mixed'`"):
        L.Trainer(accelerator="cpu", devices=2, strategy=pipeline(2), plugins=[scaled])


# --- the module: raised by trainer.fit before any process starts ------------------------------------


class NoStack(L.LightningModule):
    """A model without a repeated block stack."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.head = nn.Linear(8, 32)

    def training_step(self, batch, batch_idx):
        logits = self.head(self.embed(batch[:, :-1]))
        return F.cross_entropy(logits.reshape(-1, 32), batch[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ManualGPT(TinyGPT):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


@pytest.fixture
def no_processes(monkeypatch):
    """Starting worker processes fails the test: the error must come from the main process."""

    def refuse(*args, **kwargs):
        raise AssertionError("worker processes were started before the configuration error was raised")

    monkeypatch.setattr(lightning_multiprocessing.mp, "start_processes", refuse)


@pytest.mark.parametrize(
    ("make", "strategy", "devices", "message"),
    [
        (NoStack, pipeline(2), 2, r"No block stack found in NoStack.*`ElasticPipelineStrategy\(blocks="),
        (TinyGPT, pipeline(2, blocks="model.layers"), 2, r"`blocks='model.layers'` names no submodule of TinyGPT"),
        (lambda: TinyGPT(layers=2), pipeline(4), 4, r"has 4 stages but `blocks` has only 2 blocks.*pipeline_parallel_size"),
        (TinyGPT, pipeline(2, partition=[1, 2]), 2, r"`partition=\[1, 2\]` must list .* 2 stages, .* summing to 4"),
        (TinyGPT, pipeline(2, partition=[4, 0]), 2, r"`partition=\[4, 0\]` must list .* each at least 1"),
        (ManualGPT, pipeline(2), 2, r"does not support manual optimization .* in `ManualGPT`"),
        (TinyGPT, pipeline(2, memory_budget="1KiB"), 2, r"`memory_budget=1 KiB` cannot fit: stage 0 .* Raise `memory_budget`"),
    ],
    ids=[
        "no-block-stack", "wrong-blocks-path", "more-stages-than-blocks", "partition-sum", "partition-empty", "manual",
        "budget-below-parameters",
    ],
)
def test_module_errors_before_processes_start(no_processes, make, strategy, devices, message):
    with pytest.raises(ValueError, match=message):
        run(make, BATCHES, strategy, devices=devices, max_steps=1)


# --- the first batch: raised by the first step; a crashing rank stops every rank --------------------


class NoLossGPT(TinyGPT):
    def training_step(self, batch, batch_idx):
        super().training_step(batch, batch_idx)  # computes and logs, but returns nothing


class CrashingGPT(TinyGPT):
    def training_step(self, batch, batch_idx):
        if batch_idx == 2 and self.global_rank == 0:
            raise RuntimeError("rank 0 gave up at step 2")
        return super().training_step(batch, batch_idx)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("make", "strategy", "message"),
    [
        (NoLossGPT, pipeline(2), r"`training_step` returned NoneType; with pipeline parallelism it must return the loss"),
        (CrashingGPT, pipeline(2), r"RuntimeError: rank 0 gave up at step 2"),
    ],
    ids=["step-returns-none", "rank-crashes-at-step-2"],
)
def test_step_errors_stop_every_rank(make, strategy, message):
    """The original message reaches the caller and no rank is left waiting for a peer that died
    (the process group timeout is 30 minutes; the run ends in seconds)."""
    start = time.monotonic()
    with pytest.raises(Exception, match=message):
        run(lambda: make().double(), BATCHES, strategy, devices=2, max_steps=4)
    assert time.monotonic() - start < 90


def test_manual_optimization_is_fine_for_evaluation():
    """Only fitting needs automatic optimization; validate/test/predict run forward-only pipelines."""
    pipeline(2).validate_module(ManualGPT(), fitting=False)
    with pytest.raises(ValueError, match="manual optimization"):
        pipeline(2).validate_module(ManualGPT(), fitting=True)
