"""Sharded checkpoints (the default, ``save_distributed_checkpoint=True``): every rank writes what it owns
through torch.distributed.checkpoint, loading reshards into any layout, saves are atomic, and the
asynchronous save writes the state of its step while training goes on.

Checkpoints are written after step 2, the end of epoch 0 (see test_checkpoints.py for why), by a pp=2
run of a GPT whose head is tied to its embedding (held by both ends of the pipeline). Every resumed
run must equal the uninterrupted one-device run (float64, 1e-10). Other features (optimizer offload,
masters, GradScaler, migrations, data parallelism, SIGKILL after the save) resume from sharded
checkpoints in test_resume_features.py.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lightning_pipe.export import consolidate_checkpoint, read_checkpoint
from lightning_pipe.runtime.sharded_checkpoint import META_FILENAME
from tests.helpers.loop import ScheduledGPT, pipeline, run
from tests.helpers.training import assert_same_parameters, token_batches

from .test_checkpoints import assert_same_checkpoint

BATCHES = token_batches(2, batch_size=4, lengths=[9, 7])  # one epoch = two steps
STEP2 = "epoch=0-step=2.ckpt"
STEP4 = "epoch=1-step=4.ckpt"


def make() -> ScheduledGPT:
    return ScheduledGPT(layers=4, tie=True).double()


def every_two_steps(directory: Path) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=directory, every_n_train_steps=2, save_top_k=-1)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """One device, uninterrupted: checkpoints at steps 2 and 4, and the module after 4 steps."""
    root = tmp_path_factory.mktemp("reference")
    module, _, _ = run(make, BATCHES, max_steps=4, callbacks=[every_two_steps(root)])
    return {
        "checkpoint2": torch.load(root / STEP2, weights_only=False),
        "checkpoint4": torch.load(root / STEP4, weights_only=False),
        "module4": module,
    }


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> dict:
    """A pp=2 run (default: sharded checkpoints) that checkpoints at step 2."""
    root = tmp_path_factory.mktemp("sharded")
    module, _, _ = run(make, BATCHES, pipeline(2), devices=2, max_steps=2, callbacks=[every_two_steps(root)])
    return {"path": root / STEP2, "module2": module}


def _writers(directory: Path) -> dict[str, int]:
    """The rank whose file holds each key (DCP names files ``__<rank>_<n>.distcp``)."""
    metadata = FileSystemReader(directory).read_metadata()
    return {index.fqn: int(info.relative_path.split("_")[2]) for index, info in metadata.storage_data.items()}


@pytest.mark.timeout(120)
def test_each_rank_writes_the_entries_it_owns_once(sharded, reference):
    path = sharded["path"]
    assert path.is_dir() and (path / META_FILENAME).is_file()
    assert not any(name.endswith(".partial") for name in os.listdir(path.parent))
    meta = torch.load(path / META_FILENAME, weights_only=False)
    assert "state_dict" not in meta and "optimizer_states" not in meta  # tensors live in the shards only
    assert meta["pipeline"]["format"] == "sharded" and meta["pipeline"]["pipeline_parallel_size"] == 2
    boundaries = meta["pipeline"]["plan"]["boundaries"]
    assert boundaries == [0, 2, 4]

    def owner(name: str) -> set[int]:
        if name.startswith("blocks."):
            block = int(name.split(".")[1])
            return {0 if block < boundaries[1] else 1}
        if name in ("wte.weight", "head.weight"):  # tied: held by both ends, written by one of them
            return {0, 1}
        return {0} if name.startswith(("wte.", "wpe.")) else {1}

    writers = _writers(path)
    names = list(make().state_dict())
    assert sorted(k for k in writers if k.startswith("state_dict.")) == sorted(f"state_dict.{n}" for n in names)
    for name in names:
        assert writers[f"state_dict.{name}"] in owner(name), name
    parameters = [n for n, _ in make().named_parameters()]  # the tied parameter once, as `wte.weight`
    for name in parameters:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert writers[f"optimizer_0.state.{name}.{key}"] in owner(name), (name, key)
    assert "optimizer_0.state.head.weight.exp_avg" not in writers
    # both files hold a shard: each rank wrote its own part, not the whole model
    sizes = [os.path.getsize(path / f"__{rank}_0.distcp") for rank in (0, 1)]
    total = sum(t.numel() * t.element_size() for t in reference["checkpoint2"]["state_dict"].values())
    assert all(size < 3 * total for size in sizes) and min(sizes) > total // 4, (sizes, total)
    # consolidated, it is the checkpoint one device writes: module's key order, torch's optimizer indices
    assert_same_checkpoint(consolidate_checkpoint(path), reference["checkpoint2"])


def test_torch_dcp_to_torch_save_reads_it_into_the_plain_module(sharded, tmp_path):
    """torch's own converter needs nothing of lightning-pipe: its state dict loads into the plain module."""
    dcp_to_torch_save(sharded["path"], tmp_path / "torch.pt")
    converted = torch.load(tmp_path / "torch.pt", weights_only=False)
    plain = make()
    plain.load_state_dict(converted["state_dict"])  # strict: every key, aliases of the tied weight included
    assert_same_parameters(plain, sharded["module2"], atol=0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("pp", "options"),
    [
        (4, {"schedule": "gpipe"}),
        (2, {"schedule": "interleaved_1f1b", "partition": [1, 1, 1, 1]}),
        (2, {"partition": [1, 3], "save_distributed_checkpoint": False}),
    ],
    ids=["pp4-gpipe", "pp2-interleaved", "pp2-partition-1-3-consolidated"],
)
def test_sharded_checkpoint_resumes_exactly_in_another_layout(sharded, reference, tmp_path, pp, options):
    """Each rank reads the entries it owns in the new layout through DCP; the resumed run's own
    checkpoint at step 4 (sharded or consolidated) equals one device's. (One device: the plain Lightning
    runs of test_resume_features.py resume from the export, and torch's converter below.)"""
    resumed, _, _ = run(
        make, BATCHES, pipeline(pp, **options), devices=pp, max_steps=4, ckpt_path=str(sharded["path"]),
        callbacks=[ModelCheckpoint(tmp_path, every_n_train_steps=4)],
    )
    assert_same_parameters(resumed, reference["module4"], atol=1e-10)
    written = tmp_path / STEP4
    assert written.is_dir() == options.get("save_distributed_checkpoint", True)
    assert_same_checkpoint(read_checkpoint(written), reference["checkpoint4"])


