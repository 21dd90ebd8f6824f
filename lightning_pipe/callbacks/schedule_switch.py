"""``ScheduleSwitch``: change the pipeline's schedule family between optimizer steps."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Literal, Union

import lightning as L

from lightning_pipe.planning.plan import PipelinePlan
from lightning_pipe.schedules import Schedule, resolve_schedule

log = logging.getLogger(__name__)

Rule = Union[Mapping[int, Any], Callable[[int], Any]]


class ScheduleSwitch(L.Callback):
    """Switch the schedule family by a rule, before the batch that starts an optimizer step.

    Args:
        rule: which schedule to run from a given step (or epoch) on: a mapping
            ``{0: "1f1b", 100: "zbv"}`` (the entry with the largest key not above the current count
            applies) or a function of the count returning a schedule spec (name, DSL, ``Schedule``).
        unit: whether the rule counts optimizer steps (``"step"``) or epochs (``"epoch"``).

    A switch to a family with another number of stages per rank (``zbv``, ``interleaved_1f1b``)
    re-partitions the blocks by the strategy's ``partition`` rule and migrates units live.
    """

    def __init__(self, rule: Rule, unit: Literal["step", "epoch"] = "step") -> None:
        if unit not in ("step", "epoch"):
            raise ValueError(f"`ScheduleSwitch(unit={unit!r})`: use 'step' or 'epoch'.")
        if isinstance(rule, Mapping):
            if not rule:
                raise ValueError("`ScheduleSwitch(rule={})` names no schedule; give at least one entry like {0: '1f1b'}.")
            for spec in rule.values():
                resolve_schedule(spec)  # fail at construction, not mid-training
        elif not callable(rule):
            raise TypeError(f"`ScheduleSwitch(rule=...)` takes a mapping or a callable, got {type(rule).__name__}.")
        self.rule = rule
        self.unit = unit
        self.switches: list[tuple[int, str]] = []

    def _schedule_for(self, count: int) -> Schedule:
        if callable(self.rule):
            return resolve_schedule(self.rule(count))
        keys = [k for k in sorted(self.rule) if k <= count]
        return resolve_schedule(self.rule[keys[-1] if keys else min(self.rule)])

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        """Apply the rule's schedule if it differs from the running one (at accumulation-window starts)."""
        if batch_idx % trainer.accumulate_grad_batches:
            return
        strategy = trainer.strategy
        count = trainer.global_step if self.unit == "step" else trainer.current_epoch
        schedule = self._schedule_for(count)
        if schedule == strategy.schedule:
            return
        num_stages = strategy.pipeline_parallel_size * schedule.stages_per_rank
        boundaries = strategy.boundaries if num_stages == len(strategy.boundaries) - 1 else strategy.default_boundaries(num_stages)
        strategy.apply_plan(PipelinePlan(boundaries, schedule, strategy.num_microbatches))
        self.switches.append((count, schedule.name))
        log.info("ScheduleSwitch: %s %d -> schedule %s", self.unit, count, schedule.name)
