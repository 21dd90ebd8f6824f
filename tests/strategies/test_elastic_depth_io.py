"""Elastic depth outside the training step: predictions, consolidated checkpoints and resumes under
layouts with widths (3 gloo processes: a width-2 stage next to a width-1 stage)."""

from __future__ import annotations

import dataclasses
import json

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_pipe import ElasticPipelineStrategy
from tests.helpers.callbacks import RandomLayouts
from tests.helpers.loop import rank_files, run
from tests.helpers.models import TinyGPT
from tests.helpers.training import START_METHOD, assert_same_parameters, token_batches

LAYOUTS = [(1, 2), (2, 1)]


def elastic(**options) -> ElasticPipelineStrategy:
    return ElasticPipelineStrategy(num_microbatches=4, elastic_depth=True, start_method=START_METHOD, **options)


class PredictGPT(TinyGPT):
    """TinyGPT whose predict step returns the logits ``[B, T, vocab]``."""

    def predict_step(self, batch, batch_idx):
        return self(batch[:, :-1])


class PredictOn(L.Callback):
    """Before predicting, move to ``widths`` over ``boundaries``; every rank writes the stages it ran."""

    def __init__(self, directory, widths, boundaries) -> None:
        self.directory, self.widths, self.boundaries = directory, widths, boundaries

    def on_predict_start(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        strategy.apply_plan(dataclasses.replace(strategy.plan, boundaries=self.boundaries, widths=self.widths))

    def on_predict_end(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        with open(self.directory / f"rank{strategy.global_rank}.txt", "a") as f:
            f.write(json.dumps({"widths": strategy.plan.widths, "stages": list(strategy.spans)}) + "\n")


class RecordStart(L.Callback):
    """Every rank writes the layout training starts on (after a checkpoint was restored) and each step's."""

    def __init__(self, directory) -> None:
        self.directory = directory

    def _write(self, trainer, kind) -> None:
        with open(self.directory / f"rank{trainer.global_rank}.txt", "a") as f:
            f.write(json.dumps({"kind": kind, "widths": trainer.strategy.plan.widths}) + "\n")

    def on_train_start(self, trainer, pl_module) -> None:
        self._write(trainer, "start")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._write(trainer, "step")


@pytest.mark.timeout(300)
def test_predict_under_widths(tmp_path):
    """``trainer.predict`` on layout (1, 2): the width-2 last stage splits the microbatches between its
    replicas and the predictions equal one process's, in order."""
    batches = token_batches(2, batch_size=5, lengths=[6, 9], seed=2)
    make = lambda: PredictGPT(layers=4).double()
    on = PredictOn(tmp_path, (1, 2), (0, 3, 4))
    _, _, predictions = run(make, strategy=elastic(), devices=3, method="predict", val=batches, callbacks=[on])
    _, _, expected = run(make, method="predict", val=batches)
    assert [p.shape for p in predictions] == [e.shape for e in expected] == [(5, t, 32) for t in (6, 9)]
    for got, want in zip(predictions, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
    rows = {rank: json.loads(text) for rank, text in rank_files(tmp_path).items()}
    assert [rows[r]["stages"] for r in range(3)] == [[0], [1], [1]] and rows[0]["widths"] == [1, 2]


@pytest.mark.timeout(300)
def test_consolidated_checkpoint_under_widths_loads_and_resumes(tmp_path):
    """A consolidated file saved on a layout with widths holds the whole module and optimizer: it loads
    into a plain one-process module with one device's parameters, and a resumed run continues on the
    saved layout (not the strategy's first one), exactly."""
    batches = token_batches(1, batch_size=4, lengths=[9])  # one step per epoch: resumes at an epoch's end
    make = lambda: TinyGPT(layers=4).double()
    saving = ModelCheckpoint(tmp_path / "saved", every_n_train_steps=2, save_top_k=-1)
    proposer = RandomLayouts(LAYOUTS, seed=3)  # (1, 1, 1) at setup, then both layouts
    run(make, batches, elastic(save_distributed_checkpoint=False), devices=3, max_steps=2, callbacks=[proposer, saving])
    path = tmp_path / "saved" / "epoch=1-step=2.ckpt"
    assert path.is_file(), sorted(p.name for p in (tmp_path / "saved").iterdir())
    saved = torch.load(path, weights_only=False)
    widths = tuple(saved["pipeline"]["plan"]["widths"])  # the second step's layout, in effect at save time
    assert saved["pipeline"]["format"] == "consolidated" and widths in LAYOUTS

    reference, trainer, _ = run(make, batches, max_steps=2)
    plain = make()
    plain.load_state_dict(saved["state_dict"])  # strict: every key, the module's own names
    assert_same_parameters(plain, reference, atol=1e-10)
    want = trainer.optimizers[0].state_dict()["state"]
    got = saved["optimizer_states"][0]["state"]
    assert got.keys() == want.keys()
    for index in want:
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got[index][key], want[index][key], atol=1e-10, rtol=0)

    records = tmp_path / "resumed"
    records.mkdir()
    resumed, _, _ = run(
        make, batches, elastic(), devices=3, max_steps=4, ckpt_path=str(path), callbacks=[RecordStart(records)]
    )
    full, _, _ = run(make, batches, max_steps=4)
    assert_same_parameters(resumed, full, atol=1e-10)
    for text in rank_files(records).values():
        rows = [json.loads(line) for line in text.splitlines()]
        assert [row["kind"] for row in rows] == ["start", "step", "step"]
        assert all(tuple(row["widths"]) == widths for row in rows), rows
