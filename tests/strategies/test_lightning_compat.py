"""The private Lightning names of ``strategies/_lightning_compat.py`` still behave as we rely on."""

from __future__ import annotations

import contextlib

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from lightning_pipe.strategies import _lightning_compat as compat
from tests.helpers.training import BatchDataset


class _Linear(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Stream(IterableDataset):
    """Batches of unknown length (Lightning's fetcher prefetches one batch for these)."""

    def __init__(self, batches) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


class _Peek(L.Callback):
    def __init__(self) -> None:
        self.seen = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        found, upcoming = compat.peek_next_training_batch(trainer)
        again = compat.peek_next_training_batch(trainer)  # peeking twice fetches nothing more
        assert found == again[0] and (upcoming is again[1])
        last = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        self.seen.append(
            (batch_idx, batch[0, 0].item(), found, None if upcoming is None else upcoming[0, 0].item(), last)
        )


@pytest.mark.parametrize("sized", [True, False])
def test_peek_next_training_batch_sees_the_next_batch_without_consuming_it(sized):
    batches = [torch.full((2, 3), float(i)) for i in range(5)]
    data = BatchDataset(batches) if sized else _Stream(batches)
    peek = _Peek()
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[peek],
    )
    trainer.fit(_Linear(), DataLoader(data, batch_size=None, shuffle=False))
    epoch = [(i, float(i), i < 4, float(i + 1) if i < 4 else None, i == 4) for i in range(5)]
    assert peek.seen == epoch + epoch  # every batch once, in order; the last batch is still known as last
    assert trainer.global_step == 10


def test_set_skip_backward_switches_the_fit_loop_flag():
    trainer = L.Trainer(accelerator="cpu", logger=False)
    compat.set_skip_backward(trainer, True)
    assert trainer.fit_loop._skip_backward is True
    compat.set_skip_backward(trainer, False)
    assert trainer.fit_loop._skip_backward is False


def test_rich_bar_without_epoch_limit_shows_the_epoch_alone():
    from lightning.pytorch.callbacks import RichProgressBar

    trainer = L.Trainer(accelerator="cpu", max_steps=2, callbacks=[RichProgressBar()], logger=False)
    bar = trainer.progress_bar_callback
    bar.setup(trainer, _Linear(), "fit")
    trainer.fit_loop.max_epochs = -1  # what `fit` sets when only `max_steps` is given
    if "/-2" not in bar._get_train_description(0):
        pytest.skip("this Lightning already omits the total without an epoch limit")
    compat.fix_unbounded_epoch_description(trainer)
    assert bar._get_train_description(0).strip() == "Epoch 0"
    trainer.fit_loop.max_epochs = 3
    assert bar._get_train_description(0).strip() == "Epoch 0/2"
def test_strategy_name_hint_wraps_lightnings_configuration_check():
    """The hint relies on `_AcceleratorConnector._check_config_and_set_final_flags` raising the
    "invalid strategy name" ValueError after recording the lowercased flag as `_strategy_flag`."""
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    import lightning_pipe  # noqa: F401  (installs the hint)

    compat.install_strategy_name_hint("elastic_pipe")  # idempotent
    check = _AcceleratorConnector._check_config_and_set_final_flags
    assert check._lightning_pipe_hint == "elastic_pipe"
    with pytest.raises(ValueError, match="invalid strategy name.*Did you mean") as error:
        L.Trainer(strategy="ELASTIC-PIPE", accelerator="cpu", devices=1, logger=False)
    assert "`strategy='elastic-pipe'`" in str(error.value)  # Lightning lowercased the flag first


@pytest.mark.parametrize("module, name", compat.PRIVATE_NAMES, ids=[name for _, name in compat.PRIVATE_NAMES])
def test_every_private_lightning_name_resolves(module, name):
    assert compat.private_name(module, name) is not None


def test_a_missing_private_lightning_name_says_which_file_to_update():
    with pytest.raises(ImportError, match=r"no private `lightning.fabric.utilities.distributed._gone`.*_lightning_compat.py"):
        compat.private_name("lightning.fabric.utilities.distributed", "_gone")


def test_optimizers_to_device_moves_optimizer_state():
    parameter = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([parameter], lr=0.1, momentum=0.9)
    parameter.grad = torch.ones(2)
    optimizer.step()
    compat.optimizers_to_device([optimizer], torch.device("meta"))
    assert optimizer.state[parameter]["momentum_buffer"].is_meta


def test_sync_ddp_reduces_over_a_group(tmp_path):
    """One process is a group of one: the mean and the sum are the value itself (the call path is Lightning's)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        value = torch.tensor([3.0])
        assert compat.sync_ddp(value.clone(), group=None, reduce_op="mean").item() == 3.0
        assert compat.sync_ddp(value.clone(), group=None, reduce_op="sum").item() == 3.0
    finally:
        dist.destroy_process_group()


def _log_sequence(in_place: bool) -> dict:
    """Log a mean and a sum over steps of a fresh result collection, the way the strategy replays logs."""
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

    results = _ResultCollection(training=True)
    values = [torch.tensor(v) for v in (1.5, -0.25, 4.0, 2.0)]
    for i, value in enumerate(values):
        with compat.logged_values_in_place() if in_place else contextlib.nullcontext():
            results.log("training_step", "loss", value, on_step=True, on_epoch=True, batch_size=i + 1)
            results.log("training_step", "tokens", value * 3, reduce_fx="sum", on_epoch=True, batch_size=2)
    return {name: metric.compute() for name, metric in results.items()}


def test_logged_values_in_place_keeps_lightnings_results_and_skips_the_no_op_move():
    assert _log_sequence(in_place=True) == _log_sequence(in_place=False)
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

    results = _ResultCollection(training=True)
    results.log("training_step", "loss", torch.tensor(1.0), batch_size=1)
    metric = results["training_step.loss"]
    defaults = metric._defaults
    with compat.logged_values_in_place():
        assert metric.to(torch.device("cpu")) is metric and metric._defaults is defaults  # Lightning's walk skipped
        metric.__dict__["extra"] = {"nested": [torch.zeros(1)]}  # deeper than the check looks: Lightning's own `to`
        metric.to(torch.device("cpu"))
        assert metric._defaults is not defaults  # apply_to_collection rebuilt the dict
    assert compat._ResultMetric.to.__qualname__ == "_ResultMetric.to"  # put back
