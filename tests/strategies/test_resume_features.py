"""Checkpoints are complete with every feature on, and a run killed right after writing one resumes exactly.

Each pipelined run checkpoints at step 2 (the end of epoch 0) and is then SIGKILLed on every rank
(:class:`KillAfterCheckpoint`), so nothing but the file survives. A new run resumes from it for two
more steps and must equal the uninterrupted run (float64, 1e-10): with optimizer offload (the state
lives in per-stage host optimizers; fp32 masters of 16-bit parameters; the GradScaler under 16-mixed),
with memory plans, after migrations, with data parallelism, into other pipeline sizes and into one device.
The pipelined runs write the default sharded format (a directory, every rank its own entries); the
checks read it through ``read_checkpoint`` (consolidated in the test process) and the one-device
resumes use ``lightning-pipe-export``'s consolidated file (a plain Lightning run reads only files).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, Sampler

from lightning_pipe.export import main as export_main
from lightning_pipe.export import read_checkpoint
from tests.helpers.callbacks import RandomPlans
from tests.helpers.loop import ScheduledGPT, pipeline, run
from tests.helpers.training import SEED, assert_same_parameters, token_batches

from .test_checkpoints import assert_same_checkpoint

BATCHES = token_batches(2, batch_size=4, lengths=[9, 7])  # one epoch = two steps
DP_BATCHES = token_batches(4, batch_size=4, lengths=7)  # two replicas: one epoch = two steps


class KillAfterCheckpoint(ModelCheckpoint):
    """Checkpoints every two steps; once the checkpoint of step ``kill_at`` is written (Lightning's
    ``save_checkpoint`` ends with a barrier, so every rank is past the write), every process SIGKILLs
    itself: no teardown, no flushing, only the file is left."""

    def __init__(self, dirpath: Path, kill_at: int = 2) -> None:
        super().__init__(dirpath=dirpath, every_n_train_steps=2)
        self.kill_at = kill_at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if trainer.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


def make() -> ScheduledGPT:
    return ScheduledGPT(layers=4).double()


def _only_file(directory: Path) -> str:
    files = sorted(os.listdir(directory))
    assert len(files) == 1, files
    return str(directory / files[0])


def run_killed(directory: Path, strategy, devices: int, data=BATCHES, make_model=make, callbacks=(), **kwargs) -> str:
    """Train until the step-2 checkpoint is written, SIGKILL every rank; the checkpoint's path."""
    callbacks = [*callbacks, KillAfterCheckpoint(directory)]
    with pytest.raises(Exception, match="SIGKILL|signal 9|exit code -9"):
        run(make_model, data, strategy, devices=devices, max_steps=4, callbacks=callbacks, **kwargs)
    return _only_file(directory)


def resume(path: str, strategy="auto", devices: int = 1, data=BATCHES, make_model=make, callbacks=(), **kwargs):
    """Resume from ``path`` to step 4; the module (whole, in this process) and the trainer. A plain
    one-device run resumes from the sharded directory's consolidated export (``lightning-pipe-export``)."""
    if strategy == "auto" and os.path.isdir(path):
        consolidated = f"{path}.consolidated"
        export_main([path, consolidated])
        path = consolidated
    module, trainer, _ = run(
        make_model, data, strategy, devices=devices, max_steps=4, ckpt_path=path, callbacks=list(callbacks), **kwargs
    )
    return module, trainer


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """One device, uninterrupted: the checkpoint at step 2 and the module after 4 steps."""
    root = tmp_path_factory.mktemp("reference")
    module, _, _ = run(
        make, BATCHES, max_steps=4, callbacks=[ModelCheckpoint(root, every_n_train_steps=2, save_top_k=-1)]
    )
    return {"checkpoint2": torch.load(root / "epoch=0-step=2.ckpt", weights_only=False), "module4": module}


# --- optimizer offload ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def offloaded(tmp_path_factory) -> str:
    """A pp=2 run with optimizer offload, killed after its step-2 checkpoint."""
    return run_killed(tmp_path_factory.mktemp("offload"), pipeline(2, optimizer_offload=True), devices=2)


