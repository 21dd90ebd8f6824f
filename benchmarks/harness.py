"""What the variable-length benchmarks share: the step clock of their lightning-pipe rows, and running
one configuration in fresh processes that leave one JSON file per rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from argparse import Namespace
from collections.abc import Callable, Sequence
from pathlib import Path

import lightning as L
import torch.distributed as dist


class StepTimer(L.Callback):
    """Wall seconds of every training step after ``warmup``, each between barriers, so that a step
    lasts as long as its slowest rank; ``on_end(trainer, seconds)`` receives them at the end. The
    process CPU seconds of the same steps are kept in ``cpu_seconds``: on a shared machine they vary
    far less with other tenants' load than wall time."""

    def __init__(self, warmup: int, on_end: Callable[[L.Trainer, list[float]], None]) -> None:
        self.warmup, self.on_end = warmup, on_end
        self.start = self.cpu_start = 0.0
        self.seconds: list[float] = []
        self.cpu_seconds: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        dist.barrier()
        self.start, self.cpu_start = time.perf_counter(), time.process_time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        dist.barrier()
        if batch_idx >= self.warmup:
            self.seconds.append(time.perf_counter() - self.start)
            self.cpu_seconds.append(time.process_time() - self.cpu_start)

    def on_train_end(self, trainer, pl_module) -> None:
        self.on_end(trainer, self.seconds)


def run_ranks(script: str, config: str, out: str, args: Namespace, names: Sequence[str], ranks: int = 2) -> list:
    """Run ``script --worker config`` with ``args``' ``names`` as flags in fresh processes (1 thread
    each); the JSON each rank wrote to ``out/{config}-rank{r}.json``, read and removed."""
    flags = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in names]
    command = [sys.executable, os.path.abspath(script), "--worker", config, "--out", out, *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    completed = subprocess.run(
        command, env=env, capture_output=True, text=True, cwd=Path(script).resolve().parents[1], check=False
    )
    paths = sorted(Path(out).glob(f"{config}-rank*.json"))
    results = [json.loads(p.read_text()) for p in paths]
    for path in paths:
        path.unlink()
    if completed.returncode != 0 or len(results) != ranks:
        raise SystemExit(f"{config} failed:\n{completed.stderr[-3000:]}")
    return results
