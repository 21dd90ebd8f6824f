"""Consolidated checkpoints (``save_distributed_checkpoint=False``): one complete file that loads into any
layout, and resumes exactly. The runs resuming from it write the default sharded format, read back
through ``lightning_pipe.export.read_checkpoint`` (tests/strategies/test_distributed_checkpoints.py tests
the sharded format itself).

One epoch is two steps and checkpoints are written after every second step: a checkpoint after
the last batch of epoch 0 resumes at the start of epoch 1, where the pipelined runs and the
single-process references read the same batches. (Lightning does not fast-forward
a plain loader when resuming mid-epoch, nor resume exactly from a checkpoint written at
``on_train_epoch_end``, even on one device; neither is the pipeline's business.)
"""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_pipe.export import read_checkpoint
from tests.helpers.loop import ScheduledGPT, loader, pipeline, run
from tests.helpers.training import assert_same_parameters, token_batches

BATCHES = token_batches(2, batch_size=4, lengths=[9, 7])


def make() -> ScheduledGPT:
    return ScheduledGPT(layers=4).double()


def every_two_steps(directory) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=directory, every_n_train_steps=2)


def _checkpoint(directory) -> str:
    files = sorted(os.listdir(directory))
    assert len(files) == 1, files
    return str(directory / files[0])


def assert_same_checkpoint(actual: dict, expected: dict, atol: float = 1e-10) -> None:
    """Same step, model, optimizer and scheduler state (float64 to ``atol``)."""
    assert (actual["epoch"], actual["global_step"]) == (expected["epoch"], expected["global_step"])
    assert list(actual["state_dict"]) == list(expected["state_dict"])
    for name, value in expected["state_dict"].items():
        got = actual["state_dict"][name]
        assert got.device.type == "cpu", name
        torch.testing.assert_close(got, value, atol=atol, rtol=0, msg=lambda m: f"state_dict[{name!r}]: {m}")
    assert len(actual["optimizer_states"]) == len(expected["optimizer_states"]) == 1
    got_opt, want_opt = actual["optimizer_states"][0], expected["optimizer_states"][0]
    assert got_opt["param_groups"] == want_opt["param_groups"]
    num_parameters = sum(len(group["params"]) for group in want_opt["param_groups"])  # tied weights: once
    assert sorted(got_opt["state"]) == sorted(want_opt["state"]) == list(range(num_parameters))
    for index, state in want_opt["state"].items():
        assert sorted(got_opt["state"][index]) == sorted(state) == ["exp_avg", "exp_avg_sq", "step"]
        for key, value in state.items():
            torch.testing.assert_close(
                got_opt["state"][index][key], value, atol=atol, rtol=0, msg=lambda m: f"optimizer state {index} {key}: {m}"
            )
    assert actual["lr_schedulers"] == expected["lr_schedulers"]


def _load_plain(path: str) -> ScheduledGPT:
    """``load_from_checkpoint`` into a plain float64 module on one device."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # the class builds float32 parameters; the test trains in float64
    try:
        return ScheduledGPT.load_from_checkpoint(path, map_location="cpu")
    finally:
        torch.set_default_dtype(default)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """A pp=2 run of two steps that checkpoints, and the single-process references of 2 and 4 steps."""
    root = tmp_path_factory.mktemp("checkpoints")
    pipelined, _, _ = run(
        make, BATCHES, pipeline(2, save_distributed_checkpoint=False), devices=2, max_steps=2,
        callbacks=[every_two_steps(root / "pp2")],
    )
    run(make, loader(BATCHES), max_steps=2, callbacks=[every_two_steps(root / "ref2")])
    reference, trainer, _ = run(make, loader(BATCHES), max_steps=4, callbacks=[every_two_steps(root / "ref4")])
    return {
        "path": _checkpoint(root / "pp2"),
        "pipelined": pipelined,
        "expected2": torch.load(_checkpoint(root / "ref2"), weights_only=False),
        "reference4": reference,
        "expected4": torch.load(_checkpoint(root / "ref4"), weights_only=False),
        "scheduler4": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
    }


@pytest.mark.timeout(120)
def test_checkpoint_is_one_complete_file(saved):
    assert os.path.basename(saved["path"]) == "epoch=0-step=2.ckpt"  # one file (see _checkpoint)
    checkpoint = torch.load(saved["path"], weights_only=False)
    # the module's own names, every tensor real, optimizer state for every parameter, scheduler state
    assert list(checkpoint["state_dict"]) == list(make().state_dict())
    assert_same_checkpoint(checkpoint, saved["expected2"])
    assert checkpoint["lr_schedulers"][0]["last_epoch"] == 2
    assert_same_parameters(saved["pipelined"], _load_plain(saved["path"]), atol=0)


def test_checkpoint_resumes_exactly_on_one_device(saved):
    resumed, trainer, _ = run(make, loader(BATCHES), max_steps=4, ckpt_path=saved["path"])
    assert_same_parameters(resumed, saved["reference4"], atol=1e-10)
    assert trainer.lr_scheduler_configs[0].scheduler.state_dict() == saved["scheduler4"]
    assert saved["scheduler4"]["last_epoch"] == 4


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("pp", "layout"), [(2, {"partition": [1, 3]}), (4, {"schedule": "gpipe"})], ids=["pp2-partition-1-3", "pp4"]
)
def test_checkpoint_resumes_exactly_in_another_layout(saved, tmp_path, pp, layout):
    """Resume the pp=2 file with other stage boundaries; the resumed run writes the 4-step checkpoint."""
    resumed, _, _ = run(
        make, BATCHES, pipeline(pp, **layout), devices=pp, max_steps=4, ckpt_path=saved["path"],
        callbacks=[every_two_steps(tmp_path)],
    )
    assert_same_parameters(resumed, saved["reference4"], atol=1e-10)
    assert_same_checkpoint(read_checkpoint(_checkpoint(tmp_path)), saved["expected4"])


@pytest.mark.timeout(120)
def test_module_built_empty_on_meta_resumes_exactly(saved, tmp_path):
    """`trainer.init_module(empty_init=True)` builds on the meta device (nothing allocated); setup gives
    each rank its own units and the checkpoint fills them; training continues exactly."""
    import lightning as L

    from tests.helpers.training import SEED

    L.seed_everything(SEED, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=pipeline(2), max_steps=4, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[every_two_steps(tmp_path)],
    )
    with trainer.init_module(empty_init=True):
        model = make()
    assert all(p.is_meta for p in model.parameters())
    trainer.fit(model, loader(BATCHES), ckpt_path=saved["path"])
    assert_same_checkpoint(read_checkpoint(_checkpoint(tmp_path)), saved["expected4"])
    # the main process gets the trained weights back, not its meta placeholders
    trained = model.state_dict()
    for name, expected in saved["expected4"]["state_dict"].items():
        assert not trained[name].is_meta, name
        torch.testing.assert_close(trained[name], expected, atol=1e-10, rtol=0)
