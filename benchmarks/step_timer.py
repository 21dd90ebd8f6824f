"""The step clock the lightning-pipe rows of the benchmarks share."""

from __future__ import annotations

import time
from collections.abc import Callable

import lightning as L
import torch.distributed as dist


class StepTimer(L.Callback):
    """Wall seconds of every training step after ``warmup``, each between barriers, so that a step
    lasts as long as its slowest rank; ``on_end(trainer, seconds)`` receives them at the end."""

    def __init__(self, warmup: int, on_end: Callable[[L.Trainer, list[float]], None]) -> None:
        self.warmup, self.on_end = warmup, on_end
        self.start, self.seconds = 0.0, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        dist.barrier()
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        dist.barrier()
        if batch_idx >= self.warmup:
            self.seconds.append(time.perf_counter() - self.start)

    def on_train_end(self, trainer, pl_module) -> None:
        self.on_end(trainer, self.seconds)
