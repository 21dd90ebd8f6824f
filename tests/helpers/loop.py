"""Helpers for tests of Lightning's loop features under the pipeline strategy.

The single-process references read the data in the order the pipelined run does: with one
data-parallel replica, the loader as it is; with several, Lightning's shuffling ``DistributedSampler``
(seeded by ``seed_everything``, re-seeded every epoch with ``set_epoch``), whose steps
:func:`replica_loader` replays for one process, so runs that span epochs or resume from a
checkpoint compare step by step.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, DistributedSampler

from lightning_pipe import ElasticPipelineStrategy
from tests.helpers.models import TinyGPT
from tests.helpers.training import SEED, START_METHOD, BatchDataset, _merge


@contextlib.contextmanager
def started_outside(rank: int, init_file: str, world_size: int = 2) -> Iterator[None]:
    """This process (forked or spawned by the test) as rank ``rank`` of processes started outside Lightning,
    as torchrun starts them: the default gloo group is made here, and every trainer call runs in place, one
    after another."""
    os.environ.update(
        LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT="0"
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


class ScheduledGPT(TinyGPT):
    """TinyGPT with AdamW and a learning rate that decays every step."""

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def pipeline(pp: int, microbatches: int = 4, schedule: str = "1f1b", **kwargs: Any) -> ElasticPipelineStrategy:
    """The strategy as the tests use it: processes started from the test."""
    return ElasticPipelineStrategy(
        pipeline_parallel_size=pp, num_microbatches=microbatches, schedule=schedule, start_method=START_METHOD, **kwargs
    )


def loader(batches: list, shuffle: bool = False) -> DataLoader:
    """A loader of whole batches, in order.

    ``shuffle`` is kept for tests written when a one-replica pipeline was given Lightning's shuffling
    sampler; it now reads the loader as it is, so the reference reads in order too (see
    :func:`replica_loader` for several replicas).
    """
    return replica_loader(batches, 1)


def replica_loader(batches: list, data_parallel: int) -> DataLoader:
    """What one process must read to match ``data_parallel`` replicas of a pipelined run, every epoch.

    One replica: the batches in order. Several: each step concatenates the replicas' batches of that
    step, in the order of the ``DistributedSampler`` Lightning gives them (re-seeded every epoch).
    """
    dataset = BatchDataset(batches)
    if data_parallel == 1:
        return DataLoader(dataset, batch_size=None)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=SEED)
    return DataLoader(dataset, batch_size=data_parallel, sampler=sampler, collate_fn=_merge)


def run(
    make_model: Callable[[], L.LightningModule],
    train: DataLoader | list | None = None,
    strategy: Any = "auto",
    devices: int = 1,
    log_dir: Path | None = None,
    method: str = "fit",
    ckpt_path: str | None = None,
    val: DataLoader | list | None = None,
    **trainer_kwargs: Any,
) -> tuple[L.LightningModule, L.Trainer, Any]:
    """Seed, build the module and a CPU Trainer, and call ``trainer.<method>``.

    Lists of batches become plain loaders (single-process references of data-parallel runs should
    pass ``replica_loader(batches, data_parallel)``). Returns the module (whole, in this process), the trainer and
    what the trainer call returned.
    """
    L.seed_everything(SEED, verbose=False)
    model = make_model()
    settings: dict[str, Any] = dict(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        logger=CSVLogger(log_dir, name="", version="") if log_dir else False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
    )
    settings.update(trainer_kwargs)
    settings["enable_checkpointing"] = any(isinstance(c, ModelCheckpoint) for c in settings.get("callbacks", []))
    trainer = L.Trainer(**settings)
    as_loader = lambda data: loader(data) if isinstance(data, list) else data  # noqa: E731
    if method == "fit":
        result = trainer.fit(model, as_loader(train), as_loader(val), ckpt_path=ckpt_path)
    else:
        result = getattr(trainer, method)(model, as_loader(val), ckpt_path=ckpt_path)
    return model, trainer, result


def rank_files(directory: Path) -> dict[int, str]:
    """Contents of ``rank<N>.txt`` files written by callbacks in every process, by rank."""
    return {
        int(name[4:-4]): (directory / name).read_text()
        for name in os.listdir(directory)
        if name.startswith("rank") and name.endswith(".txt")
    }


class Record(Callback):
    """Writes, in every process, one JSON line per validation and one at the end of training.

    Lines go to ``directory/rank<global rank>.txt``; read them back with :func:`records`.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def _write(self, trainer: L.Trainer, **entry: Any) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / f"rank{trainer.global_rank}.txt", "a") as f:
            f.write(json.dumps(entry) + "\n")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val")}
        self._write(trainer, event="validation", sanity=trainer.sanity_checking, step=trainer.global_step, **metrics)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write(trainer, event="end", step=trainer.global_step, epoch=trainer.current_epoch)


def records(directory: Path) -> dict[int, list[dict]]:
    """The lines :class:`Record` wrote, by global rank."""
    return {rank: [json.loads(line) for line in text.splitlines()] for rank, text in rank_files(directory).items()}
