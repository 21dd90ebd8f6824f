"""``ScheduleSwitch``: change the pipeline's schedule family between optimizer steps, by a rule or automatically."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Union

import lightning as L

from lightning_pipe.callbacks._lookahead import LookaheadJob
from lightning_pipe.planning.proposals import PlanProposal
from lightning_pipe.schedules import AutoScheduleRow, Schedule, auto_schedule, resolve_schedule

if TYPE_CHECKING:
    from lightning_pipe.strategies import PipelineStrategy

log = logging.getLogger(__name__)

Rule = Union[Mapping[int, Any], Callable[[int], Any], Literal["auto"]]
AUTO_CANDIDATES = ("gpipe", "1f1b", "zb_h1", "interleaved_1f1b", "zbv")


class ScheduleSwitch(L.Callback):
    """Switch the schedule family by a rule, before the batch that starts an optimizer step.

    Args:
        rule: which schedule to run from a given step (or epoch) on: a mapping
            ``{0: "1f1b", 100: "zbv"}`` (the entry with the largest key not above the current count
            applies), a function of the count returning a schedule spec (name, DSL, ``Schedule``), or
            ``"auto"``: before every optimizer step, simulate ``candidates`` with the batch's costs
            (``schedules.auto_schedule`` on the strategy's cost model: a ``PipelineProfiler``'s fit,
            else the meta-device estimate) and switch to the fastest that fits ``memory_limit`` when
            it beats the running family by more than ``margin``. Every rank decides the same (the
            shapes of every data-parallel replica's batch are shared; the heaviest is planned for).
        unit: whether the rule counts optimizer steps (``"step"``) or epochs (``"epoch"``); ``"auto"``
            decides per step.
        candidates: families ``"auto"`` chooses among (those needing more stages than blocks are skipped).
        margin: ``"auto"`` switches only when the best is this fraction faster than the running one.
        memory_limit: bytes per rank the simulated peak must fit (``"auto"``); None: no limit.
        lengths_fn: ``lengths_fn(batch) -> one length per sample`` (``"auto"``); default: the token
            tensor's ``[B, T]``.
        lookahead: ``"auto"`` ranks the next batch's candidates on a background thread while this
            batch trains (used when the partition and family it assumed are still the running ones).

        priority: wins the schedule part over proposals of lower priority (``planning/proposals.py``).

    The callback *proposes* the family (``strategy.propose``); the strategy merges every callback's
    proposals and applies one plan before the step, so a memory plan or partition proposed by other
    callbacks is kept (and planned for this family). A switch to a family with another number of
    stages per rank (``zbv``, ``interleaved_1f1b``) re-partitions the blocks by the strategy's
    ``partition`` rule (unless a repartitioning callback proposes boundaries with that stage count)
    and migrates units live.
    """

    def __init__(
        self,
        rule: Rule,
        unit: Literal["step", "epoch"] = "step",
        candidates: Sequence[Any] = AUTO_CANDIDATES,
        margin: float = 0.02,
        memory_limit: float | None = None,
        lengths_fn: Callable[[Any], Sequence[int]] | None = None,
        priority: int = 0,
        lookahead: bool = True,
    ) -> None:
        if unit not in ("step", "epoch"):
            raise ValueError(f"`ScheduleSwitch(unit={unit!r})`: use 'step' or 'epoch'.")
        if isinstance(rule, str):
            if rule != "auto":
                raise ValueError(f"`ScheduleSwitch(rule={rule!r})`: a text rule must be 'auto'; use a mapping for one family.")
            if not candidates:
                raise ValueError("`ScheduleSwitch('auto', candidates=())` has nothing to choose from.")
            for spec in candidates:
                resolve_schedule(spec)
        elif isinstance(rule, Mapping):
            if not rule:
                raise ValueError("`ScheduleSwitch(rule={})` names no schedule; give at least one entry like {0: '1f1b'}.")
            for spec in rule.values():
                resolve_schedule(spec)  # fail at construction, not mid-training
        elif not callable(rule):
            raise TypeError(f"`ScheduleSwitch(rule=...)` takes a mapping or a callable, got {type(rule).__name__}.")
        self.rule = rule
        self.unit = unit
        self.candidates = tuple(candidates)
        self.margin = margin
        self.memory_limit = memory_limit
        self.lengths_fn = lengths_fn
        self.priority = priority
        self.lookahead = lookahead
        self._job: LookaheadJob | None = None
        self.switches: list[tuple[int, str]] = []
        self.last_rows: list[AutoScheduleRow] = []  # "auto": the latest ranking, best first

    def _schedule_for(self, count: int) -> Schedule:
        if self.rule == "auto":
            raise AssertionError("'auto' is decided per batch")
        if callable(self.rule):
            return resolve_schedule(self.rule(count))
        keys = [k for k in sorted(self.rule) if k <= count]
        return resolve_schedule(self.rule[keys[-1] if keys else min(self.rule)])

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        """Propose the rule's schedule (at accumulation-window starts); ``switches`` records changes."""
        if batch_idx % trainer.accumulate_grad_batches:
            return
        strategy = trainer.strategy
        count = trainer.global_step if self.unit == "step" else trainer.current_epoch
        with strategy.step_clock.measure("plan"):  # on the step's critical path
            schedule = self._auto_schedule(strategy, batch, batch_idx) if self.rule == "auto" else self._schedule_for(count)
        strategy.propose(PlanProposal(type(self).__name__, schedule=schedule, priority=self.priority))
        if schedule == strategy.schedule:
            return
        self.switches.append((count, schedule.name))
        log.info("ScheduleSwitch: %s %d -> schedule %s", self.unit, count, schedule.name)

    def _auto_schedule(self, strategy: PipelineStrategy, batch: Any, batch_idx: int) -> Schedule:
        """The fastest candidate for this batch's costs, or the running schedule (see ``rule="auto"``);
        the next batch's choice is ranked on a lookahead thread while this one trains."""
        costs = strategy.costs
        found, upcoming = strategy.peek_next_batch() if self.lookahead else (False, None)
        mine = (costs.microbatch_lengths(batch, self.lengths_fn), costs.microbatch_lengths(upcoming, self.lengths_fn) if found else None)
        everyone = costs.replica_values(mine)  # one collective for this batch and the next
        per_replica = [e[0] for e in everyone]
        lengths = [n for replica in per_replica for mb in replica for n in mb]
        split = costs.split_to_measure(self.candidates)
        model = costs.ensure_estimate(batch, max(lengths), max(len(mb) for r in per_replica for mb in r), batch_idx, split).cost_model
        key = _RankKey(model, tuple(costs.shapes(costs.heaviest(per_replica))), tuple(strategy.boundaries), strategy.schedule)
        job, self._job = self._job, None
        if job is not None and job.key == key:
            schedule, rows = job.join()
            strategy.step_clock.add_background("plan", job.seconds)
        else:
            schedule, rows = self._rank(strategy, key)
        self.last_rows = rows
        if found and all(e[1] is not None for e in everyone):
            upcoming_shapes = tuple(costs.shapes(costs.heaviest([e[1] for e in everyone])))
            # the partition the choice runs with: this one, or the default one of its stage count
            stages = strategy.pipeline_parallel_size * schedule.stages_per_rank
            boundaries = key.boundaries if stages == len(key.boundaries) - 1 else strategy.default_boundaries(stages)
            ahead = _RankKey(model, upcoming_shapes, tuple(boundaries), schedule)
            self._job = LookaheadJob(
                ahead, functools.partial(self._rank, strategy, ahead), "ScheduleSwitch-rank", strategy.plan_gate
            )
        return schedule

    def _rank(self, strategy: PipelineStrategy, key: _RankKey) -> tuple[Schedule, list[AutoScheduleRow]]:
        """The schedule to run for ``key`` and the candidates' ranking (pure: runs on lookahead threads)."""
        model, shapes, ranks = key.model, list(key.shapes), strategy.pipeline_parallel_size

        def stage_costs(num_stages: int) -> Any:
            same = num_stages == len(key.boundaries) - 1
            return model.stage_costs(key.boundaries if same else strategy.default_boundaries(num_stages), shapes)

        def fitting(specs: Sequence[Any]) -> list[Any]:
            schedules = [resolve_schedule(spec) for spec in specs]
            return [s for s in schedules if ranks * s.stages_per_rank <= model.num_blocks]

        merging = {"merge_split_backward": strategy.merges_split_backward, "split_backward": model.split_backward}
        rows = auto_schedule(
            stage_costs, ranks, self.memory_limit, num_microbatches=len(shapes), candidates=fitting(self.candidates), **merging
        )
        running = auto_schedule(
            stage_costs, ranks, self.memory_limit, num_microbatches=len(shapes), candidates=[key.running], **merging
        )
        if not rows or not running or not rows[0].fits:
            return key.running, rows
        best, now = rows[0], running[0]
        if now.fits and best.makespan >= now.makespan * (1.0 - self.margin):
            return key.running, rows
        return best.schedule, rows

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Finish a ranking still running in the background."""
        if self._job is not None:
            self._job.wait()
            self._job = None


@dataclass(frozen=True)
class _RankKey:
    """What ``ScheduleSwitch("auto")``'s choice depends on (a lookahead ranking is used only for an equal key)."""

    model: Any
    shapes: tuple
    boundaries: tuple[int, ...]
    running: Schedule

