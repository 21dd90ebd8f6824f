"""``AutoPlanner``: one joint plan per batch (partition x family x microbatching x memory plan).

Before every batch the callback proposes the plan :func:`~lightning_pipe.planning.joint.plan_joint`
finds for it: the fastest simulated step under the memory budget over the schedule families, the
microbatch counts and even or work-balanced microbatch sizes, every partition (exact search) and the
memory planner's recompute/offload plans, with a stated optimality gap. A plan that moves units must
gain, over ``horizon_steps`` steps, more than the predicted migration by ``margin`` (the same
migration-cost trigger as ``ElasticRepartition``). The plan is proposed with a high priority, so the
strategy's merge (``planning/proposals.py``) lets it win every part it sets.

Lookahead: Lightning's loop has the next batch ready, so while batch ``k`` trains a background
thread plans batch ``k + 1`` for the plan batch ``k`` runs; batch ``k + 1`` takes it if that plan is
still the running one. Planning is pure (numpy/scipy), but its searches are time-limited
(``partition_time_limit``, the MILP's limit), so the result may depend on the machine's load: only
global rank 0 plans, and its plan is broadcast to every rank (the others do not spend CPU on it).
A :class:`~lightning_pipe.planning.joint.JointCache` keeps the searches, so a batch whose microbatches
have shapes seen before (fixed-length data, a recurring length signature) is planned from them.

Calibration: the cost model prices compute and messages per unit, not what a stage run costs beyond
its units (the step's call, hooks, the runtime's bookkeeping), and that may differ between families
(one stage per rank or several). Each family's predictions are multiplied by its measured over
predicted step seconds (median of the last ``calibration_window`` batches run with it;
``JointConfig.family_scale``); a family not measured yet is priced at the smallest of 1 and the
measured factors. The family the run started with (the user's ``schedule``) is the baseline: until
it has two measured batches, its best plan runs whenever it is predicted within ``explore_within``
of the chosen one, so the planner keeps another family only if that family's own steps beat it.
Off by default (``calibrate=False``): on ``bench_varlen``'s FLAN trace (19 batches a run, 7 alternated
rounds) the calibrated planner was 0.971x the uncalibrated one (rounds 0.83-1.29), and an earlier
version that explored every family 0.945x; the factors came out between 0.8 and 1.1 and varied
between runs as much as between families. It is there for long runs whose families differ in fixed
costs the model leaves out, and for users who know them (``JointConfig.family_scale``).

It explains its choice through the Lightning logger every step: ``auto/predicted_step_s``,
``auto/measured_step_s`` (after the plan was applied to the end of the batch, the maximum over
ranks), ``auto/gap`` (stated optimality gap), ``auto/planning_s`` (seconds of the search),
``auto/planning_waited_s`` (seconds the step waited for it: what lookahead did not hide),
``auto/migration_s``, ``auto/scale`` (the calibration factor the chosen family was priced with) and
``auto/bought_<lever>_s`` for ``partition``, ``family``, ``microbatching`` and ``memory``: how many
simulated seconds the best plan holding that lever at its running value (even microbatches, no
memory plan) would take beyond the chosen one (at least that many where the search pruned the
(family, microbatching) groups holding it by their bounds). ``history`` keeps one :class:`AutoPlanStep` per batch.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L

from lightning_pipe.callbacks._lookahead import LookaheadJob
from lightning_pipe.callbacks._step_logs import log_step_metrics
from lightning_pipe.planning.cost_model import CostModel
from lightning_pipe.planning.joint import EVEN, JointCache, JointConfig, JointPlan, plan_joint, plan_migration_seconds
from lightning_pipe.planning.memory_model import FULL, OFFLOAD, MemoryPlan, parse_size
from lightning_pipe.planning.memory_planner import MemoryBudgetError
from lightning_pipe.planning.plan import PipelinePlan
from lightning_pipe.planning.proposals import PlanProposal
from lightning_pipe.schedules import is_split_placement, resolve_schedule

log = logging.getLogger(__name__)

LEVERS = ("partition", "family", "microbatching", "memory")


@dataclass(frozen=True)
class AutoPlanStep:
    """What :class:`AutoPlanner` chose for one batch.

    Attributes:
        batch_idx: the batch.
        plan: the proposed plan.
        predicted_step_seconds: its simulated step time.
        measured_step_seconds: wall seconds from the applied plan to the end of the batch (max over ranks).
        gap: the search's stated optimality gap.
        bought: per lever, simulated seconds the best plan holding that lever would add.
        migration_seconds: predicted seconds of moving to the plan (0 when nothing moves).
        planning_seconds: wall seconds of the search (on global rank 0, in the background when looked ahead).
        looked_ahead: whether the plan was made while the previous batch ran.
        planning_waited_seconds: wall seconds this batch waited on global rank 0 for its plan before
            the step (the rest of a lookahead still running, or the whole search without one): the
            planning time lookahead did not hide (the broadcast of the plan is not in it).
        scale: the calibration factor the plan's family was priced with (``predicted_step_seconds``
            includes it).
    """

    batch_idx: int
    plan: PipelinePlan
    predicted_step_seconds: float
    measured_step_seconds: float
    gap: float
    bought: dict[str, float]
    migration_seconds: float
    planning_seconds: float
    looked_ahead: bool
    planning_waited_seconds: float = 0.0
    scale: float = 1.0


class AutoPlanner(L.Callback):
    """Propose the joint plan of every batch (see the module docstring).

    Args:
        budget: bytes per device (``"60GiB"``) the plan must fit; None: the strategy's
            ``memory_budget`` (no limit if that is None too). Enforced on the accounted bytes.
        families: schedule families to choose among (those needing more stages than blocks are skipped).
        microbatch_counts: microbatch counts to choose among; None: the strategy's ``num_microbatches``.
        microbatching: ``"even"`` and/or ``"balanced"`` (sizes balancing the samples' cost).
        memory_options: what memory plans may use (``"full"``, ``"offload"``, ``"keep_attention"``).
        memory_method: ``"greedy"`` or ``"milp"``.
        cost_model: None (the strategy's: a profile, else the meta-device estimate from the first
            batch), a ``CostModel``, or a path to a saved profile.
        lengths_fn: ``lengths_fn(batch) -> one length per sample``; default from the token tensor.
        margin: a move must gain this fraction more than the migration costs.
        horizon_steps: steps a gain is assumed to last.
        relative_gap: partitions within this fraction of the optimum are accepted (faster planning).
        partition_time_limit: seconds one partition search may take (the best found is used; the gap says
            what was left unproven).
        time_limit: seconds the whole search for one batch may take: a number, None (no limit), or
            ``"auto"``: half the last measured step, so that planning the next batch ends while this one
            trains (lookahead hides it); no limit before the first step is measured. Groups left out for
            time count with their bound, so the stated gap stays true.
        lookahead: plan the next batch in the background while the current one trains.
        priority: the proposal's priority (high: the joint plan wins the parts it sets).
        calibrate: price each family at its measured over predicted step seconds (module docstring).
        calibration_window: batches per family the calibration takes its median over.
        explore_within: with ``calibrate``, while the family the run started with is measured on fewer
            than two batches, its best plan runs when predicted within this fraction of the chosen one.
    """

    def __init__(
        self,
        budget: str | int | None = None,
        families: Sequence[Any] = ("1f1b", "gpipe", "zb_h1", "interleaved_1f1b"),
        microbatch_counts: Sequence[int] | None = None,
        microbatching: Sequence[str] = ("even", "balanced"),
        memory_options: Sequence[str] = (FULL, OFFLOAD),
        memory_method: str = "greedy",
        cost_model: CostModel | str | Path | None = None,
        lengths_fn: Callable[[Any], Sequence[int]] | None = None,
        margin: float = 0.25,
        horizon_steps: int = 16,
        relative_gap: float = 0.0,
        partition_time_limit: float | None = 5.0,
        time_limit: float | str | None = "auto",
        lookahead: bool = True,
        priority: int = 100,
        calibrate: bool = False,
        calibration_window: int = 8,
        explore_within: float = 0.25,
    ) -> None:
        if not families:
            raise ValueError("`AutoPlanner(families=())` has nothing to choose from.")
        split = [s.name for s in map(resolve_schedule, families) if is_split_placement(s)]
        if split:
            raise ValueError(
                f"`AutoPlanner(families=...)` lists {split}: the strategy cannot switch a run into or out of split "
                "placement between batches (it holds the parameters differently), and a split-placement run takes no "
                "planning callbacks. Leave them out here; to compare them with the other families for your model and "
                "data, run the joint planner before training (`plan_joint` with `JointConfig(families=(..., 'helix'))`, "
                "or `lightning-pipe-profile --config ... --plan-ranks P`) and start the run with the schedule it picks."
            )
        if set(microbatching) - {"even", "balanced"} or not microbatching:
            raise ValueError(f"`AutoPlanner(microbatching={microbatching!r})`: use 'even' and/or 'balanced'.")
        if memory_method not in ("greedy", "milp"):
            raise ValueError(f"`AutoPlanner(memory_method={memory_method!r})`: use 'greedy' or 'milp'.")
        if not (time_limit is None or time_limit == "auto" or (isinstance(time_limit, (int, float)) and time_limit >= 0)):
            raise ValueError(f"`AutoPlanner(time_limit={time_limit!r})`: use seconds >= 0, None or 'auto'.")
        if horizon_steps < 1 or margin < 0:
            raise ValueError(f"`AutoPlanner`: horizon_steps must be >= 1 and margin >= 0, got {horizon_steps}, {margin}")
        if calibration_window < 1 or explore_within < 0:
            raise ValueError(
                f"`AutoPlanner`: calibration_window must be >= 1 and explore_within >= 0, got {calibration_window}, "
                f"{explore_within}."
            )
        self.budget = None if budget is None else parse_size(budget)
        self.families = tuple(families)
        self.microbatch_counts = None if microbatch_counts is None else tuple(microbatch_counts)
        self.microbatching = tuple(microbatching)
        self.memory_options = tuple(memory_options)
        self.memory_method = memory_method
        self.cost_model = cost_model
        self.lengths_fn = lengths_fn
        self.margin = margin
        self.horizon_steps = horizon_steps
        self.relative_gap = relative_gap
        self.partition_time_limit = partition_time_limit
        self.time_limit = time_limit
        self._last_step_seconds: float | None = None
        self.lookahead = lookahead
        self.priority = priority
        self.calibrate = calibrate
        self.calibration_window = calibration_window
        self.explore_within = explore_within
        self._baseline: str | None = None  # the family the run started with
        self.ratios: dict[str, deque[float]] = {}  # per family: measured over predicted (unscaled) step seconds
        self.history: list[AutoPlanStep] = []
        self._job: LookaheadJob | None = None
        self._pending: dict[str, Any] = {}
        self._model: CostModel | None = None
        self.cache = JointCache()  # searches reused by batches whose microbatches have the same shapes

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Check the strategy; give it the budget to enforce."""
        strategy = trainer.strategy
        if not hasattr(strategy, "propose") or getattr(strategy, "costs", None) is None:
            raise TypeError(
                f"`AutoPlanner` needs `strategy='elastic_pipe'` (ElasticPipelineStrategy), the Trainer runs "
                f"`{type(strategy).__name__}`."
            )
        if self.budget is not None:
            strategy.memory.set_budget(self.budget)
        self._baseline = strategy.schedule.name  # the family the run starts with

    # --- hooks -------------------------------------------------------------------------------------

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Take (or make) this batch's joint plan, propose it, and start planning the next batch."""
        with trainer.strategy.step_clock.measure("plan"):  # on the step's critical path
            self._plan_batch(trainer, batch, batch_idx)

    def _plan_batch(self, trainer: L.Trainer, batch: Any, batch_idx: int) -> None:
        strategy = trainer.strategy
        costs = strategy.costs
        found, upcoming = strategy.peek_next_batch() if self.lookahead else (False, None)
        mine = (self._sample_lengths(strategy, batch), self._sample_lengths(strategy, upcoming) if found else None)
        everyone = costs.replica_values(mine)
        lengths = self._heaviest([e[0] for e in everyone])
        if self._model is None:
            self._model = self._cost_model(strategy, batch, batch_idx, lengths)
        budget = self.budget if self.budget is not None else strategy.memory.budget
        profile = None
        if budget is not None:
            budget = budget * (1.0 - strategy.memory.planning_margin)  # measurement noise, as MemoryPlanner
            if strategy.memory.profile is None:
                strategy.memory.measure_profile(batch, (batch_idx,))
            profile = strategy.memory.profile
        running = strategy.plan
        layout = self._layout(strategy, batch)  # how microbatches of this batch run (priced so)
        key = (tuple(lengths), running.boundaries, running.schedule, running.num_microbatches, layout)
        planner = strategy.global_rank == 0  # plans alone: searches stopped by time limits may differ between ranks
        looked_ahead = self._job is not None and self._job.key == key
        waited = time.perf_counter()
        if self._job is not None and not looked_ahead:
            self._job.join()  # stale: the running plan or the batch differs from what was planned for
        result = None
        if planner:
            calibration = self._calibration()
            result = (
                self._job.join() if looked_ahead
                else self._plan(strategy, lengths, running, budget, profile, layout, calibration)
            )
        self._job = None
        waited = time.perf_counter() - waited  # planning on the step's critical path (rank 0's)
        if strategy.world_size > 1:
            with strategy.step_clock.measure("plan_sync"):  # waiting for the other ranks, not planning
                result, waited, looked_ahead = strategy.broadcast((result, waited, looked_ahead), src=0)
        if looked_ahead:
            strategy.step_clock.add_background("plan", result.planning_seconds)
        plan = result.plan
        strategy.propose(
            PlanProposal(
                type(self).__name__, boundaries=plan.boundaries, schedule=plan.schedule,
                num_microbatches=plan.num_microbatches, microbatch_sizes=plan.microbatch_sizes,
                memory=plan.memory if plan.memory is not None else MemoryPlan(), priority=self.priority,
            )
        )
        if planner and self.lookahead and all(e[1] is not None for e in everyone):
            upcoming_lengths = self._heaviest([e[1] for e in everyone])
            next_running = PipelinePlan(plan.boundaries, plan.schedule, plan.num_microbatches, plan.memory)
            next_layout = self._layout(strategy, upcoming)
            next_calibration = self._calibration()  # taken here: the windows change on this thread
            next_key = (
                tuple(upcoming_lengths), next_running.boundaries, next_running.schedule, next_running.num_microbatches,
                next_layout,
            )
            self._job = LookaheadJob(
                next_key,
                lambda: self._plan(strategy, upcoming_lengths, next_running, budget, profile, next_layout, next_calibration),
                "AutoPlanner-plan",
                strategy.plan_gate,
            )
        self._pending = {
            "batch_idx": batch_idx, "result": result, "looked_ahead": looked_ahead, "running": running,
            "waited": waited, "started": time.perf_counter(),
        }

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Measure the step, log predicted vs measured and what each lever bought."""
        pending = self._pending
        if pending.get("batch_idx") != batch_idx:
            return
        strategy = trainer.strategy
        application = getattr(strategy, "last_application", None)
        started = pending["started"]
        if application is not None and application.batch_idx == batch_idx:
            started = max(started, application.finished)
        measured = strategy.costs.max_over_ranks(time.perf_counter() - started)
        result: JointPlan = pending["result"]
        bought = self._bought(result, pending["running"])
        step = AutoPlanStep(
            batch_idx, result.plan, result.step_seconds, measured, result.gap, bought, result.migration_seconds,
            result.planning_seconds, pending["looked_ahead"], pending["waited"], result.scale,
        )
        ran = strategy.plan.schedule.name == result.plan.schedule.name  # not overridden by another proposal
        if self.history and ran and result.step_seconds > 0:  # the first batch ran the probes and warmed up
            family = result.plan.schedule.name
            window = self.ratios.setdefault(family, deque(maxlen=self.calibration_window))
            window.append(measured / (result.step_seconds / result.scale))
        self.history.append(step)
        self._last_step_seconds = measured
        metrics = {
            "auto/predicted_step_s": step.predicted_step_seconds,
            "auto/measured_step_s": step.measured_step_seconds,
            "auto/gap": step.gap,
            "auto/planning_s": step.planning_seconds,
            "auto/planning_waited_s": step.planning_waited_seconds,
            "auto/migration_s": step.migration_seconds,
            "auto/looked_ahead": float(step.looked_ahead),
            "auto/num_microbatches": float(step.plan.num_microbatches),
            "auto/balanced_microbatches": float(step.plan.microbatch_sizes is not None),
            "auto/memory_plan": float(step.plan.memory is not None and not step.plan.memory.is_empty),
            "auto/scale": step.scale,
        }
        metrics.update({f"auto/bought_{lever}_s": s for lever, s in bought.items() if math.isfinite(s)})
        log_step_metrics(trainer, pl_module, metrics)
        log.debug("AutoPlanner: %s", step)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Finish a plan still running in the background."""
        if self._job is not None:
            self._job.wait()
            self._job = None

    # --- planning ------------------------------------------------------------------------------------

    def _config(self, strategy: Any, layout: tuple[bool, bool], family_scale: tuple = ()) -> JointConfig:
        return JointConfig(
            families=self.families, microbatch_counts=self.microbatch_counts or (strategy.num_microbatches,),
            microbatching=self.microbatching, memory_options=self.memory_options, memory_method=self.memory_method,
            relative_gap=self.relative_gap, partition_time_limit=self.partition_time_limit,
            time_limit=self._time_limit(), padded=layout[0], grouped=layout[1], family_scale=family_scale,
            merge_split_backward=strategy.merges_split_backward,
        )

    def _calibration(self) -> tuple[tuple[tuple[str, float], ...], tuple[str, ...]]:
        """Each family's calibration factor (the median of its measured over predicted steps; for one
        not measured yet the smallest of 1 and the measured factors) and the family still to explore (the
        baseline, while measured on fewer than two batches); nothing before any measurement or with
        ``calibrate=False``."""
        measured = {family: statistics.median(window) for family, window in self.ratios.items() if window}
        if not self.calibrate or not measured:
            return (), ()
        prior = min(1.0, *measured.values())
        names = [resolve_schedule(f).name for f in self.families]
        baseline = self._baseline
        unexplored = (baseline,) if baseline in names and len(self.ratios.get(baseline, ())) < 2 else ()
        return tuple((name, measured.get(name, prior)) for name in names), unexplored

    def _time_limit(self) -> float | None:
        if self.time_limit == "auto":
            return None if self._last_step_seconds is None else 0.5 * self._last_step_seconds
        return self.time_limit

    def _plan(
        self, strategy: Any, lengths: list[int], running: PipelinePlan, budget: float | None, profile: Any,
        layout: tuple[bool, bool], calibration: tuple = ((), ()),
    ) -> JointPlan:
        model = self._model
        assert model is not None
        ranks = strategy.pipeline_parallel_size

        def migration(plan: PipelinePlan) -> float:
            seconds = plan_migration_seconds(model, running, plan, ranks)
            return seconds * (1.0 + self.margin) / self.horizon_steps

        stage_counts = sorted({ranks * s for s in self._stages_per_rank()} | {ranks})
        defaults = [strategy.default_boundaries(n) for n in stage_counts if n <= model.num_blocks]
        if profile is not None and profile.num_blocks != model.num_blocks:
            profile = None
        family_scale, unexplored = calibration
        config = self._config(strategy, layout, family_scale)

        def search(config: JointConfig) -> JointPlan:
            return plan_joint(
                model, lengths, ranks, budget, profile=profile, config=config, current=running, partitions=defaults,
                migration=migration, cache=self.cache,
            )

        result = search(config)
        for name in unexplored:
            if name != result.plan.schedule.name and result.best_where(schedule=name) <= result.step_seconds * (
                1.0 + self.explore_within
            ):
                try:
                    return search(dataclasses.replace(config, families=(name,)))
                except MemoryBudgetError:
                    continue
        return result

    def _stages_per_rank(self) -> set[int]:
        return {resolve_schedule(f).stages_per_rank for f in self.families}

    @staticmethod
    def _bought(result: JointPlan, running: PipelinePlan) -> dict[str, float]:
        held = {
            "partition": {"boundaries": running.boundaries},
            "family": {"schedule": running.schedule.name},
            "microbatching": {"microbatching": EVEN},
            "memory": {"memory": None},
        }
        return {lever: result.best_where(**fixed) - result.step_seconds for lever, fixed in held.items()}

    def _sample_lengths(self, strategy: Any, batch: Any) -> list[int]:
        """Each sample's length in the batch's order, whatever split runs now (the plan decides the
        split): ``lengths_fn``, else each sample's real tokens of a padded batch (as microbatches are
        cut to their own), else the token tensor's length."""
        if self.lengths_fn is not None:
            return [int(n) for n in self.lengths_fn(batch)]
        padding = getattr(strategy.split_batch(batch).plan, "padding", None)
        if padding is not None:
            return [max(1, n) for n in padding.content_lengths()]
        return [n for mb in strategy.costs.microbatch_lengths(batch) for n in mb]

    def _layout(self, strategy: Any, batch: Any) -> tuple[bool, bool]:
        """(padded, grouped): whether each microbatch of ``batch`` runs at its longest sample's length
        (its padding cut per microbatch), and whether a plan without sizes groups it by length."""
        if self.lengths_fn is not None:
            return False, False
        padded = getattr(strategy.split_batch(batch).plan, "padding", None) is not None
        return padded, padded and strategy.groups_by_length(batch)

    @staticmethod
    def _heaviest(per_replica: list[list[int]]) -> list[int]:
        return max(per_replica, key=lambda lengths: (sum(n * n for n in lengths), sum(lengths)))

    def _cost_model(self, strategy: Any, batch: Any, batch_index: int, lengths: list[int]) -> CostModel:
        costs = strategy.costs
        if isinstance(self.cost_model, (str, Path)):
            costs.load(self.cost_model)
        elif isinstance(self.cost_model, CostModel):
            costs.use_model(self.cost_model)
        else:
            # balanced sizes may hold any count
            costs.ensure_estimate(batch, max(lengths), len(lengths), batch_index, costs.split_to_measure(self.families))
        return costs.estimate.cost_model
