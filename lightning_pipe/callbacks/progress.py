"""A progress bar that shows the pipeline's state next to Lightning's usual metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar

if TYPE_CHECKING:
    from lightning_pipe.strategies import PipelineStrategy


def describe_pipeline(strategy: PipelineStrategy) -> str:
    """Short text of the running plan, e.g. ``"2 ranks, 4 stages, zbv, 8 mb"``."""
    num_stages = len(strategy.boundaries) - 1
    return f"{strategy.pipeline_parallel_size} ranks, {num_stages} stages, {strategy.schedule.name}, {strategy.num_microbatches} mb"


class PipelineProgressBar(TQDMProgressBar):
    """Lightning's TQDM progress bar with a ``pipe`` entry describing the current plan."""

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        """Lightning's metrics plus ``pipe`` (ranks, stages, schedule, microbatches)."""
        items = super().get_metrics(trainer, pl_module)
        if getattr(trainer.strategy, "boundaries", None):
            items["pipe"] = describe_pipeline(trainer.strategy)
        return items
