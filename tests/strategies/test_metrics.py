"""torchmetrics objects logged from every step kind give one device's values (pp=2, pp=2 x dp=2)."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler
from torchmetrics import MeanMetric, MetricCollection, SumMetric
from torchmetrics.classification import MulticlassAccuracy, MulticlassPrecision, MulticlassRecall

from lightning_pipe import ElasticPipelineStrategy
from lightning_pipe.callbacks import ElasticRepartition, ScheduleSwitch
from tests.helpers.models import TinyGPT
from tests.helpers.training import SEED, START_METHOD, BatchDataset, fit, logged, token_batches

CLASSES = 3


class MetricModel(L.LightningModule):
    """A classifier logging metrics the ways Lightning documents: objects, forward results, collections."""

    def __init__(self, dim: int = 8, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(4, dim)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(layers)])
        self.head = nn.Linear(dim, CLASSES)
        self.train_acc = MulticlassAccuracy(CLASSES, average="macro")
        self.train_collection = MetricCollection(
            [MulticlassPrecision(CLASSES), MulticlassRecall(CLASSES)], prefix="train_"
        )
        self.val_acc = MulticlassAccuracy(CLASSES, average="macro")
        self.val_mean = MeanMetric()
        self.val_samples = SumMetric()  # a sum: counted once per replica, not once per pipeline rank
        self.val_collection = MetricCollection([MulticlassPrecision(CLASSES), MulticlassRecall(CLASSES)], prefix="val_")
        self.test_acc = MulticlassAccuracy(CLASSES, average="macro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.train_acc(logits, y)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        self.log_dict(self.train_collection(logits, y), on_step=True, on_epoch=True)
        return F.cross_entropy(logits, y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_acc.update(logits, y)
        self.val_mean.update(F.cross_entropy(logits, y, reduction="none"))
        self.val_collection.update(logits, y)
        self.log("val_acc", self.val_acc, sync_dist=True)
        self.log("val_mean", self.val_mean)
        self.val_samples.update(torch.ones_like(y, dtype=torch.float64))
        self.log("val_samples", self.val_samples)
        self.log_dict(self.val_collection)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.test_acc(self(x), y)
        self.log("test_acc", self.test_acc, on_step=True, on_epoch=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _batches(num: int, seed: int) -> list:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(6, 4, generator=generator, dtype=torch.float64), torch.randint(0, CLASSES, (6,), generator=generator))
        for _ in range(num)
    ]


def _run(
    strategy, devices: int, log_dir: Path, train: list, val: list, shuffle_one: bool, callbacks: tuple = ()
) -> dict[str, list[float]]:
    """Fit 2 epochs with validation, then test; every logged value. ``shuffle_one``: the training
    loader shuffles itself as a one-replica ``DistributedSampler`` (the same order in both runs)."""
    L.seed_everything(SEED, verbose=False)
    model = MetricModel().double()
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_epochs=2, precision="64-true",
        logger=CSVLogger(log_dir, name="", version=""), enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, log_every_n_steps=1, callbacks=list(callbacks),
    )
    loader = lambda batches: DataLoader(BatchDataset(batches), batch_size=None)  # noqa: E731
    train_loader = loader(train)
    if shuffle_one:
        sampler = DistributedSampler(BatchDataset(train), num_replicas=1, rank=0, seed=SEED)
        train_loader = DataLoader(BatchDataset(train), batch_size=None, sampler=sampler)
    trainer.fit(model, train_loader, loader(val))
    values = _read(log_dir / "metrics.csv")
    trainer.test(model, loader(val))  # the logger writes its file anew
    return {**values, **_read(log_dir / "metrics.csv")}


def _read(path: Path) -> dict[str, list[float]]:
    with open(path) as f:
        rows = list(csv.DictReader(f))
    names = [n for n in rows[0] if n not in ("epoch", "step")]
    return {n: [float(r[n]) for r in rows if r.get(n)] for n in names}


def _pipeline(pp: int) -> ElasticPipelineStrategy:
    return ElasticPipelineStrategy(pipeline_parallel_size=pp, num_microbatches=3, start_method=START_METHOD)


@pytest.mark.parametrize("dp", [1, 2])
def test_metric_objects_match_one_device(tmp_path, dp):
    train, val = _batches(4 * dp, seed=0), _batches(2 * dp, seed=1)
    pipelined = _run(_pipeline(2), 2 * dp, tmp_path / "pipe", train, val, shuffle_one=dp == 1)
    if dp == 1:
        reference = _run("auto", 1, tmp_path / "ref", train, val, shuffle_one=True)
    else:  # the same replicas under DDP: Lightning shards both runs' loaders the same way
        reference = _run("ddp_fork", 2, tmp_path / "ref", train, val, shuffle_one=False)
    expected = {
        "train_acc_step", "train_acc_epoch", "train_MulticlassPrecision_step", "train_MulticlassRecall_epoch",
        "val_acc", "val_mean", "val_samples", "val_MulticlassPrecision", "val_MulticlassRecall", "test_acc_step", "test_acc_epoch",
    }
    assert expected <= pipelined.keys() and pipelined.keys() == reference.keys()
    for name in reference:
        assert len(pipelined[name]) == len(reference[name]) > 0, name
        torch.testing.assert_close(pipelined[name], reference[name], rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")



def test_a_metric_that_is_not_an_attribute_of_the_module_is_named():
    from lightning_pipe.model.metrics import MetricObject, MetricStates

    module = MetricModel()
    states = MetricStates(module)
    assert states.mark(module.val_acc) == MetricObject("val_acc")
    with pytest.raises(ValueError, match=r"<MulticlassAccuracy>\)`: the metric is not a submodule"):
        states.mark(MulticlassAccuracy(CLASSES))


@pytest.mark.parametrize(
    "planner", [lambda: ScheduleSwitch("auto", candidates=["1f1b", "zb_h1"]), lambda: ElasticRepartition(trigger="always")],
    ids=["schedule_switch", "repartition"],
)
def test_planners_on_a_classifier_keep_its_metrics(tmp_path, planner):
    """Planners on a model of features, not token ids, whose step updates torchmetrics (no meta kernel
    for ``bincount``): the cost probes fall back to timing the real step at the batch's own width and
    several sample counts, and no probe counts in the metrics."""
    train, val = _batches(4, seed=0), _batches(2, seed=1)
    pipelined = _run(_pipeline(2), 2, tmp_path / "pipe", train, val, shuffle_one=True, callbacks=(planner(),))
    reference = _run("auto", 1, tmp_path / "ref", train, val, shuffle_one=True)
    assert reference.keys() <= pipelined.keys()  # the planner logs its own values too
    for name in reference:
        torch.testing.assert_close(pipelined[name], reference[name], rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")


class _AccuracyGPT(TinyGPT):
    """A GPT whose step updates a torchmetrics accuracy: ``bincount`` has no meta kernel, so the
    planners' meta cost probe falls back to timing the real step on probe microbatches."""

    def __init__(self) -> None:
        super().__init__(layers=4)
        self.train_acc = MulticlassAccuracy(32, average="micro")

    def training_step(self, batch, batch_idx):
        logits = self(batch[:, :-1])
        self.train_acc(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))


def test_cost_probes_do_not_count_in_metrics(tmp_path):
    """Planners time the user's step on probe microbatches (the measured cost fallback, the split
    backward): the step's metric updates must not count them. Logged accuracies equal one device's."""
    batches = token_batches(3, batch_size=4, lengths=[12, 20, 16])
    strategy = ElasticPipelineStrategy(pipeline_parallel_size=2, num_microbatches=2, start_method=START_METHOD)
    callbacks = [ScheduleSwitch("auto", candidates=["1f1b", "zb_h1"])]
    fit(_AccuracyGPT, batches, strategy, devices=2, steps=3, log_dir=tmp_path / "pipe", callbacks=callbacks)
    fit(_AccuracyGPT, batches, steps=3, log_dir=tmp_path / "one")
    for name in ("train_acc_step", "train_acc_epoch"):
        pipelined, reference = logged(tmp_path / "pipe", name), logged(tmp_path / "one", name)
        assert len(pipelined) == len(reference) > 0
        torch.testing.assert_close(pipelined, reference, rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}: {m}")
