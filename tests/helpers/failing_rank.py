"""One rank of a pipelined run started as torchrun does (one process per rank, env variables), in which
one rank kills or freezes itself at a given step; for tests of what the other ranks do.

Run by :func:`run_failing_job` (tests/helpers/failures.py), forked from the test or as
``python -m tests.helpers.failing_rank --pp 2 --victim 1 --signal STOP --timeout 5 --directory D``
with ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set. The victim writes
``signalled.txt`` (the time) into ``--directory`` right before signalling its own process.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch

from lightning_pipe import ElasticPipelineStrategy
from tests.helpers.models import TinyGPT
from tests.helpers.training import SEED, BatchDataset, token_batches


class SignalSelf(L.Callback):
    """On global rank ``victim``, at the start of step ``step``, send ``signum`` to its own process."""

    def __init__(self, victim: int, step: int, signum: int, directory: Path) -> None:
        self.victim, self.step, self.signum, self.directory = victim, step, signum, directory

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.victim and trainer.global_step == self.step:
            (self.directory / "signalled.txt").write_text(repr(time.time()))
            os.kill(os.getpid(), self.signum)


def main(argv: list[str] | None = None) -> None:
    """Run one rank (``argv``: the command-line arguments; None: ``sys.argv``)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--pp", type=int, required=True)
    parser.add_argument("--victim", type=int, required=True)
    parser.add_argument("--signal", choices=["STOP", "KILL"], required=True)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--directory", type=Path, required=True)
    parser.add_argument("--step", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    world_size = int(os.environ["WORLD_SIZE"])
    L.seed_everything(SEED, verbose=False)
    model = TinyGPT(layers=4).double()
    strategy = ElasticPipelineStrategy(
        pipeline_parallel_size=args.pp, num_microbatches=4, timeout=timedelta(seconds=args.timeout)
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_steps=args.step + 3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[SignalSelf(args.victim, args.step, getattr(signal, f"SIG{args.signal}"), args.directory)],
    )
    batches = token_batches(8, batch_size=4, lengths=7)
    trainer.fit(model, torch.utils.data.DataLoader(BatchDataset(batches), batch_size=None))


if __name__ == "__main__":
    main()
