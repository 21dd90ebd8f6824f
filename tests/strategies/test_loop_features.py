"""Lightning's loop features under the pipeline, each compared with the same module in one process.

Runs are float64 and must match to 1e-10 unless a test says otherwise. Several features share one
run to keep the number of spawned process groups small; each test's docstring lists what it checks.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_pipe.model import real_parameter_bytes
from tests.helpers.loop import Record, ScheduledGPT, loader, pipeline, rank_files, records, run, started_outside
from tests.helpers.models import MaskedModel, TinyGPT
from tests.helpers.training import START_METHOD, assert_same_parameters, logged, reference_batches, token_batches

pytestmark = pytest.mark.timeout(120)


def _close(actual, expected, atol=1e-10):
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), atol=atol, rtol=0)


# --- the training loop ------------------------------------------------------------------------------


def test_scheduler_validation_early_stopping_checkpoint_and_loggers(tmp_path):
    """LR scheduler per step, sanity validation (2 batches), ``val_check_interval``, EarlyStopping on
    ``val_loss``, ModelCheckpoint keeping the best ``val_loss``, CSV and TensorBoard loggers: the same
    values and decisions as one process, seen on every rank."""
    train = token_batches(8, batch_size=4, lengths=8)
    val = token_batches(2, batch_size=4, lengths=[7, 9], seed=1)
    make = lambda: ScheduledGPT(layers=4).double()  # noqa: E731

    def trainer_args(directory: Path) -> dict:
        return dict(
            val=val,
            max_steps=8,
            val_check_interval=2,
            num_sanity_val_steps=2,
            # no improvement can beat min_delta: stops at the second validation (step 4)
            callbacks=[
                EarlyStopping("val_loss", min_delta=10.0, patience=1),
                ModelCheckpoint(dirpath=directory / "best", monitor="val_loss", save_top_k=1),
                LearningRateMonitor(logging_interval="step"),
                Record(directory / "records"),
            ],
            logger=[CSVLogger(directory, name="", version=""), TensorBoardLogger(directory / "tb", name="", version="")],
        )

    pipelined, trainer, _ = run(make, train, pipeline(2), devices=2, **trainer_args(tmp_path / "pipe"))
    reference, ref_trainer, _ = run(make, loader(train), **trainer_args(tmp_path / "ref"))

    assert_same_parameters(pipelined, reference, atol=1e-10)
    # every rank saw the same validations (sanity check included) and stopped at the same step as one process
    expected = records(tmp_path / "ref" / "records")[0]
    assert [(r["event"], r.get("sanity"), r["step"]) for r in expected] == [
        ("validation", True, 0), ("validation", False, 2), ("validation", False, 4), ("end", None, 4)
    ]
    seen = records(tmp_path / "pipe" / "records")
    assert sorted(seen) == [0, 1]
    for rank_records in seen.values():
        assert [r.keys() for r in rank_records] == [r.keys() for r in expected]
        for got, want in zip(rank_records, expected):
            assert {k: v for k, v in got.items() if k != "val_loss"} == {k: v for k, v in want.items() if k != "val_loss"}
            if "val_loss" in want:
                _close(got["val_loss"], want["val_loss"])
    # loggers: one val_loss per validation, the learning rate per step, the train loss per step
    for name in ("val_loss", "lr-AdamW", "train_loss"):
        _close(logged(tmp_path / "pipe", name), logged(tmp_path / "ref", name))
    assert len(logged(tmp_path / "pipe", "val_loss")) == 2
    _close(logged(tmp_path / "pipe", "lr-AdamW"), [1e-2 * 0.7**k for k in range(4)], atol=1e-12)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "pipe" / "tb")).Reload()
    tb_val = [event.value for event in events.Scalars("val_loss")]
    _close(tb_val, logged(tmp_path / "ref", "val_loss"), atol=1e-6)  # TensorBoard stores float32
    # the best checkpoint is the one one process keeps (val_loss improved at step 4), as one file
    assert Path(ref_trainer.checkpoint_callback.best_model_path).name == "epoch=0-step=4.ckpt"
    assert Path(trainer.checkpoint_callback.best_model_path).name == "epoch=0-step=4.ckpt"
    assert [p.name for p in (tmp_path / "pipe" / "best").iterdir()] == ["epoch=0-step=4.ckpt"]


class SyncGPT(TinyGPT):
    """Logs the loss with ``sync_dist=True`` (and once without, to see that replicas differ)."""

    def _loss(self, batch):
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        self.log("train_loss_replica", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), sync_dist=True)


def test_sync_dist_averages_over_data_parallel_replicas(tmp_path):
    """pp=2 x dp=2: ``sync_dist=True`` values are the mean over the replicas, which is the loss of the
    replicas' batches joined (equal token counts), i.e. what one process logs and what DDP logs."""
    train = token_batches(4, batch_size=4, lengths=8)
    val = token_batches(4, batch_size=4, lengths=8, seed=1)
    make = lambda: SyncGPT(layers=4).double()  # noqa: E731
    joined_val = [torch.cat(val[i : i + 2]) for i in (0, 2)]  # replica r validates val[r], val[r + 2]

    pipelined, _, _ = run(make, train, pipeline(2), devices=4, val=val, max_steps=2, log_dir=tmp_path / "pipe")
    reference, _, _ = run(make, reference_batches(train, 2), val=joined_val, max_steps=2, log_dir=tmp_path / "ref")

    assert_same_parameters(pipelined, reference, atol=1e-10)
    assert len(logged(tmp_path / "pipe", "train_loss")) == 2 and len(logged(tmp_path / "pipe", "val_loss")) == 1
    for name in ("train_loss", "val_loss"):
        _close(logged(tmp_path / "pipe", name), logged(tmp_path / "ref", name))
    replica0 = logged(tmp_path / "pipe", "train_loss_replica")
    assert all(abs(a - b) > 1e-6 for a, b in zip(replica0, logged(tmp_path / "pipe", "train_loss")))


