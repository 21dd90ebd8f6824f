"""``ElasticDepth``: before every batch, FlexPipe's FMOP picks the stages and widths to run it on.

For each batch the callback

1. reads the microbatch shapes (sample lengths, split as the strategy splits the batch: every rank
   reads the global batch under elastic depth);
2. builds the batch's estimators (:class:`~lightning_pipe.planning.depth_estimators.CostModelDepthEstimator`:
   heterogeneous-1F1B step time, per-stage memory, reconfiguration cost) and asks
   :func:`~lightning_pipe.planning.hbsa.decide_depth` (HBSA candidates, conditions A to D) whether
   to keep the layout in use, or grow, shrink or regroup to a faster one that pays its
   reconfiguration over ``migration_horizon`` steps; memory plans are not applied under elastic
   depth, so a layout must fit as it is;
3. proposes the layout (``PlanProposal(boundaries=..., widths=...)``): the strategy merges it with
   the other callbacks' proposals (the partition part, ``planning/proposals.py``) and regroups the
   ranks before the step (``strategies/regrouping.py``).

Planned during the previous step: Lightning has the next batch ready, so while batch ``k`` trains
a background thread decides for batch ``k + 1`` (``callbacks/_lookahead.py``). The reconfiguration
cost is the cost model's (bytes over its link) plus the mean measured seconds of the
reconfigurations so far (maximum over ranks). Rank 0's decision is broadcast, so every rank applies
the same layout even if measurements differ.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lightning as L

from lightning_pipe.callbacks._lookahead import LookaheadJob
from lightning_pipe.planning.cost_model import CostModel, MicrobatchShape
from lightning_pipe.planning.depth_estimators import CostModelDepthEstimator
from lightning_pipe.planning.hbsa import DepthDecision, decide_depth
from lightning_pipe.planning.layout import Layout
from lightning_pipe.planning.memory_model import parse_size
from lightning_pipe.planning.proposals import PlanProposal
from lightning_pipe.planning.trigger import ResidenceHorizon

if TYPE_CHECKING:
    from lightning_pipe.strategies import PipelineStrategy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DepthStep:
    """What :class:`ElasticDepth` decided for one batch (one entry of ``history``).

    Attributes:
        batch_idx: the batch.
        layout: the layout decided for it.
        action: FMOP's action (``keep``, ``grow``, ``shrink``, ``regroup``).
        predicted_seconds: the decision's predicted step seconds (reconfiguration included).
        planning_seconds: seconds spent deciding (in the background when looked ahead).
        looked_ahead: whether the decision was made while the previous batch ran.
    """

    batch_idx: int
    layout: Layout
    action: str
    predicted_seconds: float
    planning_seconds: float
    looked_ahead: bool


@dataclass(frozen=True)
class _Key:
    model: CostModel
    shapes: tuple[MicrobatchShape, ...]
    current: Layout
    migration_overhead: float
    in_window: bool
    horizon: float


class ElasticDepth(L.Callback):
    """Choose stages and widths per batch with HBSA and FMOP (see the module docstring).

    Needs ``ElasticPipelineStrategy(elastic_depth=True)``.

    Args:
        cost_model: a ``CostModel``; None: the strategy's (a profile, or the meta-device estimate
            from the first batch).
        device_memory: bytes per device (or ``"60GiB"``) a layout's fullest replica must fit; None:
            the strategy's ``memory_budget``, else unbounded.
        lengths_fn: ``lengths_fn(batch) -> one length per sample``; default: the strategy's split.
        migration_horizon: at most this many steps a reconfiguration is paid over (FMOP charges its
            seconds divided by the horizon); fewer when layouts have not lasted that long
            (``planning.trigger.ResidenceHorizon``), so that alternating batches do not make it
            switch every step at a loss.
        deeper: also search up to this many stages beyond Algorithm 1's ``N_stage``; None: every
            depth up to ``min(blocks, devices)`` (unbounded memory makes ``N_stage`` 1).
        lookahead: decide for the next batch in the background while the current one trains.
        priority: wins the partition part over proposals of lower priority.
    """

    def __init__(
        self,
        cost_model: CostModel | None = None,
        device_memory: int | str | None = None,
        lengths_fn: Callable[[Any], Sequence[int]] | None = None,
        migration_horizon: int = 4,
        deeper: int | None = None,
        lookahead: bool = True,
        priority: int = 0,
    ) -> None:
        if cost_model is not None and not isinstance(cost_model, CostModel):
            raise TypeError(f"`ElasticDepth(cost_model=...)` takes None or a CostModel, got {type(cost_model).__name__}.")
        if migration_horizon < 1:
            raise ValueError(f"`ElasticDepth(migration_horizon={migration_horizon})` must be >= 1 steps.")
        self.cost_model = cost_model
        self.device_memory = None if device_memory is None else parse_size(device_memory)
        self.lengths_fn = lengths_fn
        self.migration_horizon = migration_horizon
        self.deeper = deeper
        self.lookahead = lookahead
        self.priority = priority
        self.history: list[DepthStep] = []
        self._job: LookaheadJob | None = None
        self._residence = ResidenceHorizon(migration_horizon)
        self._measured: list[float] = []
        self._strategy: PipelineStrategy | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Check that the Trainer runs the pipeline strategy with elastic depth and no planner whose
        decisions it would fight (before training)."""
        if getattr(trainer.strategy, "regrouping", None) is None:
            raise TypeError(
                "`ElasticDepth` changes stages and widths: it needs `ElasticPipelineStrategy(elastic_depth=True)`, the "
                f"Trainer runs `{type(trainer.strategy).__name__}`"
                f"{' without elastic_depth' if hasattr(trainer.strategy, 'regrouping') else ''}."
            )
        _refuse_other_planners(trainer.callbacks)
        self._strategy = trainer.strategy

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        """Take the decision made while the last batch ran (or decide now), propose it, look ahead."""
        with trainer.strategy.step_clock.measure("plan"):  # on the step's critical path
            self._plan_batch(trainer, batch, batch_idx)

    def _plan_batch(self, trainer: L.Trainer, batch: Any, batch_idx: int) -> None:
        strategy = trainer.strategy
        costs = strategy.costs
        self._measure(strategy, batch_idx)
        if costs.estimate is None or self.cost_model is not None and costs.estimate.cost_model is not self.cost_model:
            if self.cost_model is not None:
                costs.use_model(self.cost_model)
            else:
                lengths = costs.microbatch_lengths(batch, self.lengths_fn)
                costs.ensure_estimate(batch, max(n for mb in lengths for n in mb), max(len(mb) for mb in lengths), batch_idx)
        current = _running_layout(strategy)
        in_window = batch_idx % trainer.accumulate_grad_batches != 0
        key = self._key(strategy, batch, current, in_window)
        looked_ahead = self._job is not None and self._job.key == key
        decision, seconds = self._job.join() if looked_ahead else self._decide(key)
        if looked_ahead:
            strategy.step_clock.add_background("plan", seconds)
        if self._job is not None and not looked_ahead:
            self._job.join()  # stale: the layout or the measurements changed since
        self._job = None
        layout = decision.layout
        if strategy.world_size > 1:  # every rank applies rank 0's decision
            layout = strategy.broadcast(layout)
        if layout != current:
            strategy.propose(
                PlanProposal(type(self).__name__, boundaries=layout.boundaries, widths=layout.widths, priority=self.priority)
            )
        self.history.append(DepthStep(batch_idx, layout, decision.action, decision.predicted_seconds, seconds, looked_ahead))
        self._residence.record(layout != current)
        found, upcoming = strategy.peek_next_batch() if self.lookahead else (False, None)
        if found:
            next_in_window = (batch_idx + 1) % trainer.accumulate_grad_batches != 0
            next_key = self._key(strategy, upcoming, layout, next_in_window)
            self._job = LookaheadJob(
                next_key, functools.partial(self._decide, next_key), "ElasticDepth-plan", strategy.plan_gate
            )

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Finish a decision still running in the background."""
        if self._job is not None:
            self._job.wait()
            self._job = None

    def _measure(self, strategy: PipelineStrategy, batch_idx: int) -> None:
        """Record the previous batch's reconfiguration seconds (maximum over ranks)."""
        application = getattr(strategy, "last_application", None)
        if application is None or application.batch_idx != batch_idx - 1:
            return
        migration = application.migration
        if migration is not None and migration.transfers:
            self._measured.append(strategy.costs.max_over_ranks(migration.seconds))

    def _key(self, strategy: PipelineStrategy, batch: Any, current: Layout, in_window: bool) -> _Key:
        costs = strategy.costs
        shapes = tuple(costs.shapes(costs.microbatch_lengths(batch, self.lengths_fn)))
        overhead = sum(self._measured) / len(self._measured) if self._measured else 0.0
        return _Key(costs.estimate.cost_model, shapes, current, overhead, in_window, self._residence.steps())

    def _decide(self, key: _Key) -> tuple[DepthDecision, float]:
        started = time.perf_counter()
        memory = self.device_memory
        if memory is None:
            memory = getattr(self._strategy.memory, "budget", None) or math.inf
        estimator = CostModelDepthEstimator(
            key.model, list(key.shapes), key.current.num_devices, float(memory), allow_recompute=False,
            include_gradients=key.in_window, migration_overhead=key.migration_overhead,
        )
        most = min(key.model.num_blocks, key.current.num_devices)
        decision = decide_depth(
            estimator, key.current, allow_memory_plan=False, deeper=most if self.deeper is None else self.deeper,
            migration_horizon=key.horizon,
        )
        return decision, time.perf_counter() - started