@pytest.mark.timeout(120)
def test_checkpoint_with_optimizer_offload_holds_every_state(offloaded, reference):
    """Every parameter's Adam moments and step, read from the host optimizers, equal one device's."""
    checkpoint = read_checkpoint(offloaded)
    assert_same_checkpoint(checkpoint, reference["checkpoint2"])
    assert "master_weights" not in checkpoint["optimizer_states"][0]  # float64 masters are the parameters


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("pp", "options"),
    [(2, {"optimizer_offload": True}), (4, {"optimizer_offload": True, "schedule": "gpipe"}), (2, {}), (1, None)],
    ids=["pp2-offload", "pp4-offload", "pp2-without-offload", "one-device"],
)
def test_optimizer_offload_resumes_exactly(offloaded, reference, pp, options):
    strategy = "auto" if options is None else pipeline(pp, **options)
    resumed, _ = resume(offloaded, strategy, devices=pp)
    assert_same_parameters(resumed, reference["module4"], atol=1e-10)


@pytest.mark.timeout(120)
def test_optimizer_offload_resumes_fp32_masters_of_bf16_parameters(tmp_path):
    """``precision="bf16-true"``: host masters are float32, wider than the parameters; the checkpoint
    keeps them, so the resumed run equals the uninterrupted one bit for bit (rounded parameters would not)."""
    make_bf16 = lambda: ScheduledGPT(layers=4)  # noqa: E731
    uninterrupted, _, _ = run(
        make_bf16, BATCHES, pipeline(2, optimizer_offload=True), devices=2, max_steps=4, precision="bf16-true"
    )
    path = run_killed(tmp_path, pipeline(2, optimizer_offload=True), 2, make_model=make_bf16, precision="bf16-true")
    masters = read_checkpoint(path)["optimizer_states"][0]["master_weights"]
    assert len(masters) == len(list(make().parameters())) and all(m.dtype == torch.float32 for m in masters.values())
    resumed, _ = resume(path, pipeline(2, optimizer_offload=True), 2, make_model=make_bf16, precision="bf16-true")
    assert_same_parameters(resumed, uninterrupted, atol=0)


@pytest.mark.timeout(120)
def test_optimizer_offload_resumes_the_gradient_scaler_under_16_mixed(tmp_path):
    """``16-mixed``: the GradScaler's scale and growth tracker come back with the checkpoint."""

    def fp16():
        return MixedPrecision(
            "16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
        )

    run(
        make,
        BATCHES,
        pipeline(2, optimizer_offload=True),
        devices=2,
        max_steps=4,
        plugins=[fp16()],
        callbacks=[ModelCheckpoint(tmp_path / "whole", every_n_train_steps=4)],
    )
    uninterrupted = read_checkpoint(_only_file(tmp_path / "whole"))
    path = run_killed(tmp_path / "killed", pipeline(2, optimizer_offload=True), 2, plugins=[fp16()])
    saved_scale = read_checkpoint(path)["MixedPrecision"]["scale"]
    assert saved_scale == 2.0**12  # grew at each of the two steps
    resume(
        path,
        pipeline(2, optimizer_offload=True),
        2,
        plugins=[fp16()],
        callbacks=[ModelCheckpoint(tmp_path / "resumed", every_n_train_steps=4)],
    )
    resumed = read_checkpoint(_only_file(tmp_path / "resumed"))
    assert resumed["MixedPrecision"] == uninterrupted["MixedPrecision"]
    assert_same_checkpoint(resumed, uninterrupted, atol=0)


