"""Same loader, same data: one data-parallel replica reads the user's loader as it is; several equal DDP.

Lightning gives the training loader of a distributed strategy a shuffling ``DistributedSampler``
whatever its ``shuffle`` says; a pipeline with one replica must not, or it trains on other batches
than the one-device run it promises to equal.
"""

from __future__ import annotations

import json

import lightning as L
import pytest
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from lightning_pipe import ElasticPipelineStrategy
from tests.helpers.loop import rank_files
from tests.helpers.models import TinyGPT
from tests.helpers.training import (
    SEED,
    START_METHOD,
    BatchDataset,
    assert_same_parameters,
    fit,
    reference_batches,
    token_batches,
)

NUM_BATCHES = 4


def _batches() -> list:
    # batch i starts with token i, so a batch read names itself
    batches = token_batches(NUM_BATCHES, batch_size=2, lengths=5)
    for i, batch in enumerate(batches):
        batch[:, 0] = i
    return batches


class RecordBatches(L.Callback):
    """Every rank writes, per step, which batch (first token) it read, with its data-parallel rank."""

    def __init__(self, directory) -> None:
        self.directory = directory

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        strategy = trainer.strategy
        dp_rank = strategy.layout.data_parallel_rank if hasattr(strategy, "layout") else trainer.global_rank
        row = {"dp_rank": dp_rank, "epoch": trainer.current_epoch, "batch": int(batch[0, 0])}
        with open(self.directory / f"rank{trainer.global_rank}.txt", "a") as f:
            f.write(json.dumps(row) + "\n")


def _read(directory) -> dict[int, list[dict]]:
    return {rank: [json.loads(line) for line in text.splitlines()] for rank, text in rank_files(directory).items()}


def _train(strategy, devices: int, directory, steps: int) -> L.LightningModule:
    directory.mkdir()
    L.seed_everything(SEED, verbose=False)
    model = TinyGPT(layers=2).double()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[RecordBatches(directory)],
    )
    trainer.fit(model, DataLoader(BatchDataset(_batches()), batch_size=None, shuffle=False))
    return model


@pytest.mark.timeout(120)
def test_one_replica_reads_the_loader_as_it_is(tmp_path):
    """pp=2: both ranks read batches 0, 1, 2, 3, 0, 1 (two epochs), like one device; parameters equal."""
    strategy = ElasticPipelineStrategy(pipeline_parallel_size=2, num_microbatches=2, start_method=START_METHOD)
    pipelined = _train(strategy, 2, tmp_path / "pp", steps=6)
    seen = _read(tmp_path / "pp")
    assert sorted(seen) == [0, 1]
    for rows in seen.values():
        assert [row["batch"] for row in rows] == [0, 1, 2, 3, 0, 1]
    one_device = fit(lambda: TinyGPT(layers=2).double(), _batches() * 2, steps=6)
    assert_same_parameters(pipelined, one_device, atol=1e-10)
    # the parity tests' helper replays that order
    assert [int(b[0, 0]) for b in reference_batches(_batches(), 1)] == [0, 1, 2, 3]


@pytest.mark.timeout(120)
def test_several_replicas_read_what_ddp_reads(tmp_path):
    """pp=2 x dp=2: replica r reads, epoch after epoch, what DDP's rank r reads from the same loader."""
    strategy = ElasticPipelineStrategy(pipeline_parallel_size=2, num_microbatches=2, start_method=START_METHOD)
    _train(strategy, 4, tmp_path / "pp", steps=4)
    _train(DDPStrategy(start_method=START_METHOD), 2, tmp_path / "ddp", steps=4)
    pipelined, ddp = _read(tmp_path / "pp"), _read(tmp_path / "ddp")
    assert sorted(pipelined) == [0, 1, 2, 3] and sorted(ddp) == [0, 1]
    for rank, rows in pipelined.items():
        expected = ddp[rows[0]["dp_rank"]]
        assert [(r["epoch"], r["batch"]) for r in rows] == [(r["epoch"], r["batch"]) for r in expected]
    assert sorted(r["batch"] for rank in (0, 1) for r in ddp[rank] if r["epoch"] == 0) == [0, 1, 2, 3]