# --- optimization ----------------------------------------------------------------------------------


def test_global_norm_clipping_accumulation_and_tied_embeddings_pp2():
    """Clipping by the norm over all stages (tied weight counted once), accumulate_grad_batches=2, and
    tied input/output embeddings on the pipeline's two ends: parameters equal one process's."""
    batches = token_batches(4, batch_size=4, lengths=[9, 5, 13, 7])
    make = lambda: TinyGPT(layers=4, tie=True, optimizer="sgd").double()  # noqa: E731
    settings = dict(max_steps=2, accumulate_grad_batches=2, gradient_clip_val=0.05)

    pipelined, _, _ = run(make, batches, pipeline(2), devices=2, **settings)
    reference, _, _ = run(make, loader(batches), **settings)
    unclipped, _, _ = run(make, loader(batches), max_steps=2, accumulate_grad_batches=2)

    assert_same_parameters(pipelined, reference, atol=1e-10)
    assert pipelined.head.weight is pipelined.wte.weight
    assert (reference.wte.weight - unclipped.wte.weight).abs().max() > 1e-4  # clipping did act


class MemoryProbe(Callback):
    """Writes the bytes of real parameters (all, and of the blocks) and of optimizer state per rank."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_start(self, trainer, pl_module):
        self.parameters = {
            "parameters": real_parameter_bytes(pl_module),
            "block_parameters": real_parameter_bytes(pl_module.blocks),
        }

    def on_train_end(self, trainer, pl_module):
        state = trainer.optimizers[0].state.values()
        optimizer_bytes = sum(t.numel() * t.element_size() for s in state for t in s.values() if torch.is_tensor(t))
        (self.directory / f"rank{trainer.global_rank}.txt").write_text(
            json.dumps({**self.parameters, "optimizer_state": optimizer_bytes})
        )


def test_value_clipping_tied_embeddings_and_memory_per_rank_pp4(tmp_path):
    """pp=4: value clipping and tied embeddings match one process; every rank holds a quarter of the
    block parameters (and SGD momentum only for what it holds)."""
    batches = token_batches(2, batch_size=4, lengths=[9, 7])
    make = lambda: TinyGPT(layers=4, tie=True, optimizer="sgd").double()  # noqa: E731
    settings = dict(max_steps=2, gradient_clip_val=2e-3, gradient_clip_algorithm="value")

    pipelined, _, _ = run(make, batches, pipeline(4, schedule="gpipe"), devices=4, callbacks=[MemoryProbe(tmp_path)], **settings)
    reference, _, _ = run(make, loader(batches), **settings)
    unclipped, _, _ = run(make, loader(batches), max_steps=2)

    assert_same_parameters(pipelined, reference, atol=1e-10)
    assert (reference.wte.weight - unclipped.wte.weight).abs().max() > 1e-4

    whole = make()
    blocks = real_parameter_bytes(whole.blocks)
    embeddings = real_parameter_bytes(whole.wte) + real_parameter_bytes(whole.wpe)
    per_rank = {rank: json.loads(text) for rank, text in rank_files(tmp_path).items()}
    assert sorted(per_rank) == [0, 1, 2, 3]
    for rank, held in per_rank.items():
        assert held["block_parameters"] == blocks // 4, (rank, held)
        assert held["parameters"] <= blocks // 4 + embeddings, (rank, held)
        assert held["optimizer_state"] == held["parameters"], (rank, held)  # momentum buffers, owned only
    assert sum(held["parameters"] for held in per_rank.values()) < 1.5 * real_parameter_bytes(whole)


# --- precision ---------------------------------------------------------------------------------------


def test_32_true_parity_with_fast_dev_run():
    """float32 parameters, ``precision="32-true"``, ``fast_dev_run=2`` (two training and two validation
    batches): parity to 1e-5 (float32 sums in another order). SGD, because Adam would turn float32
    rounding noise in gradients that are zero in exact arithmetic (the key bias) into full-size steps."""
    train = token_batches(2, batch_size=4, lengths=[9, 7])
    val = token_batches(2, batch_size=4, lengths=[7, 9], seed=1)
    make = lambda: TinyGPT(layers=4, optimizer="sgd")  # noqa: E731
    settings = dict(val=val, precision="32-true", fast_dev_run=2)

    pipelined, trainer, _ = run(make, train, pipeline(2), devices=2, **settings)
    reference, ref_trainer, _ = run(make, loader(train), **settings)

    assert pipelined.wte.weight.dtype == torch.float32
    assert_same_parameters(pipelined, reference, atol=1e-5)
    assert not torch.equal(reference.wte.weight, make().wte.weight)
    for name in ("train_loss", "val_loss"):  # sent back from rank 0
        _close(float(trainer.callback_metrics[name]), float(ref_trainer.callback_metrics[name]), atol=1e-5)


def test_bf16_mixed_trains(tmp_path):
    """``precision="bf16-mixed"`` (CPU autocast) runs and the loss falls. The blocks hand on a tensor
    that autocast makes bfloat16 (the meta device, which predicts what a stage receives, knows no
    autocast). No parity is expected: bf16 rounding depends on the split into microbatches."""
    generator = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(0, 32, (8, 12), generator=generator),
        "labels": torch.randint(0, 32, (8, 12), generator=generator),
        "scale": torch.ones(8),
    }
    make = lambda: MaskedModel(layers=4, lr=3e-2)  # noqa: E731

    pipelined, _, _ = run(make, [batch] * 8, pipeline(2), devices=2, precision="bf16-mixed", max_steps=8, log_dir=tmp_path)

    losses = logged(tmp_path, "train_loss")
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.8 * losses[0], losses
    assert pipelined.embed.weight.dtype == torch.float32 and torch.isfinite(pipelined.embed.weight).all()


# --- evaluation: forward-only pipelines ------------------------------------------------------------


class EvalGPT(TinyGPT):
    """TinyGPT with a test step and a predict step returning the logits."""

    def test_step(self, batch, batch_idx):
        logits = self(batch[:, :-1])
        self.log("test_loss", F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1)))
        self.log("test_tokens", float(batch[:, 1:].numel()), reduce_fx="sum")

    def predict_step(self, batch, batch_idx):
        return self(batch[:, :-1])  # [B, T, vocab]


@pytest.mark.parametrize("method", ["validate", "test"])
def test_validate_and_test(method):
    """``trainer.validate``/``trainer.test`` return what one process returns (5 samples in 4 microbatches)."""
    batches = token_batches(3, batch_size=5, lengths=[6, 9, 4], seed=2)
    make = lambda: EvalGPT(layers=4).double()  # noqa: E731

    _, _, results = run(make, strategy=pipeline(2), devices=2, method=method, val=batches)
    _, _, expected = run(make, method=method, val=batches)

    assert len(results) == len(expected) == 1 and results[0].keys() == expected[0].keys()
    for name, value in expected[0].items():
        _close(results[0][name], value)
    if method == "test":
        assert results[0]["test_tokens"] == sum(b[:, 1:].numel() for b in batches)


def test_predict_returns_predictions_in_order():
    """``trainer.predict`` returns the whole dataset's predictions, batch by batch, from rank 0."""
    batches = token_batches(3, batch_size=5, lengths=[6, 9, 4], seed=2)
    make = lambda: EvalGPT(layers=4).double()  # noqa: E731

    _, _, predictions = run(make, strategy=pipeline(2), devices=2, method="predict", val=batches)
    _, _, expected = run(make, method="predict", val=batches)

    assert [p.shape for p in predictions] == [e.shape for e in expected] == [(5, t, 32) for t in (6, 9, 4)]
    for got, want in zip(predictions, expected):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0)