class TorchEncoderLM(L.LightningModule):
    """A causal language model on torch's own ``nn.TransformerEncoder`` (code nobody here wrote)."""

    def __init__(self, vocab: int = 32, dim: int = 16, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def training_step(self, batch, batch_idx):
        ids, targets = batch[:, :-1], batch[:, 1:]
        T = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(T, device=ids.device, dtype=self.head.weight.dtype)
        hidden = self.encoder(self.embed(ids), mask=mask, is_causal=True)  # [B, T, C]
        return F.cross_entropy(self.head(hidden).flatten(0, 1), targets.flatten())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


@pytest.mark.timeout(120)
def test_torch_transformer_encoder_with_optimizer_offload_resumes_exactly(tmp_path):
    make_encoder = lambda: TorchEncoderLM().double()  # noqa: E731
    uninterrupted, _, _ = run(make_encoder, BATCHES, max_steps=4)
    path = run_killed(tmp_path, pipeline(2, optimizer_offload=True), 2, make_model=make_encoder)
    assert len(read_checkpoint(path)["optimizer_states"][0]["state"]) == len(
        list(make_encoder().parameters())
    )
    resumed, _ = resume(path, pipeline(2, optimizer_offload=True), 2, make_model=make_encoder)
    assert_same_parameters(resumed, uninterrupted, atol=1e-10)
    resumed, _ = resume(path, make_model=make_encoder)
    assert_same_parameters(resumed, uninterrupted, atol=1e-10)


# --- memory plans, migrations, data parallel ------------------------------------------------------


@pytest.mark.timeout(120)
def test_memory_plan_run_resumes_exactly(tmp_path, reference):
    """Recompute and activation offload: nothing of them is state, the checkpoint is the plain one."""
    options = {"recompute": "full", "offload": True}
    path = run_killed(tmp_path, pipeline(2, **options), devices=2)
    assert_same_checkpoint(read_checkpoint(path), reference["checkpoint2"])
    resumed, _ = resume(path, pipeline(2, **options), devices=2)
    assert_same_parameters(resumed, reference["module4"], atol=1e-10)


@pytest.fixture(scope="module")
def migrated(tmp_path_factory) -> str:
    """A pp=2 run that moves units between ranks before every step, killed after its step-2 checkpoint."""
    strategy = pipeline(2, schedule="1f1b")
    return run_killed(
        tmp_path_factory.mktemp("migrated"), strategy, devices=2, callbacks=[RandomPlans(["1f1b", "interleaved_1f1b"])]
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pp", [2, 4, 1], ids=["pp2-migrating", "pp4", "one-device"])
def test_checkpoint_after_migrations_resumes_exactly(migrated, reference, pp):
    assert_same_checkpoint(read_checkpoint(migrated), reference["checkpoint2"])
    if pp == 1:
        resumed, _ = resume(migrated)
    else:
        callbacks = [RandomPlans(["1f1b", "gpipe"], seed=1)] if pp == 2 else []
        resumed, _ = resume(migrated, pipeline(pp), devices=pp, callbacks=callbacks)
    assert_same_parameters(resumed, reference["module4"], atol=1e-10)


class MergedReplicaBatches(Sampler):
    """One device's batch sampler that reads, step by step, what ``num_replicas`` data-parallel
    replicas read from ``DataLoader(samples, batch_size=batch_size)`` under Lightning's shuffling
    ``DistributedSampler`` (re-seeded per epoch), the replicas' batches concatenated."""

    def __init__(self, num_samples: int, num_replicas: int, batch_size: int, seed: int = SEED) -> None:
        self.num_samples, self.num_replicas, self.batch_size, self.seed = num_samples, num_replicas, batch_size, seed
        self.epoch = 0
        self.sampler = self  # Lightning calls `set_epoch` on `loader.sampler` and `loader.batch_sampler.sampler`

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples // self.num_replicas // self.batch_size

    def __iter__(self):
        order = torch.randperm(
            self.num_samples, generator=torch.Generator().manual_seed(self.seed + self.epoch)
        ).tolist()
        shards = [order[r :: self.num_replicas] for r in range(self.num_replicas)]
        for k in range(len(self)):
            yield [i for shard in shards for i in shard[k * self.batch_size : (k + 1) * self.batch_size]]


@pytest.mark.timeout(120)
def test_data_parallel_checkpoint_resumes_exactly(tmp_path):
    """pp=2 x dp=2, a loader of samples (``batch_size=4``): the checkpoint equals one device's (which reads
    both replicas' batches per step); it resumes into pp=2 x dp=2 and into one device, equal to the
    uninterrupted run. (With ``batch_size=None`` loaders Lightning reads the previous epoch's order after
    resuming at an epoch's end, under DDP as here: see docs/user-guide.md, Checkpoints.)"""
    samples = list(torch.cat(DP_BATCHES))  # 16 sequences; each replica reads two batches of 4 per epoch
    replicas = lambda: DataLoader(samples, batch_size=4)  # noqa: E731
    one_device = lambda: DataLoader(samples, batch_sampler=MergedReplicaBatches(len(samples), 2, 4))  # noqa: E731
    reference, _, _ = run(
        make,
        one_device(),
        max_steps=4,
        callbacks=[ModelCheckpoint(tmp_path / "ref", every_n_train_steps=2, save_top_k=-1)],
    )
    expected2 = torch.load(tmp_path / "ref" / "epoch=0-step=2.ckpt", weights_only=False)
    path = run_killed(tmp_path / "killed", pipeline(2), devices=4, data=replicas())
    assert_same_checkpoint(read_checkpoint(path), expected2)
    resumed, _ = resume(path, pipeline(2), devices=4, data=replicas())
    assert_same_parameters(resumed, reference, atol=1e-10)
    resumed, _ = resume(path, data=one_device())
    assert_same_parameters(resumed, reference, atol=1e-10)
    resumed, _ = resume(path, pipeline(4), devices=4, data=one_device())  # dp 2 -> dp 1, pp 2 -> pp 4
    assert_same_parameters(resumed, reference, atol=1e-10)