def _running_layout(strategy: PipelineStrategy) -> Layout:
    """The layout of the plan in use (one replica per stage when the plan has no widths)."""
    plan = strategy.plan
    widths = plan.widths or (1,) * plan.num_stages
    return Layout(plan.boundaries, widths)


def _refuse_other_planners(callbacks: Sequence[L.Callback]) -> None:
    """Refuse planners that decide what elastic depth decides, before training starts.

    ``ElasticRepartition`` and ``AutoPlanner`` propose boundaries for one replica per stage: the
    partition part has one winner per step, so the planners would undo each other's layouts (every
    layout is exact, but the run would follow neither planner). ``MemoryPlanner`` (and
    ``AutoPlanner``'s memory part) propose recompute/offload plans, which layouts with widths do not
    apply (``Regrouping.check_plan`` would stop the run at the first such step).

    Raises:
        ValueError: naming the callbacks to remove.
    """
    from lightning_pipe.callbacks.auto_planner import AutoPlanner
    from lightning_pipe.callbacks.elastic_repartition import ElasticRepartition
    from lightning_pipe.callbacks.memory_planner import MemoryPlanner

    clashing = sorted({type(c).__name__ for c in callbacks if isinstance(c, (ElasticRepartition, MemoryPlanner, AutoPlanner))})
    if clashing:
        raise ValueError(
            f"`ElasticDepth` chooses the stages, widths and boundaries of every step and runs layouts without memory "
            f"plans; the Trainer also has {', '.join(clashing)}, which would propose boundaries for one replica per "
            "stage or recompute/offload plans that layouts with widths do not apply. Remove them from `callbacks` "
            "(keep `ElasticDepth` for elastic depth), or remove `ElasticDepth` and turn `elastic_depth` off to use them."
        )
