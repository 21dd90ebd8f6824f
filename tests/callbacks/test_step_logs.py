"""Planner metrics are logged only on the steps Lightning writes (one process, no pipeline)."""

from __future__ import annotations

import csv

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_pipe.callbacks._step_logs import log_step_metrics


class _Counting(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.log_dict_calls = 0

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch).pow(2).mean()
        self.log("train_loss", loss)
        return loss

    def log_dict(self, *args, **kwargs):
        self.log_dict_calls += 1
        return super().log_dict(*args, **kwargs)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Planner(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        log_step_metrics(trainer, pl_module, {"planner/step": float(batch_idx)})


@pytest.mark.parametrize("every", [1, 3])
def test_metrics_are_logged_once_per_written_step(tmp_path, every):
    steps = 7
    module = _Counting()
    trainer = L.Trainer(
        accelerator="cpu", max_steps=steps, logger=CSVLogger(tmp_path, name="", version=""), log_every_n_steps=every,
        callbacks=[_Planner()], enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(torch.randn(steps, 4, 2), batch_size=None))
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    written = [row["step"] for row in rows if row.get("train_loss")]
    planner = [row["step"] for row in rows if row.get("planner/step")]
    assert planner == written
    assert module.log_dict_calls == len(written)  # not once per step: the calls cost
    assert len(written) == len([s for s in range(steps) if (s + 1) % every == 0])  # 7, or 2 of 7


def test_nothing_is_logged_without_a_logger():
    module = _Counting()
    trainer = L.Trainer(
        accelerator="cpu", max_steps=3, logger=False, callbacks=[_Planner()], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(torch.randn(3, 4, 2), batch_size=None))
    assert module.log_dict_calls == 0
