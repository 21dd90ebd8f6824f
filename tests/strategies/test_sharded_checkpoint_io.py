"""The sharded writer's file handling, in one process (DCP without a process group): a checkpoint appears
under its name only when complete, replaces an older one of the same name, and an asynchronous save
defers the removal of the checkpoint it replaces until it is in place."""

from __future__ import annotations

import torch

from lightning_pipe.export import consolidate_checkpoint
from lightning_pipe.runtime.sharded_checkpoint import is_sharded_checkpoint, partial_path
from lightning_pipe.strategies.distributed_checkpoint import ShardedCheckpoints


def _checkpoint(value: float) -> dict:
    return {"state_dict": {"w": torch.full((3,), value)}, "global_step": int(value)}


def test_save_replaces_a_checkpoint_of_the_same_name_and_a_stale_partial_directory(tmp_path):
    path = tmp_path / "last.ckpt"
    partial_path(path).mkdir()  # left by a save killed midway
    (partial_path(path) / "junk").write_text("half a shard")
    writer = ShardedCheckpoints()
    writer.save(_checkpoint(1.0), path)
    writer.save(_checkpoint(2.0), path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert is_sharded_checkpoint(path)
    loaded = consolidate_checkpoint(path)
    assert loaded["global_step"] == 2 and torch.equal(loaded["state_dict"]["w"], torch.full((3,), 2.0))


def test_asynchronous_save_copies_the_state_and_defers_the_removal_it_replaces(tmp_path):
    writer = ShardedCheckpoints(asynchronous=True)
    writer.save(_checkpoint(1.0), tmp_path / "a.ckpt")
    writer.wait()
    weights = torch.full((3,), 2.0)
    writer.save({"state_dict": {"w": weights}, "global_step": 2}, tmp_path / "b.ckpt")
    weights.fill_(99.0)  # training goes on: the save holds its own copy
    writer.remove(tmp_path / "a.ckpt")  # ModelCheckpoint replacing a with b
    writer.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.ckpt"]
    assert torch.equal(consolidate_checkpoint(tmp_path / "b.ckpt")["state_dict"]["w"], torch.full((3,), 2.0))


def test_async_save_needs_the_sharded_format():
    import pytest

    from lightning_pipe import ElasticPipelineStrategy

    with pytest.raises(ValueError, match=r"`async_save=True`.*needs `save_distributed_checkpoint=True`"):
        ElasticPipelineStrategy(save_distributed_checkpoint=False, async_save=True)


def test_optimizer_state_of_other_parameters_is_refused_with_the_names():
    import pytest

    from lightning_pipe.strategies.distributed_checkpoint import _indexed_optimizer_state

    saved = {"state": {}, "param_groups": [{"lr": 0.1, "params": ["a.weight", "b.weight"]}]}
    with pytest.raises(ValueError, match=r"missing from the checkpoint: \['c.weight'\], not in the module: \['b.weight'\]"):
        _indexed_optimizer_state(saved, ["a.weight", "c.weight"], "AdamW")
    loaded = _indexed_optimizer_state(saved, ["a.weight", "b.weight"], "AdamW")
    assert loaded["param_groups"] == [{"lr": 0.1, "params": [0, 1]}]
