"""``ElasticRepartition``: before every batch, plan the partition for it and migrate when it pays off.

For each batch the callback

1. reads the microbatch shapes (sample lengths, split as the strategy splits the batch; with data
   parallelism, every replica's batch, and plans for the one with the most work: all replicas run
   one partition);
2. finds the exact best partition for those shapes under the strategy's schedule
   (:func:`~lightning_pipe.planning.plan_partition` on the cost model), and predicts the step with
   the partition in use and with the candidate, on this batch and on the last ``recent_steps``;
3. decides with :func:`~lightning_pipe.planning.decide_repartition`, pricing a migration at the
   mean *measured* migration seconds (before the first migration, the planning estimate from the
   cost model's link), and predictions rescaled by the measured step times;
4. proposes the candidate's boundaries (``strategy.propose``); the strategy merges every callback's
   proposals and applies one plan before the step (live migration of parameters, gradients of an
   open accumulation window, optimizer state). Boundaries made for another stage count than the
   merged family's are not used (``planning/proposals.py``).

Lookahead: Lightning's loop has the next batch ready (``_lightning_compat.peek_next_training_batch``),
so while batch ``k`` trains, a background thread plans batch ``k + 1``; ``on_train_batch_start`` of
``k + 1`` joins it. Planning is pure numpy (no torch, no collectives) and the plan is a function of
(batch shapes, partition in use, recent shapes, schedule, settings, cost model) only, so every rank
computes the same plan whether it was looked ahead or not. The numbers that are measured (step and
migration seconds) are replaced by their maximum over all ranks before they feed a decision.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import lightning as L

from lightning_pipe.callbacks._lookahead import LookaheadJob
from lightning_pipe.callbacks._step_logs import log_step_metrics
from lightning_pipe.planning.cost_model import CostModel, MicrobatchShape
from lightning_pipe.planning.memory_model import parse_size
from lightning_pipe.planning.migration import estimate_migration
from lightning_pipe.planning.partition import PartitionPlan, evaluate_partition, plan_partition
from lightning_pipe.planning.proposals import PlanProposal
from lightning_pipe.planning.trigger import StepPrediction, TriggerConfig, TriggerDecision, decide_repartition
from lightning_pipe.schedules import merged_if_split

if TYPE_CHECKING:
    from lightning_pipe.strategies import PipelineStrategy

log = logging.getLogger(__name__)

Trigger = Union[str, int]


@dataclass(frozen=True)
class RepartitionStep:
    """What :class:`ElasticRepartition` did for one batch (one entry of ``history``).

    Attributes:
        batch_idx: the batch.
        global_step: optimizer steps done before it.
        boundaries: the partition the batch ran with.
        candidate: the best partition for the batch.
        predicted_step_seconds: predicted seconds of the step with ``boundaries`` (rescaled by
            measured step times).
        measured_step_seconds: wall seconds from after the decision to the end of the batch, the
            maximum over ranks (migration excluded).
        migrated: whether units moved before the batch.
        reason: the trigger's reason.
        migrated_bytes: bytes this rank sent and received in the migration.
        migration_seconds: wall seconds of the migration, maximum over ranks (0 without one).
        planning_seconds: wall seconds spent planning this batch (in the background if looked ahead).
        looked_ahead: whether the plan was made while the previous batch ran.
        planning_waited_seconds: wall seconds this batch waited for its plan before the step (the
            planning not hidden behind the previous step).
    """

    batch_idx: int
    global_step: int
    boundaries: tuple[int, ...]
    candidate: tuple[int, ...]
    predicted_step_seconds: float
    measured_step_seconds: float
    migrated: bool
    reason: str
    migrated_bytes: int
    migration_seconds: float
    planning_seconds: float
    looked_ahead: bool
    planning_waited_seconds: float = 0.0


@dataclass(frozen=True)
class _PlanKey:
    model: CostModel
    shapes: tuple[MicrobatchShape, ...]
    current: tuple[int, ...]
    schedule: Any
    recent: tuple[tuple[MicrobatchShape, ...], ...]


@dataclass(frozen=True)
class _Plan:
    candidate: PartitionPlan
    current: PartitionPlan
    recent: tuple[StepPrediction, ...]
    seconds: float


class ElasticRepartition(L.Callback):
    """Repartition the pipeline's blocks per batch (see the module docstring).

    Args:
        cost_model: None (the strategy's: a ``PipelineProfiler``'s profile or ``partition="auto"``'s
            model if there is one, else the meta-device estimate from the first batch), a path to a
            JSON profile (``CostModel.save`` or ``PipelineProfiler(output=...)``), or a ``CostModel``.
        trigger: ``"auto"`` (migrate when the predicted gain over ``horizon_steps`` beats the
            migration cost by ``margin``), ``"always"`` (whenever the best partition differs; for
            tests), ``"never"`` (plan and log only), or an integer ``n`` (every ``n`` steps).
        margin: in ``"auto"``, the gain must exceed the migration seconds by this fraction.
        horizon_steps: in ``"auto"``, steps a gain is assumed to last.
        memory_limit: bytes per rank (or ``"60GiB"``) the plan's simulated peak memory must fit; a
            partition in use that would not fit the coming batch is left in every mode.
        lengths_fn: ``lengths_fn(batch) -> one length per sample``; default: ``B`` samples of
            length ``T`` from the batch's token tensor ``[B, T]`` (its first integer 2-D tensor).
        recent_steps: batches just trained on which both partitions are compared (the trigger's
            forecast; keeps it from oscillating).
        lookahead: plan the next batch in the background while the current one trains.
        relative_gap: accept plans within this fraction of the optimum (faster planning).
        priority: wins the partition part over proposals of lower priority (``planning/proposals.py``).
    """

    def __init__(
        self,
        cost_model: CostModel | str | Path | None = None,
        trigger: Trigger = "auto",
        margin: float = 0.25,
        horizon_steps: int = 16,
        memory_limit: int | str | None = None,
        lengths_fn: Callable[[Any], Sequence[int]] | None = None,
        recent_steps: int = 4,
        lookahead: bool = True,
        relative_gap: float = 0.0,
        priority: int = 0,
    ) -> None:
        if isinstance(trigger, bool) or not isinstance(trigger, (str, int)):
            raise TypeError(
                f"`ElasticRepartition(trigger=...)` takes 'auto', 'always', 'never' or an int, got {trigger!r}."
            )
        if isinstance(trigger, int):
            if trigger < 1:
                raise ValueError(f"`ElasticRepartition(trigger={trigger})`: an interval must be >= 1 steps.")
            self.config = TriggerConfig("interval", margin, horizon_steps, trigger)
        elif trigger in ("auto", "always", "never"):
            self.config = TriggerConfig(trigger, margin, horizon_steps)
        else:
            raise ValueError(f"`ElasticRepartition(trigger={trigger!r})`: use 'auto', 'always', 'never' or an int.")
        if recent_steps < 0:
            raise ValueError(f"`ElasticRepartition(recent_steps={recent_steps})` must be >= 0.")
        if cost_model is not None and not isinstance(cost_model, (CostModel, str, Path)):
            raise TypeError(
                f"`ElasticRepartition(cost_model=...)` takes None, a CostModel or a profile path, got {type(cost_model).__name__}."
            )
        self.cost_model = cost_model
        self.memory_limit = None if memory_limit is None else parse_size(memory_limit)
        self.lengths_fn = lengths_fn
        self.recent_steps = recent_steps
        self.lookahead = lookahead
        self.relative_gap = relative_gap
        self.priority = priority
        self.history: list[RepartitionStep] = []
        self._recent: deque[tuple[MicrobatchShape, ...]] = deque(maxlen=recent_steps)
        self._job: LookaheadJob | None = None
        self._migration_seconds: list[float] = []
        self._time_scale = 1.0  # measured / predicted step seconds (running average)
        self._time_scale_count = 0
        self._pending: dict[str, Any] = {}
        self._model_ready = False
        self._strategy: PipelineStrategy | None = None

    # --- Lightning hooks ---------------------------------------------------------------------------

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Check that the Trainer runs the pipeline strategy."""
        costs = getattr(trainer.strategy, "costs", None)
        if costs is None or not hasattr(trainer.strategy, "apply_plan"):
            raise TypeError(
                f"`ElasticRepartition` needs `strategy='elastic_pipe'` (ElasticPipelineStrategy), the Trainer runs "
                f"`{type(trainer.strategy).__name__}`."
            )
        self._strategy = trainer.strategy

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Plan this batch (or take the plan made while the last one ran), decide, migrate, look ahead."""
        with trainer.strategy.step_clock.measure("plan"):  # on the step's critical path
            self._plan_batch(trainer, batch, batch_idx)

    def _plan_batch(self, trainer: L.Trainer, batch: Any, batch_idx: int) -> None:
        strategy = trainer.strategy
        costs = strategy.costs
        current_lengths = costs.microbatch_lengths(batch, self.lengths_fn)
        found, upcoming = strategy.peek_next_batch() if self.lookahead else (False, None)
        upcoming_lengths = costs.microbatch_lengths(upcoming, self.lengths_fn) if found else None
        everyone = costs.replica_values((current_lengths, upcoming_lengths))
        if not self._model_ready:
            self._set_cost_model(strategy, batch, batch_idx, [e[0] for e in everyone])
        model = costs.estimate.cost_model
        shapes = tuple(costs.shapes(costs.heaviest([e[0] for e in everyone])))
        key = _PlanKey(model, shapes, tuple(strategy.boundaries), strategy.schedule, tuple(self._recent))
        looked_ahead = self._job is not None and self._job.key == key
        waited = time.perf_counter()
        plan = self._job.join() if looked_ahead else self._plan(key)
        waited = time.perf_counter() - waited  # planning on the step's critical path
        if looked_ahead:
            strategy.step_clock.add_background("plan", plan.seconds)
        if self._job is not None and not looked_ahead:
            self._job.join()  # a stale plan (the schedule or partition changed since): drop it
        self._job = None

        decision = self._decide(strategy, trainer, plan, batch_idx)
        if decision.migrate:
            proposal = PlanProposal(type(self).__name__, boundaries=plan.candidate.boundaries, priority=self.priority)
            strategy.propose(proposal)
        predicted = plan.candidate.step_seconds if decision.migrate else plan.current.step_seconds
        self._recent.append(shapes)

        if self.lookahead and all(e[1] is not None for e in everyone):
            upcoming_shapes = tuple(costs.shapes(costs.heaviest([e[1] for e in everyone])))
            running = plan.candidate.boundaries if decision.migrate else tuple(strategy.boundaries)
            next_key = _PlanKey(model, upcoming_shapes, tuple(running), strategy.schedule, tuple(self._recent))
            self._job = LookaheadJob(
                next_key, functools.partial(self._plan, next_key), "ElasticRepartition-plan", strategy.plan_gate
            )
        self._pending.update(
            batch_idx=batch_idx,
            global_step=trainer.global_step,
            candidate=plan.candidate.boundaries,
            predicted=predicted,
            decision=decision,
            planning_seconds=plan.seconds,
            planning_waited_seconds=waited,
            looked_ahead=looked_ahead,
            started=time.perf_counter(),
        )

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Measure the step, agree on measurements across ranks, log, keep ``history``."""
        pending = self._pending
        if pending.get("batch_idx") != batch_idx:
            return
        strategy = trainer.strategy
        costs = strategy.costs
        application = getattr(strategy, "last_application", None)
        started = pending["started"]
        report = None
        if application is not None and application.batch_idx == batch_idx:  # the plan was applied after our hook
            started = max(started, application.finished)
            if application.migration is not None and application.migration.transfers:
                report = application.migration
        measured = costs.max_over_ranks(time.perf_counter() - started)
        migration_seconds = 0.0
        if report is not None:  # every rank migrated: the collective is reached by all
            migration_seconds = costs.max_over_ranks(report.seconds)
            self._migration_seconds.append(migration_seconds)
        predicted = pending["predicted"] * self._time_scale
        if pending["global_step"] > 0 and pending["predicted"] > 0:  # the first step includes warm-up
            ratio = measured / pending["predicted"]
            self._time_scale_count += 1
            self._time_scale += (ratio - self._time_scale) / min(self._time_scale_count, 8)
        step = RepartitionStep(
            batch_idx=batch_idx,
            global_step=pending["global_step"],
            boundaries=tuple(trainer.strategy.boundaries),
            candidate=tuple(pending["candidate"]),
            predicted_step_seconds=predicted,
            measured_step_seconds=measured,
            migrated=report is not None,
            reason=pending["decision"].reason,
            migrated_bytes=0 if report is None else report.bytes_sent + report.bytes_received,
            migration_seconds=migration_seconds,
            planning_seconds=pending["planning_seconds"],
            looked_ahead=pending["looked_ahead"],
            planning_waited_seconds=pending["planning_waited_seconds"],
        )
        self.history.append(step)
        metrics = {f"elastic/boundary{k}": float(b) for k, b in enumerate(step.boundaries)}
        metrics.update(
            {
                "elastic/predicted_step_s": step.predicted_step_seconds,
                "elastic/measured_step_s": step.measured_step_seconds,
                "elastic/migrated": float(step.migrated),
                "elastic/migrated_bytes": float(step.migrated_bytes),
                "elastic/migration_s": step.migration_seconds,
                "elastic/planning_s": step.planning_seconds,
                "elastic/planning_waited_s": step.planning_waited_seconds,
                "elastic/looked_ahead": float(step.looked_ahead),
            }
        )
        log_step_metrics(trainer, pl_module, metrics)
        log.debug("ElasticRepartition: %s", step)

    def state_dict(self) -> dict[str, Any]:
        """What the next plans depend on (saved in checkpoints by Lightning): the recent batches'
        microbatch shapes, the measured/predicted time scale and the migration times seen."""
        return {
            "recent": [[dataclasses.asdict(shape) for shape in shapes] for shapes in self._recent],
            "time_scale": self._time_scale,
            "time_scale_count": self._time_scale_count,
            "migration_seconds": list(self._migration_seconds),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue planning where a checkpointed run left off."""
        self._recent.clear()
        self._recent.extend(tuple(MicrobatchShape(**shape) for shape in shapes) for shapes in state_dict["recent"])
        self._time_scale = float(state_dict["time_scale"])
        self._time_scale_count = int(state_dict["time_scale_count"])
        self._migration_seconds = list(state_dict["migration_seconds"])

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Finish a plan still running in the background."""
        if self._job is not None:
            self._job.wait()
            self._job = None

    # --- planning ------------------------------------------------------------------------------------

    def _set_cost_model(
        self, strategy: PipelineStrategy, batch: Any, batch_index: int, per_replica: list[list[list[int]]]
    ) -> None:
        costs = strategy.costs
        if isinstance(self.cost_model, (str, Path)):
            costs.load(self.cost_model)
        elif isinstance(self.cost_model, CostModel):
            costs.use_model(self.cost_model)
        else:
            lengths = [n for replica in per_replica for mb in replica for n in mb]
            sizes = [len(mb) for replica in per_replica for mb in replica]
            costs.ensure_estimate(batch, max(lengths), max(sizes), batch_index, costs.split_to_measure())
        self._model_ready = True

    def _plan(self, key: _PlanKey) -> _Plan:
        strategy = self._strategy
        model = key.model
        started = time.perf_counter()
        ranks = strategy.pipeline_parallel_size
        # the program the strategy runs: a zero-bubble family with its pairs merged (merge_split_backward)
        merged = None
        if strategy.merges_split_backward:
            merged = merged_if_split(key.schedule, ranks, len(key.shapes), model.split_backward)
        source = key.schedule if merged is None else merged
        candidate = plan_partition(
            model,
            key.shapes,
            source,
            ranks,
            self.memory_limit,
            candidates=[key.current],
            relative_gap=self.relative_gap,
        )
        current = evaluate_partition(model, key.shapes, source, ranks, key.current)
        recent = tuple(
            StepPrediction(
                evaluate_partition(model, shapes, source, ranks, key.current).step_seconds,
                evaluate_partition(model, shapes, source, ranks, candidate.boundaries).step_seconds,
            )
            for shapes in key.recent
            if len(shapes) == len(key.shapes)
        )
        return _Plan(candidate, current, recent, time.perf_counter() - started)

    def _decide(self, strategy: PipelineStrategy, trainer: L.Trainer, plan: _Plan, batch_idx: int) -> TriggerDecision:
        differs = tuple(plan.candidate.boundaries) != tuple(strategy.boundaries)
        if self._migration_seconds:
            migration_seconds = sum(self._migration_seconds) / len(self._migration_seconds)
        elif differs:
            migration_seconds = estimate_migration(
                strategy.costs.estimate.cost_model,
                strategy.boundaries,
                plan.candidate.boundaries,
                strategy.program.stage_to_rank,
                include_gradients=batch_idx % trainer.accumulate_grad_batches != 0,
            ).seconds
        else:
            migration_seconds = 0.0
        scale = self._time_scale

        def scaled(p: StepPrediction) -> StepPrediction:
            return StepPrediction(p.current_seconds * scale, p.candidate_seconds * scale)

        coming = [scaled(StepPrediction(plan.current.step_seconds, plan.candidate.step_seconds))]
        return decide_repartition(
            self.config,
            trainer.global_step,
            migration_seconds,
            coming,
            [scaled(p) for p in plan.recent],
            candidate_differs=differs,
            current_fits=plan.current.fits(self.memory_limit),
        )
