"""Per-step metrics of the planners, logged only on the steps Lightning writes to its loggers."""

from __future__ import annotations

import lightning as L


def log_step_metrics(trainer: L.Trainer, pl_module: L.LightningModule, metrics: dict[str, float]) -> None:
    """``pl_module.log_dict(metrics)`` for this step, when a logger will receive it.

    Lightning writes on-step metrics to its loggers every ``log_every_n_steps`` only, but
    ``log_dict`` costs its validation and bookkeeping on every call: about 0.3 ms per metric on a
    CPU core, 4 ms a step for ``ElasticRepartition``'s twelve (1.5% of a 270 ms step of the variable-
    length benchmark). The planners keep every step in their ``history``, so nothing is lost.
    """
    if trainer.loggers and _logs_written_this_step(trainer):
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)


def _logs_written_this_step(trainer: L.Trainer) -> bool:
    if trainer.fast_dev_run:
        return True
    connector = getattr(trainer, "_logger_connector", None)  # Lightning's own test, private
    should_update = getattr(connector, "should_update_logs", None)
    return True if should_update is None else bool(should_update)
