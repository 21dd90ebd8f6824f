"""``PipelineProfiler``: measure what every unit really costs and fit the planners' cost model.

As a callback, before the first training batch every pipeline rank times the forward and backward
of the units it owns on a grid of microbatch shapes cut from that batch (no communication: a stage
that is not first gets zero inputs of the right shapes), global rank 0 fits per-unit linear costs
(``planning.fit``: non-negative least squares on relative residuals, error on held-out shapes),
every rank receives the fit, and the strategy's planners (``ElasticRepartition``,
``ScheduleSwitch("auto")``) use it. Saved bytes, parameter and link numbers come from the
meta-device estimate. Probing restores RNG state and buffers and changes no gradient: training is
the same as without it.

The command that profiles a whole model in one process from a LightningCLI config is
``lightning-pipe-profile`` (``lightning_pipe/profiling/cli.py``; ``python -m lightning_pipe.profiling``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L

from lightning_pipe.profiling.estimate import format_fits, probe_grid, probe_lengths, save_profile

__all__ = ["PipelineProfiler", "format_fits", "save_profile"]  # the last two live in profiling/estimate.py

log = logging.getLogger(__name__)


class PipelineProfiler(L.Callback):
    """Profile every unit before the first training batch and hand the fit to the strategy.

    Args:
        output: path of the JSON profile written by global rank 0 (None: not written).
        lengths: probe lengths (positions of the batch's token tensor); None: the first batch's
            length and 3/4, 1/2, 1/4 of it.
        num_sequences: probe samples per microbatch; None: the first microbatch's and half of it.
        repeats: timed runs per shape (the median is kept; more repeats on a busy machine).
        warmup: untimed runs per shape first.
        holdout_fraction: share of each unit's shapes held out to report the fit error.
        use: make the fit the strategy's cost model (for the planner callbacks after this one).

    Attributes:
        estimate: the fitted ``CostEstimate`` (after the first batch).
    """

    def __init__(
        self,
        output: str | Path | None = None,
        lengths: Sequence[int] | None = None,
        num_sequences: Sequence[int] | None = None,
        repeats: int = 3,
        warmup: int = 1,
        holdout_fraction: float = 0.25,
        use: bool = True,
    ) -> None:
        if repeats < 1 or warmup < 0:
            raise ValueError(f"`PipelineProfiler` needs repeats >= 1 and warmup >= 0, got {repeats} and {warmup}.")
        self.output = output
        self.lengths = None if lengths is None else [int(n) for n in lengths]
        self.num_sequences = None if num_sequences is None else [int(b) for b in num_sequences]
        self.repeats = repeats
        self.warmup = warmup
        self.holdout_fraction = holdout_fraction
        self.use = use
        self.estimate: Any = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Check that the Trainer runs the pipeline strategy."""
        if getattr(trainer.strategy, "costs", None) is None:
            raise TypeError(
                f"`PipelineProfiler` needs `strategy='elastic_pipe'` (ElasticPipelineStrategy), the Trainer runs "
                f"`{type(trainer.strategy).__name__}`. To profile without training: `lightning-pipe-profile` (`python -m lightning_pipe.profiling`)."
            )

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Profile once, on the first training batch (every rank, together)."""
        if self.estimate is not None:
            return
        strategy = trainer.strategy
        costs = strategy.costs
        lengths = costs.microbatch_lengths(batch)
        longest, size = max(n for mb in lengths for n in mb), max(len(mb) for mb in lengths)
        everyone = costs.replica_values((longest, size))  # the same grid on every replica
        longest, size = everyone[0]
        shapes = probe_grid(self.lengths or probe_lengths(longest), self.num_sequences or [size, max(1, size // 2)])
        self.estimate = costs.profile(batch, batch_idx, shapes, self.repeats, self.warmup, self.holdout_fraction)
        for line in format_fits(self.estimate).splitlines():
            log.info(line)
        if self.output is not None and trainer.global_rank == 0:
            save_profile(self.estimate, self.output)
        if self.use:
            costs.use(self.estimate)