@pytest.mark.timeout(120)
def test_asynchronous_save_writes_the_state_of_its_step_while_training_continues(reference, tmp_path):
    """With ``async_save=True`` step 3 runs while step 2's shards are written: they were copied first, so
    the checkpoint is step 2's state exactly; the run resumes from it exactly."""
    run(
        make, BATCHES, pipeline(2, async_save=True), devices=2, max_steps=4,
        callbacks=[every_two_steps(tmp_path / "async")],
    )
    assert_same_checkpoint(read_checkpoint(tmp_path / "async" / STEP2), reference["checkpoint2"])
    assert_same_checkpoint(read_checkpoint(tmp_path / "async" / STEP4), reference["checkpoint4"])
    resumed, _, _ = run(
        make, BATCHES, pipeline(2, async_save=True), devices=2, max_steps=4, ckpt_path=str(tmp_path / "async" / STEP2)
    )
    assert_same_parameters(resumed, reference["module4"], atol=1e-10)


@pytest.mark.timeout(120)
def test_save_interrupted_midway_leaves_the_previous_checkpoint(reference, tmp_path, monkeypatch):
    """Rank 1 is SIGKILLed after writing its shard of the step-4 checkpoint, before the checkpoint is
    complete: the step-4 checkpoint does not exist (only its hidden ``.partial`` directory), the step-2
    one ModelCheckpoint would have replaced is intact, and resuming from it is exact."""
    write_data = FileSystemWriter.write_data
    saves = []

    def killed_in_second_save(self, plan, planner):
        result = write_data(self, plan, planner)
        saves.append(1)  # per process: the ranks are forked from this test
        if len(saves) == 2 and torch.distributed.get_rank() == 1:
            result.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    monkeypatch.setattr(FileSystemWriter, "write_data", killed_in_second_save)
    directory = tmp_path / "killed"
    with pytest.raises(Exception, match="SIGKILL|signal 9|exit code -9"):
        run(
            make, BATCHES, pipeline(2, timeout=_seconds(20)), devices=2, max_steps=4,
            callbacks=[ModelCheckpoint(directory, every_n_train_steps=2)],  # keeps one: step 4 replaces step 2
        )
    monkeypatch.undo()
    assert sorted(os.listdir(directory)) == [f".{STEP4}.partial", STEP2]
    assert not (directory / f".{STEP4}.partial" / ".metadata").exists()
    assert_same_checkpoint(read_checkpoint(directory / STEP2), reference["checkpoint2"])
    resumed, _, _ = run(make, BATCHES, pipeline(2), devices=2, max_steps=4, ckpt_path=str(directory / STEP2))
    assert_same_parameters(resumed, reference["module4"], atol=1e-10)


def _seconds(value: float):
    from datetime import timedelta

    return timedelta(seconds=value)
