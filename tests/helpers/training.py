"""Run the same module with and without the pipeline strategy, for parity tests."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Callable

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset


class BatchDataset(Dataset):
    """Each item is a whole batch (used with ``DataLoader(batch_size=None)``)."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> Any:
        return self.batches[index]


def token_batches(num: int, batch_size: int, lengths: list[int] | int, vocab: int = 32, seed: int = 0) -> list:
    """Random token batches ``[batch_size, T + 1]``; ``lengths`` gives each batch its own T."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [lengths] * num if isinstance(lengths, int) else lengths
    return [torch.randint(0, vocab, (batch_size, lengths[i] + 1), generator=generator) for i in range(num)]


SEED = 1234
# Multi-process tests start their ranks from plain pytest. "fork" skips re-importing torch and
# Lightning in every rank (about 3x faster on 2 cores); test_parity keeps one "spawn" run so the
# spawn launcher path stays covered. Tests that start ranks themselves (processes started outside
# Lightning, as torchrun starts them) pass it to ``torch.multiprocessing.start_processes`` too: what
# they test happens after the processes exist, and "spawn" only added the imports (about 6 s a test).
START_METHOD = "fork"


def replica_order(num_batches: int, data_parallel: int, seed: int = SEED, epoch: int = 0) -> list[int]:
    """The order in which ``data_parallel`` replicas of a pipelined run read a loader of ``num_batches``.

    One replica reads the user's loader as it is (the strategy keeps Lightning's sampler rule away
    from it). Several replicas get Lightning's shuffling ``DistributedSampler``, as under DDP
    (seeded by ``seed_everything``, re-seeded per epoch): replica ``r`` takes every
    ``data_parallel``-th index of the permutation, so step ``k`` reads ``order[k*dp : (k+1)*dp]``.
    """
    if data_parallel == 1:
        return list(range(num_batches))
    return torch.randperm(num_batches, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def reference_batches(batches: list, data_parallel: int, seed: int = SEED) -> list:
    """What one process must see (first epoch) to match ``data_parallel`` replicas of a pipelined run.

    With one replica, the batches in order. With several, step ``k`` of the single process gets the
    replicas' batches of step ``k`` concatenated (see :func:`replica_order`).
    """
    order = replica_order(len(batches), data_parallel, seed)
    return [_merge([batches[j] for j in order[i : i + data_parallel]]) for i in range(0, len(order), data_parallel)]


def _merge(group: list) -> Any:
    if len(group) == 1:
        return group[0]
    if isinstance(group[0], dict):
        return {k: torch.cat([b[k] for b in group]) for k in group[0]}
    if isinstance(group[0], (tuple, list)):
        return type(group[0])(torch.cat(parts) for parts in zip(*group))
    return torch.cat(group)


def fit(
    make_model: Callable[[], L.LightningModule],
    batches: list,
    strategy: Any = "auto",
    devices: int = 1,
    steps: int = 3,
    log_dir: Path | None = None,
    precision: str = "64-true",
    accelerator: str = "cpu",
    val_batches: list | None = None,
    **trainer_kwargs: Any,
) -> L.LightningModule:
    """Seed, build, and fit; returns the trained module (whole, in this process). ``val_batches``:
    a validation loader of these batches (validation runs when ``trainer_kwargs`` say)."""
    L.seed_everything(SEED, verbose=False)
    model = make_model()
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        precision=precision,
        logger=CSVLogger(log_dir, name="", version="") if log_dir else False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **{"log_every_n_steps": 1, **trainer_kwargs},
    )
    val = None if val_batches is None else DataLoader(BatchDataset(val_batches), batch_size=None)
    trainer.fit(model, DataLoader(BatchDataset(batches), batch_size=None), val)
    return model


def logged(log_dir: Path, name: str) -> list[float]:
    """Values of ``name`` in a CSVLogger's metrics.csv, in step order."""
    with open(log_dir / "metrics.csv") as f:
        return [float(row[name]) for row in csv.DictReader(f) if row.get(name)]


def assert_same_parameters(actual: torch.nn.Module, expected: torch.nn.Module, atol: float) -> None:
    """Every parameter of ``actual`` equals ``expected``'s within ``atol`` (and they did change)."""
    got, want = dict(actual.named_parameters()), dict(expected.named_parameters())
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].device.type != "meta", f"{name} was not gathered back"
        torch.testing.assert_close(got[name], want[name], atol=atol, rtol=0, msg=lambda m: f"{name}: {m}")