# --- several trainer calls in the same processes ----------------------------------------------------


def _fit_validate_test_in_place(rank: int, init_file: str, out_dir: str) -> None:
    """One rank of processes started outside Lightning (as torchrun starts them): fit (which moves a
    block to the other rank at its first batch), validate and test run in these processes, one after
    the other."""
    import copy
    import os

    import lightning as L

    from lightning_pipe import ElasticPipelineStrategy, PlanProposal
    from tests.helpers.loop import SEED

    class MoveBlock(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 0:  # balanced is (0, 2, 4): block 1 moves from rank 0 to rank 1
                trainer.strategy.propose(PlanProposal("move", boundaries=(0, 1, 4)))

    def new_trainer(**kwargs) -> L.Trainer:
        return L.Trainer(
            accelerator="cpu", devices=2, max_steps=2, logger=False, enable_checkpointing=False,
            strategy=ElasticPipelineStrategy(pipeline_parallel_size=2, num_microbatches=2),
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kwargs,
        )

    with started_outside(rank, init_file):
        L.seed_everything(SEED, verbose=False)
        model = EvalGPT(layers=4).double()
        trainer = new_trainer(callbacks=[MoveBlock()])
        batches = token_batches(2, batch_size=4, lengths=[6, 9], seed=3)
        trainer.fit(model, loader(batches))
        groups = trainer.strategy.groups
        made = (groups.pipeline, groups.outcome, trainer.strategy.sharded_checkpoints.group)
        validated = trainer.validate(model, loader(batches))
        tested = trainer.test(model, loader(batches))
        boundaries = trainer.strategy.boundaries
        groups = trainer.strategy.groups
        reused = (groups.pipeline, groups.outcome, trainer.strategy.sharded_checkpoints.group)
        trainer.save_checkpoint(os.path.join(out_dir, "after-test.ckpt"))  # the checkpoint group still works
        copied = copy.deepcopy(model)  # holds what `model` holds on this rank, and says so
        # a new Trainer (balanced partition again) on the module the first one left sharded
        revalidated = new_trainer().validate(model, loader(batches))
        retested = trainer.test(model, loader(batches))  # the first Trainer again: its plan, gathered back
        copy_validated = new_trainer().validate(copied, loader(batches))
        torch.save(
            {"same_groups": all(a is b for a, b in zip(made, reused)), "validated": validated, "tested": tested,
             "revalidated": revalidated, "retested": retested, "copy_validated": copy_validated,
             "boundaries": boundaries},
            os.path.join(out_dir, f"rank{rank}.pt"),
        )


def test_fit_validate_and_test_in_the_same_processes_share_groups_and_the_last_partition(tmp_path):
    """Processes started outside Lightning run every trainer call in place; each call sets the strategy
    up again. Its process groups are made once (gloo groups hold sockets and threads until destroyed),
    validate and test keep the partition the fit ended with (each rank holds only its blocks: the
    initial partition would leave a moved block uninitialized, a silently wrong loss), a new Trainer on
    the same module gathers each rank's blocks from where the first one left them (and the first one
    gathers them back; a deep copy of the module likewise), and every call returns what one process
    returns."""
    import torch.multiprocessing as mp

    mp.start_processes(
        _fit_validate_test_in_place, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True,
        start_method=START_METHOD,
    )
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert all(part["same_groups"] and part["boundaries"] == (0, 1, 4) for part in parts)

    batches = token_batches(2, batch_size=4, lengths=[6, 9], seed=3)
    model, trainer, _ = run(lambda: EvalGPT(layers=4).double(), batches, max_steps=2)
    expected = {"validated": trainer.validate(model, loader(batches)), "tested": trainer.test(model, loader(batches))}
    expected["revalidated"], expected["retested"] = expected["validated"], expected["tested"]
    expected["copy_validated"] = expected["validated"]
    for part in parts:
        for call in ("validated", "tested", "revalidated", "retested", "copy_validated"):
            assert part[call][0].keys() == expected[call][0].keys()
            for name, value in expected[call][0].items():
                _close(part[call][0][name], value)
    assert (tmp_path / "after-test.ckpt").exists()


def _fit_twice_in_place(rank: int, init_file: str, out_dir: str) -> None:
    """Processes started outside Lightning: a fit that moves block 1 at its first step, then the same
    Trainer fits again (two more steps, a new optimizer, as Lightning makes one per fit)."""
    import lightning as L

    from lightning_pipe import ElasticPipelineStrategy, PlanProposal
    from tests.helpers.loop import SEED

    class MoveBlock(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 0:
                trainer.strategy.propose(PlanProposal("move", boundaries=(0, 1, 4)))

    with started_outside(rank, init_file):
        L.seed_everything(SEED, verbose=False)
        model = EvalGPT(layers=4).double()
        strategy = ElasticPipelineStrategy(pipeline_parallel_size=2, num_microbatches=2)
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[MoveBlock()],
        )
        batches = token_batches(2, batch_size=4, lengths=[6, 9], seed=3)
        trainer.fit(model, loader(batches))
        trainer.fit_loop.epoch_loop.max_steps = 4
        trainer.fit(model, loader(batches))
        held = {name: p.detach().clone() for name, p in model.named_parameters() if not p.is_meta}
        record = {"params": held, "steps": trainer.global_step, "boundaries": strategy.boundaries}
        torch.save(record, Path(out_dir, f"rank{rank}.pt"))


def test_fit_again_in_the_same_processes_trains_from_where_the_first_fit_left_the_blocks(tmp_path):
    """A second ``trainer.fit`` on the same Trainer keeps the partition the first one ended with, and
    the parameters after both equal one process doing the same (float64, 1e-10)."""
    import torch.multiprocessing as mp

    mp.start_processes(
        _fit_twice_in_place, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True,
        start_method=START_METHOD,
    )
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [(part["steps"], part["boundaries"]) for part in parts] == [(4, (0, 1, 4))] * 2
    pipelined = parts[0]["params"] | parts[1]["params"]

    batches = token_batches(2, batch_size=4, lengths=[6, 9], seed=3)
    model, trainer, _ = run(lambda: EvalGPT(layers=4).double(), batches, max_steps=2)
    trainer.fit_loop.epoch_loop.max_steps = 4
    trainer.fit(model, loader(batches))
    assert trainer.global_step == 4
    expected = dict(model.named_parameters())
    assert pipelined.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(
            pipelined[name], value.detach(), atol=1e-10, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
        )
